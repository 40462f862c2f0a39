"""Checked docs: every ``>>>`` example in the product's docstrings runs; each component README's settings table
names the fields of its config dataclass with their defaults; relative links in markdown files point to files that
exist."""
from __future__ import annotations

import dataclasses
import doctest
import importlib
import io
import re
import subprocess
import types
import typing
from pathlib import Path

import pytest
import yaml

from otel_gpu.collector import registry
from layout import module_name, source_files
from otel_gpu.config import parse_duration, yaml_keys

ROOT = Path(__file__).resolve().parents[1]
# Importing these has effects (instrumenting this process, the interpreter bootstrap): they carry no examples.
_NOT_IMPORTED = {"otel_gpu.auto", "otel_gpu.__main__"}


# -- doctests --------------------------------------------------------------------------------------------------------
def _modules_with_examples() -> list[str]:
    found = []
    for path in source_files():
        if "_bootstrap" in path.parts or ">>>" not in path.read_text(encoding="utf-8"):
            continue
        name = module_name(path)
        if name not in _NOT_IMPORTED:
            found.append(name)
    return found


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    assert len(MODULES) >= 30 and "otel_gpu.receivers.xid.parse" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(module, name) if t.examples]
    assert tests, f"{name}: '>>>' in the source but no example found in its docstrings"
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test, out=out.write)
    assert runner.failures == 0, out.getvalue()


# -- component READMEs vs config dataclasses ---------------------------------------------------------------------
def _components() -> list[tuple[str, type]]:
    """(README path relative to the root, config dataclass) of every built-in component that has a README."""
    out = {}
    for kind, table in registry.BUILTIN.items():
        for type_name in table:
            cls = registry.load_factory(kind, type_name).config_class
            readme = Path(importlib.import_module(cls.__module__).__file__).parent / "README.md"
            if readme.exists():
                out.setdefault(str(readme.relative_to(ROOT)), cls)
    from otel_gpu.instrumentation.config import InstrumentationConfig

    out["otel_gpu/instrumentation/README.md"] = InstrumentationConfig
    return sorted(out.items())


COMPONENTS = _components()


def _settings_table(text: str) -> list[list[str]]:
    """The rows of the table whose header is ``| setting | ... | default | ...``, as cells (header included)."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if not rows:
            if cells and cells[0] == "setting" and "default" in cells:
                rows.append(cells)
        elif cells is None:
            break
        elif not set(line) <= set("|-: "):
            rows.append(cells)
    return rows


def _field(cls: type, dotted: str):
    """(dataclass field, seconds per unit or None) for the setting ``a.b.c``: YAML keys (a duration field
    ``interval_s`` is the key ``interval``) or field names, through nested (optional) dataclass fields."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        key = yaml_keys(cls).get(part)
        name, scale = (key.field, key.scale) if key is not None else (part, None)
        if name not in fields:
            return None, None
        if i == len(parts) - 1:
            return fields[name], scale
        hint = typing.get_type_hints(cls)[name]
        nested = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)] if isinstance(
            hint, (types.UnionType, typing._UnionGenericAlias)) else [hint]
        if not nested or not dataclasses.is_dataclass(nested[0]):
            return None, None
        cls = nested[0]
    return None, None


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


_EMPTY = (None, "", [], {}, (), dataclasses.MISSING)


def _same(doc, code) -> bool:
    if dataclasses.is_dataclass(code) and isinstance(doc, dict):  # the README names the settings that matter
        return all(_same(v, getattr(code, k, dataclasses.MISSING)) for k, v in doc.items())
    if isinstance(code, (list, tuple)) and isinstance(doc, str) and doc.endswith(", ..."):
        return [d.strip() for d in doc[:-5].split(",")] == list(code)[:doc.count(",")]
    if isinstance(code, bool) or isinstance(doc, bool):
        return doc is code
    if isinstance(code, (int, float)) and isinstance(doc, (int, float)):
        return float(doc) == float(code)
    if isinstance(code, (list, tuple)):
        doc = [d.strip() for d in doc.split(",")] if isinstance(doc, str) else doc
        return list(doc or []) == list(code)
    return doc == code or str(doc) == str(code)


