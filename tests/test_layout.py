"""The file tree shows who each file serves: every package is installed, the top of ``otel_gpu`` holds only its
public faces, and no module reaches into a private name of another package."""
from __future__ import annotations

import ast
from pathlib import Path

from layout import PACKAGES, ROOT, module_name, source_files

# The public faces at the top of otel_gpu: for training code (the package itself, auto), for component authors
# (component, config, pdata, otlp_build) and for whoever reads a verdict (failure). Everything else lives in a
# folder named for its audience: collector/, commands/, instrumentation/, supervisor/, exporters/, ...
TOP_LEVEL = {"__init__.py", "__main__.py", "auto.py", "component.py", "config.py", "failure.py", "otlp_build.py",
             "pdata.py"}


def test_pyproject_lists_every_package_folder_and_no_other():
    found = {module_name(p) for p in source_files() if p.name == "__init__.py"}
    assert found == set(PACKAGES), {"missing from pyproject.toml": sorted(found - set(PACKAGES)),
                                    "listed but absent": sorted(set(PACKAGES) - found)}


def test_the_top_of_otel_gpu_holds_only_the_public_faces():
    assert {p.name for p in (ROOT / "otel_gpu").glob("*.py")} == TOP_LEVEL


def _package_of(name: str, is_package: bool) -> str:
    return name if is_package else name.rpartition(".")[0]


def _private_reaches(path: Path) -> list[str]:
    """Imports in ``path`` of a private name (a dotted part starting with ``_``) that lives in another package.

    A package's own private modules (and those of its subpackages) are its business; ``from otel_gpu.pdata import
    Batch`` is public, ``from otel_gpu.instrumentation._hot import NS`` from the supervisor is not.
    """
    me = module_name(path)
    mine = _package_of(me, path.name == "__init__.py")
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in targets:
            if not target.startswith("otel_gpu"):
                continue
            parts = target.split(".")
            private = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
            if private is None:
                continue
            owner = ".".join(parts[:private])  # the package whose private name this is
            if not (mine == owner or mine.startswith(owner + ".")):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}")
    return out


def test_no_module_imports_a_private_name_of_another_package():
    reaches = [r for p in source_files() for r in _private_reaches(p)]
    assert not reaches, "\n".join(reaches)


def test_the_private_import_check_catches_a_reach(tmp_path, monkeypatch):
    fake = ROOT / "otel_gpu" / "supervisor" / "_probe_for_test.py"
    assert not fake.exists()
    fake.write_text("from otel_gpu.instrumentation._hot import NS\nfrom otel_gpu.supervisor._proctree import x\n")
    try:
        assert _private_reaches(fake) == ["otel_gpu/supervisor/_probe_for_test.py:1: otel_gpu.instrumentation._hot.NS"]
    finally:
        fake.unlink()
