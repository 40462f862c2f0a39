"""Coverage-guided fuzzing of otel-gpu's parsers and processors, in-process, with atheris when it is installed.

The targets are the same properties the CI tests check (tests/test_fuzz_*.py), as plain functions over bytes:

- ``otlp``: bytes -> ``Batch.from_bytes`` for each signal and OTLP/JSON ``Batch.from_json``; whatever parses goes
  through the attribution and goodput processors (and their clocks) and must re-serialize. Only MalformedBatch may
  come out.
- ``xid``: bytes -> a kernel-log line -> ``parse_line`` and the receiver's ``handle_line``; never raises.
- ``config``: bytes -> YAML text -> ``load_text``; only ConfigError may come out.

Usage::

    pip install atheris                      # needs clang; optional
    python benchmarks/fuzz/atheris_harness.py otlp -max_total_time=600 -rss_limit_mb=4096 corpus/otlp
    # without atheris: random inputs through Hypothesis' fuzz_one_input for the given number of seconds
    python benchmarks/fuzz/atheris_harness.py otlp --seconds 60

Exit status 0 when no input broke a property; a crash prints the input (atheris writes crash-<sha1> files).
"""
from __future__ import annotations

import logging
import os
import sys
import time

from hypothesis import given, settings
from hypothesis import strategies as st


def _otlp_target():
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.component import ComponentHost
    from otel_gpu.config import build
    from otel_gpu.pdata import Batch, MalformedBatch, Signal
    from otel_gpu.processors.attribution import FACTORY as ATTRIBUTION
    from otel_gpu.processors.goodput import FACTORY as GOODPUT

    class Keep:
        def consume(self, batch):
            batch.to_bytes()

    def host(cid):
        return ComponentHost(cid, PrometheusSelfTelemetry(), {s: Keep() for s in Signal})

    attribution = ATTRIBUTION.create(build(ATTRIBUTION.config_class, {}, "attribution"), host("attribution"))
    goodput = GOODPUT.create(build(GOODPUT.config_class, {}, "goodput"), host("goodput"))

    def target(data: bytes) -> None:
        signal = list(Signal)[data[0] % 3] if data else Signal.LOGS
        for parse in (Batch.from_bytes, Batch.from_json):
            try:
                batch = parse(signal, data[1:])
            except MalformedBatch:
                continue
            for proc in (attribution, goodput):
                proc.process(batch).to_bytes()
            attribution.tick(time.time() + 3600)
            goodput.report()

    return target


def _xid_target():
    from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
    from otel_gpu.component import ComponentHost
    from otel_gpu.receivers.xid import XidReceiver
    from otel_gpu.receivers.xid.config import XidReceiverConfig
    from otel_gpu.receivers.xid.parse import parse_line

    receiver = XidReceiver(XidReceiverConfig(backend="none"), ComponentHost("xid", PrometheusSelfTelemetry()))

    def target(data: bytes) -> None:
        line = data.decode(errors="replace")
        if not data.startswith(b"N") and b"NVRM" not in data:  # steer half the inputs into the interesting branch
            line = "NVRM: Xid (PCI:" + line
        assert receiver.handle_line(line) is (parse_line(line) is not None)

    return target


def _config_target():
    from otel_gpu.collector.config import load_text
    from otel_gpu.config import ConfigError

    def target(data: bytes) -> None:
        try:
            load_text(data.decode(errors="replace"), "fuzz.yaml")
        except ConfigError:
            pass

    return target


TARGETS = {"otlp": _otlp_target, "xid": _xid_target, "config": _config_target}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in TARGETS:
        print(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [atheris/libFuzzer flags | --seconds N]", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)  # the receivers log every XID they see
    target = TARGETS[argv[1]]()
    try:
        import atheris
    except ImportError:
        atheris = None
    if atheris is not None and "--seconds" not in argv:
        atheris.Setup([argv[0], *argv[2:]], target)
        atheris.Fuzz()
        return 0
    seconds = float(argv[argv.index("--seconds") + 1]) if "--seconds" in argv else 60.0

    @settings(database=None, deadline=None)
    @given(st.binary(max_size=4096))
    def prop(data):
        target(data)

    deadline, n = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        prop.hypothesis.fuzz_one_input(os.urandom(int.from_bytes(os.urandom(2), "big") % 4096 + 1))
        n += 1
    print(f"{argv[1]}: {n} random inputs in {seconds:g}s, no property broken")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