def _check_row(cls: type, cells: list[str], default_col: int) -> list[str]:
    names = re.findall(r"`([a-z_][a-z0-9_.]*)`", cells[0]) or re.findall(r"^([a-z_][a-z0-9_.]*)$", cells[0])
    if not names:
        return []  # a row about something that is not a setting (e.g. an environment variable only)
    raw = cells[default_col]
    values = [v.strip() for v in raw.split(" / ")] if len(names) > 1 and " / " in raw else [raw] * len(names)
    problems = []
    for name, value in zip(names, values):
        f, scale = _field(cls, name)
        if f is None:
            problems.append(f"{name}: not a field of {cls.__name__}")
            continue
        code = _default(f)
        # a literal, maybe followed by a remark in parentheses: `grpc`, 2.0, `1s`, `{}` (on)
        literal = re.fullmatch(r"`([^`]*)`(?: \(.*\))?", value) or re.fullmatch(r"-?[0-9.]+|true|false|null", value)
        if literal is None:  # words ("all", "off", "host name", "required"): only for an empty or unset default
            if value == "see above" and isinstance(code, (list, dict)):
                continue  # the README lists it in full above the table
            if code not in _EMPTY and not dataclasses.is_dataclass(code) and not isinstance(code, dict):
                problems.append(f"{name}: README says {value!r}, the code's default is {code!r}")
            continue
        text = literal.group(1) if literal.re.pattern.startswith("`") else literal.group(0)
        try:
            doc = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            doc = text
        if text == '""':
            doc = ""
        if scale is not None and isinstance(doc, str):
            try:
                doc = parse_duration(doc) / scale
            except ValueError:
                pass
        if not _same(doc, code):
            problems.append(f"{name}: README says {value}, the code's default is {code!r}")
    return problems


@pytest.mark.parametrize("readme,cls", COMPONENTS, ids=[c[0] for c in COMPONENTS])
def test_readme_settings_table_matches_the_config_dataclass(readme, cls):
    rows = _settings_table((ROOT / readme).read_text(encoding="utf-8"))
    assert rows, f"{readme}: no settings table (header '| setting | default | meaning |')"
    header, body = rows[0], rows[1:]
    # The instrumentation's settings are also environment variables: its table has that column too.
    assert header in (["setting", "default", "meaning"], ["setting", "environment", "default", "meaning"]), \
        f"{readme}: one style for every settings table: '| setting | default | meaning |' (got {header})"
    default_col = header.index("default")
    problems = [p for cells in body for p in _check_row(cls, cells, default_col)]
    documented = {n.split(".")[0] for cells in body
                  for n in re.findall(r"`([a-z_][a-z0-9_.]*)`", cells[0]) or [cells[0]]}
    keys = {k.field: key for key, k in yaml_keys(cls).items()}
    if "environment" not in header:  # the instrumentation's are instrument() keywords, not YAML keys
        problems += [f"{name}: the table names settings as YAML writes them: `{keys[name]}`" for name in documented
                     if name in keys and keys[name] != name]
    missing = [keys.get(f.name, f.name) for f in dataclasses.fields(cls)
               if f.name not in documented and keys.get(f.name) not in documented]
    assert not problems and not missing, "\n".join(problems + [f"{m}: not in the table" for m in missing])


def test_the_table_check_catches_drift():
    @dataclasses.dataclass
    class Cfg:
        size: int = 2000
        name: str = ""
        interval_s: float = 0.5

    assert _check_row(Cfg, ["`size`", "`256`", ""], 1) == ["size: README says `256`, the code's default is 2000"]
    assert _check_row(Cfg, ["`sise`", "`2000`", ""], 1) == ["sise: not a field of Cfg"]
    assert _check_row(Cfg, ["`size` / `name`", "`2000` / `\"\"`", ""], 1) == []
    assert _check_row(Cfg, ["`size`", "many", ""], 1) == ["size: README says 'many', the code's default is 2000"]
    assert _check_row(Cfg, ["`interval`", "`500ms`", ""], 1) == []
    assert _check_row(Cfg, ["`interval`", "`5s`", ""], 1) == ["interval: README says `5s`, the code's default is 0.5"]


# -- the instrumentation's environment variables vs config.VARIABLES -------------------------------------------------
def _variable_pattern(token: str) -> re.Pattern:
    """A README spelling of variables as a regex: ``[SIGNAL_]`` optional signal, ``{A,B}`` choices, ``*`` any."""
    text = re.escape(token).replace(r"\[SIGNAL_\]", "((TRACES|METRICS|LOGS)_)?").replace(r"\*", "[A-Z_]*")
    text = re.sub(r"\\\{([A-Z,]+)\\\}", lambda m: "(" + m.group(1).replace(",", "|") + ")", text)
    return re.compile(text)


