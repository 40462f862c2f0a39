"""Fixtures shared by the tests.

- ``capture_exporter``: the ``capture`` exporter (``otel_gpu.testing.capture``, which keeps every batch) is
  available to collector configs for the test (``capture_exporter_module``: for a module-scoped fixture);
  ``collector.component("exporter", "capture")`` is the instance to assert on.
- ``otlp_sink``: a running OTLP gRPC sink (``otel_gpu.testing.otlp_sink.OtlpSink``) on a free loopback port.
- ``collector_process``: starts ``otel-gpu collector`` subprocesses from YAML text (``tests/collector_proc.py``) and
  stops every one of them when the test ends.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from otel_gpu.collector import registry

CAPTURE = "otel_gpu.testing.capture"


@contextlib.contextmanager
def _capture_registered() -> Iterator[None]:
    table = registry.BUILTIN["exporter"]
    saved = table.get("capture")
    table["capture"] = CAPTURE
    try:
        yield
    finally:
        if saved is None:
            table.pop("capture", None)
        else:
            table["capture"] = saved


@pytest.fixture
def capture_exporter() -> Iterator[str]:
    with _capture_registered():
        yield "capture"


@pytest.fixture(scope="module")
def capture_exporter_module() -> Iterator[str]:
    with _capture_registered():
        yield "capture"


@pytest.fixture
def otlp_sink():
    from otel_gpu.testing.otlp_sink import OtlpSink

    with OtlpSink() as sink:
        yield sink


@pytest.fixture
def collector_process(tmp_path) -> Iterator[Callable]:
    from collector_proc import start_collector

    started = []

    def start(config_text: str, **kwargs):
        proc = start_collector(config_text, kwargs.pop("tmp_path", tmp_path / f"collector{len(started)}"), **kwargs)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.alive:
            proc.stop(10)
