"""Where the source files are and what they are called once installed: read from pyproject.toml's one table."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
#: import name -> folder, e.g. ``otel_gpu.receivers`` -> ``receivers``
PACKAGE_DIR: dict[str, str] = dict(_SETUPTOOLS["package-dir"])
PACKAGES: list[str] = list(_SETUPTOOLS["packages"])
#: the top-level folders that hold installed code
SOURCE_FOLDERS: tuple[str, ...] = tuple(sorted(set(PACKAGE_DIR.values())))


def module_name(path: Path) -> str:
    """The import name of a source file (``receivers/nvml/receiver.py`` -> ``otel_gpu.receivers.nvml.receiver``)."""
    rel = path.resolve().relative_to(ROOT).with_suffix("")
    name, folder = max(((n, f) for n, f in PACKAGE_DIR.items() if rel.parts[:len(Path(f).parts)] == Path(f).parts),
                       key=lambda item: len(Path(item[1]).parts))
    parts = [name, *rel.parts[len(Path(folder).parts):]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    """Every installed ``.py`` file."""
    return sorted(p for folder in SOURCE_FOLDERS for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
