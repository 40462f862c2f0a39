"""Fuzzing configuration loading: YAML is only ever safe-loaded, and any document or any value of any type in any
component's settings gives a ConfigError that names the key, never another exception.

Bounded for CI (derandomized); ``OTEL_GPU_FUZZ_SCALE`` / ``OTEL_GPU_FUZZ_RANDOM`` run a longer campaign
(benchmarks/fuzz/README.md).
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layout import source_files
from otel_gpu.collector import registry
from otel_gpu.collector.config import load_text, parse
from otel_gpu.config import ConfigError, build, yaml_keys

ROOT = Path(__file__).resolve().parent.parent


def fuzz(examples: int):
    """Hypothesis settings: ``examples`` scaled by OTEL_GPU_FUZZ_SCALE; derandomized unless OTEL_GPU_FUZZ_RANDOM=1."""
    scale = float(os.environ.get("OTEL_GPU_FUZZ_SCALE", "1") or 1)
    return settings(max_examples=max(1, int(examples * scale)), deadline=None, database=None,
                    derandomize=os.environ.get("OTEL_GPU_FUZZ_RANDOM") != "1",
                    suppress_health_check=list(HealthCheck), print_blob=True)


# -- YAML is only ever safe-loaded -------------------------------------------------------------------------------------

@pytest.mark.parametrize("tag", [
    "!!python/object/apply:os.mkdir [{path}]",
    "!!python/object/new:os.mkdir [{path}]",
    "!!python/name:os.system",
    "!!python/module:os",
    "!!python/object:collections.OrderedDict {{}}",
])
def test_python_tags_are_rejected_and_never_run(tmp_path, tag):
    marker = tmp_path / "pwned"
    text = (f"receivers: {{otlp: {{grpc: {tag.format(path=str(marker))}}}}}\n"
            "exporters: {debug: {}}\n"
            "service: {pipelines: {traces: {receivers: [otlp], exporters: [debug]}}}\n")
    with pytest.raises(ConfigError) as err:
        load_text(text, "evil.yaml")
    assert "evil.yaml" in str(err.value)
    assert not marker.exists()


def test_an_env_reference_cannot_smuggle_a_python_tag(tmp_path, monkeypatch):
    marker = tmp_path / "pwned-env"
    monkeypatch.setenv("OTEL_GPU_FUZZ_EVIL", f"!!python/object/apply:os.mkdir [{marker}]")
    text = ("receivers: {otlp: {grpc: {endpoint: '${env:OTEL_GPU_FUZZ_EVIL}'}}}\n"
            "exporters: {debug: {}}\n"
            "service: {pipelines: {traces: {receivers: [otlp], exporters: [debug]}}}\n")
    with pytest.raises(ConfigError):
        load_text(text)
    assert not marker.exists()


_UNSAFE = re.compile(r"yaml\.(?:load|full_load|unsafe_load|load_all|full_load_all|unsafe_load_all)\(|"
                     r"Loader\s*=\s*yaml\.(?:Loader|FullLoader|UnsafeLoader)|yaml\.Unsafe")


def test_no_code_path_loads_yaml_unsafely():
    """Every YAML the product reads (config files, scenarios, env values, Helm values) goes through safe_load."""
    offenders = []
    for path in source_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _UNSAFE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, offenders


# -- random documents ------------------------------------------------------------------------------------------------

_yaml_tokens = st.sampled_from(["receivers", "processors", "exporters", "service", "pipelines", "traces", "metrics",
                                "logs", "otlp", "debug", "store", "nvml", "nic", "xid", "attribution", "goodput",
                                "grpc", "http", "endpoint", ":", " ", "\n", "  ", "- ", "{", "}", "[", "]", ",", "&a",
                                "*a", "!!str", "!!int", "!!binary", "!!python/none", "!!map", "!!set", "?", "|", ">",
                                "'", '"', "#", "${env:HOME}", "${NOPE}", "${X:-1}", "null", "~", "1e309", "0x10",
                                "-", "yes", "<<: *a", "\t", "%YAML 1.1\n", "---\n", "...\n", "\x00", "\ud7ff",
                                "9" * 4400, "[" * 1200, "{a: " * 1200, "!!int", "!!float", "!!timestamp", "!!bool",
                                "!!binary", "!!omap", "!!pairs", "!!set"])


@fuzz(300)
@given(text=st.one_of(st.lists(_yaml_tokens, max_size=40).map("".join), st.text(max_size=200)))
def test_any_text_is_a_config_or_a_config_error(text):
    try:
        load_text(text, "fuzz.yaml")
    except ConfigError as exc:
        assert all(p.startswith("fuzz.yaml") for p in exc.problems), exc.problems


@pytest.mark.parametrize("text", [
    "receivers: {otlp: {grpc: {max_workers: " + "9" * 5000 + "}}}",  # int() refuses over 4,300 digits
    "receivers: " + "[" * 5000 + "]" * 5000,  # PyYAML composes recursively
    "receivers: " + "{a: " * 3000 + "1" + "}" * 3000,
    "- " * 3000 + "1",
    "!!int",  # PyYAML: IndexError
    "receivers: !!float",
    "receivers: !!timestamp x",  # AttributeError
    "receivers: !!bool maybe",  # KeyError
])
def test_documents_pyyaml_itself_chokes_on_are_config_errors(text):
    """Regression: these raised ValueError, RecursionError, IndexError, KeyError or AttributeError out of
    load_text instead of a ConfigError."""
    with pytest.raises(ConfigError) as err:
        load_text(text, "huge.yaml")
    assert str(err.value).startswith("huge.yaml")


def test_an_env_value_pyyaml_chokes_on_stays_a_string(monkeypatch):
    monkeypatch.setenv("OTEL_GPU_FUZZ_BIG", "9" * 5000)
    text = ("receivers: {otlp: {grpc: {max_workers: '${OTEL_GPU_FUZZ_BIG}'}}}\n"
            "exporters: {debug: {}}\n"
            "service: {pipelines: {traces: {receivers: [otlp], exporters: [debug]}}}\n")
    with pytest.raises(ConfigError) as err:
        load_text(text, "env.yaml")
    assert "max_workers" in str(err.value)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(),
                     st.sampled_from([10**400, -(10**400), float("nan"), float("inf"), float("-inf")]),
                     st.text(max_size=15), st.sampled_from(["127.0.0.1:0", "otlp", "debug", "traces", "${NOPE}",
                                                             "${X:-[1, 2]}", "", "[::1]:0", "a:b:c", "1e999"]))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.one_of(st.text(max_size=8), st.integers(), st.none(), st.booleans()),
                                         inner, max_size=3), max_leaves=10)
_section = st.dictionaries(st.sampled_from(["otlp", "debug", "nvml", "nic", "xid", "store", "attribution", "goodput",
                                            "prometheus", "otlp/x", "bogus", "9bad", "otlp//", "", "a b"]),
                           _values, max_size=3)


@fuzz(200)
@given(doc=st.one_of(
    _values,
    st.fixed_dictionaries({}, optional={"receivers": _section | _values, "processors": _section | _values,
                                        "exporters": _section | _values, "extensions": _values,
                                        "connectors": _values, "bogus": _values,
                                        "service": st.fixed_dictionaries({}, optional={
                                            "pipelines": st.dictionaries(
                                                st.sampled_from(["traces", "metrics", "logs", "traces/a", "spans",
                                                                 ""]),
                                                st.fixed_dictionaries({}, optional={
                                                    "receivers": _values, "processors": _values,
                                                    "exporters": _values, "bogus": _values}) | _values,
                                                max_size=3) | _values,
                                            "telemetry": _values, "extra": _values}) | _values}),
))
def test_any_document_is_a_config_or_a_config_error(doc):
    try:
        parse(doc, "fuzz.yaml")
    except ConfigError as exc:
        assert exc.problems and all(p.startswith("fuzz.yaml") for p in exc.problems), exc.problems
    try:  # the same document through YAML text (non-string keys, anchors and all)
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return
    try:
        load_text(text, "fuzz.yaml")
    except ConfigError:
        pass


# -- random values in every component's settings ------------------------------------------------------------------------

def _components() -> list[tuple[str, str]]:
    return [(kind, name) for kind in ("receiver", "processor", "exporter") for name in registry.known_types(kind)]


def _fields(cls, prefix: str = "") -> list[str]:
    """Every setting as written in YAML (durations without their unit suffix), nested ones as dotted paths
    (``grpc.endpoint``)."""
    out = []
    for key, spec in yaml_keys(cls).items():
        out.append(prefix + key)
        hint = __import__("typing").get_type_hints(cls).get(spec.field)
        for arg in (hint, *__import__("typing").get_args(hint)):
            if dataclasses.is_dataclass(arg):
                out.extend(_fields(arg, f"{prefix}{key}."))
    return out


# Settings a component requires (no default): set to a valid value so that the drawn key is the only bad one.
REQUIRED = {("exporter", "otlp"): {"endpoint": "127.0.0.1:4317"},
            ("exporter", "otlphttp"): {"endpoint": "http://127.0.0.1:4318"},
            ("processor", "memory_limiter"): {"limit_mib": 400}}


def _nest(dotted: str, value, base: dict | None = None) -> dict:
    doc = dict(base or {})
    node = doc
    parts = dotted.split(".")
    for part in parts[:-1]:
        node[part] = dict(node[part]) if isinstance(node.get(part), dict) else {}
        node = node[part]
    node[parts[-1]] = value
    return doc


@pytest.mark.parametrize("kind,name", _components())
def test_every_setting_of_every_component_takes_any_value_or_names_the_key(kind, name):
    factory = registry.load_factory(kind, name)
    fields = _fields(factory.config_class)
    path = f"{kind}s.{name}"
    base = REQUIRED.get((kind, name), {})
    build(factory.config_class, base, path)  # valid as it stands

    @fuzz(60)
    @given(key=st.sampled_from(fields + ["not_a_setting"]), value=_values)
    def check(key, value):
        try:
            build(factory.config_class, _nest(key, value, base), path)
        except ConfigError as exc:
            text = str(exc)
            assert all(p.startswith(path) for p in exc.problems), exc.problems
            # The key set, or (for a check across settings, e.g. otlp's "enable at least one protocol") another
            # setting of the same component that the message tells the user to change.
            assert any(name.rsplit(".", 1)[-1] in text for name in [key, *fields]), (key, text)

    check()


@pytest.mark.parametrize("kind,name", _components())
def test_nan_and_huge_numbers_are_config_errors_for_every_number_setting(kind, name):
    """Regression: NaN passed every ``> 0`` check (receivers.otlp.grpc.max_recv_msg_size_mib: .nan was accepted and
    crashed the receiver at start); an integer of 400 digits raised OverflowError instead of a ConfigError."""
    import typing

    factory = registry.load_factory(kind, name)
    base = REQUIRED.get((kind, name), {})
    path = f"{kind}s.{name}"
    for key in _fields(factory.config_class):
        owner, leaf = factory.config_class, key
        for part in key.split(".")[:-1]:
            hint = typing.get_type_hints(owner)[yaml_keys(owner)[part].field]
            owner = next(a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a))
            leaf = key.rsplit(".", 1)[-1]
        if typing.get_type_hints(owner)[yaml_keys(owner)[leaf].field] is not float:
            continue
        for bad in (float("nan"), 10**400):
            with pytest.raises(ConfigError) as err:
                build(factory.config_class, _nest(key, bad, base), path)
            assert leaf in str(err.value), str(err.value)