def test_the_instrumentation_readme_lists_every_variable_of_the_config_table():
    from otel_gpu.instrumentation.config import ENV, VARIABLES

    text = (ROOT / "otel_gpu/instrumentation/README.md").read_text(encoding="utf-8")
    rows = _settings_table(text)
    header, body = rows[0], rows[1:]
    env_col, default_col = header.index("environment"), header.index("default")
    problems, in_table = [], set()
    for cells in body:
        names = re.findall(r"`([A-Z][A-Z0-9_]*)`", cells[env_col])
        in_table.update(names)
        field = re.findall(r"^([a-z_]+)$", cells[0])
        if field:  # an option: its variable is ENV's (its default is checked against the dataclass above)
            if names != [ENV.get(field[0])]:
                problems.append(f"{field[0]}: README says {names}, config.ENV says {ENV.get(field[0])}")
        else:  # a variable without an option: the default is the table's
            for name in names:
                doc = cells[default_col].strip("`")
                code = VARIABLES.get(name, ("<missing>", ""))[0]
                if doc != code:
                    problems.append(f"{name}: README default {doc!r}, config.VARIABLES says {code!r}")
    settings = set(ENV.values()) | {v for v, (_, kind) in VARIABLES.items() if kind == "setting"}
    problems += [f"{v}: in config.VARIABLES as a setting, not in the README's settings table"
                 for v in sorted(settings - in_table)]
    problems += [f"{v}: in the README's settings table, not a setting in config.VARIABLES"
                 for v in sorted(in_table - settings)]
    # the SDK's variables: each matched by a spelling in the README (its SDK tables)
    patterns = [_variable_pattern(t) for t in re.findall(r"`(OTEL_[A-Z0-9_\[\]{},*]+)`", text)]
    spelled = [t.lstrip("_") for t in re.findall(r"`(_[A-Z][A-Z_]+)`", text)]  # `_CLIENT_KEY` after a full name
    for var in sorted(v for v, (_, kind) in VARIABLES.items() if kind == "sdk"):
        if not any(p.fullmatch(var) for p in patterns) and not any(var.endswith("_" + s) for s in spelled):
            problems.append(f"{var}: read by the instrumentation, not in README.md")
    assert not problems, "\n".join(problems)


def test_the_variable_check_catches_drift(monkeypatch):
    from otel_gpu.instrumentation import config

    monkeypatch.setitem(config.VARIABLES, "OTEL_GPU_EXPORT_BUFFER_MIB", ("16", "setting"))
    monkeypatch.setitem(config.VARIABLES, "OTEL_GPU_NEW_SETTING", ("", "setting"))
    monkeypatch.setitem(config.VARIABLES, "OTEL_FOO_BAR", ("", "sdk"))
    with pytest.raises(AssertionError, match="(?s)README default '8'.*OTEL_GPU_NEW_SETTING.*OTEL_FOO_BAR"):
        test_the_instrumentation_readme_lists_every_variable_of_the_config_table()


def test_the_variable_spellings_expand_as_the_readme_means():
    assert _variable_pattern("OTEL_EXPORTER_OTLP_[SIGNAL_]TIMEOUT").fullmatch("OTEL_EXPORTER_OTLP_LOGS_TIMEOUT")
    assert _variable_pattern("OTEL_EXPORTER_OTLP_[SIGNAL_]TIMEOUT").fullmatch("OTEL_EXPORTER_OTLP_TIMEOUT")
    assert _variable_pattern("OTEL_EXPORTER_OTLP_{TRACES,LOGS}_ENDPOINT").fullmatch("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT")
    assert not _variable_pattern("OTEL_EXPORTER_OTLP_{TRACES,LOGS}_ENDPOINT").fullmatch("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert _variable_pattern("OTEL_BLRP_*").fullmatch("OTEL_BLRP_MAX_QUEUE_SIZE")


# -- links -----------------------------------------------------------------------------------------------------------
def _markdown_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True)
    files = out.stdout.split() if out.returncode == 0 else []
    return files or [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.md") if ".venv" not in p.parts]


def test_relative_links_in_markdown_point_to_files_that_exist():
    broken = []
    for md in _markdown_files():
        text = re.sub(r"```.*?```", "", (ROOT / md).read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):
                continue  # an anchor in the same file, or a URL
            if not (ROOT / md).parent.joinpath(path).resolve().exists():
                broken.append(f"{md}: {target}")
    assert broken == []
