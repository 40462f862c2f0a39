"""Fuzzing the host-side parsers: kernel-log XID lines and sysfs NIC counter files.

Hostile or broken input (garbage, empty files, negative, huge, wrapping, non-numeric counters, files that appear and
vanish, XID lines with absurd numbers) must never raise out of the receiver, never stop the XID follower, and never
produce a negative or non-finite rate or cumulative counter.

Bounded for CI (derandomized, a few hundred examples); ``OTEL_GPU_FUZZ_SCALE=50 OTEL_GPU_FUZZ_RANDOM=1`` runs a
longer, random campaign (see benchmarks/fuzz/README.md).
"""
from __future__ import annotations

import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost
from otel_gpu.pdata import Signal
from otel_gpu.receivers.nic import NicReceiver
from otel_gpu.receivers.nic.config import NicReceiverConfig
from otel_gpu.receivers.nic.receiver import CounterTracker
from otel_gpu.receivers.xid import XidReceiver
from otel_gpu.receivers.xid.config import XidReceiverConfig
from otel_gpu.receivers.xid.parse import parse_line


def fuzz(examples: int):
    """Hypothesis settings: ``examples`` scaled by OTEL_GPU_FUZZ_SCALE; derandomized unless OTEL_GPU_FUZZ_RANDOM=1."""
    scale = float(os.environ.get("OTEL_GPU_FUZZ_SCALE", "1") or 1)
    return settings(max_examples=max(1, int(examples * scale)), deadline=None, database=None,
                    derandomize=os.environ.get("OTEL_GPU_FUZZ_RANDOM") != "1",
                    suppress_health_check=list(HealthCheck), print_blob=True)


class Keep:
    def __init__(self):
        self.batches = []

    def consume(self, batch):
        self.batches.append(batch)


class Host(ComponentHost):
    """A real ComponentHost that also remembers every log_once key (a guarded failure the receiver swallowed)."""

    def __init__(self, cid: str, consumers):
        super().__init__(cid, PrometheusSelfTelemetry(), consumers)
        self.swallowed: list = []
        inner = self.log_once

        def log_once(key, level, msg, *args, **kw):
            self.swallowed.append((key, msg % args if args else msg))
            inner(key, level, msg, *args, **kw)

        self.log_once = log_once


# -- XID lines --------------------------------------------------------------------------------------------------------

_numbers = st.one_of(st.integers(min_value=-5, max_value=200), st.integers(min_value=0, max_value=10**40),
                     st.text("0123456789٠١٢٣٤٥٦٧٨٩", min_size=1, max_size=30),
                     st.sampled_from(["9" * 5000, "1" + "0" * 19, "0" * 40 + "79"]))  # int() refuses > 4,300 digits
_pci = st.one_of(st.just("0000:3b:00"), st.just("0000:3b:00.0"), st.text("0123456789abcdefABCDEF:.", max_size=40))


@st.composite
def xid_lines(draw) -> str:
    prefix = draw(st.sampled_from(["", "6,1234,5678901234,-;", "Dec  3 13:33:35 n1 kernel: [ 12.5] "]))
    if draw(st.booleans()):
        prefix = f"{draw(_numbers)},{draw(_numbers)},{draw(_numbers)},-;"
    tail = draw(st.sampled_from(["", ", pid=1234, name=python, GPU has fallen off the bus.", ", pid='<unknown>'"]))
    if draw(st.booleans()):
        tail = f", pid={draw(_numbers)}, {draw(st.text(max_size=50))}"
    return f"{prefix}NVRM: Xid (PCI:{draw(_pci)}): {draw(_numbers)}{tail}"


@pytest.fixture(scope="module")
def xid_receiver():
    keep = Keep()
    host = Host("xid", {Signal.LOGS: keep})
    return XidReceiver(XidReceiverConfig(backend="none"), host), keep


@fuzz(400)
@given(line=st.one_of(xid_lines(), st.text(max_size=300),
                      st.binary(max_size=300).map(lambda b: b.decode(errors="replace"))))
def test_any_kernel_log_line_is_parsed_or_ignored_never_raises(xid_receiver, line):
    receiver, keep = xid_receiver
    before = len(keep.batches)
    xid = parse_line(line)
    # handle_line is what the follower thread calls for every line: an exception there stops the receiver for good.
    assert receiver.handle_line(line) is (xid is not None)
    if xid is not None:
        assert len(keep.batches) == before + 1
        assert 0 <= xid.code < 2**31 and (xid.pid is None or 0 <= xid.pid < 2**63)
        keep.batches[-1].to_bytes()  # the record serializes (every int fits its protobuf field)
    assert not receiver.host.swallowed


def test_a_hostile_line_does_not_stop_the_follower(tmp_path):
    """Regression: an XID line with a code or pid past int64 raised in emit() and ended the follower thread."""
    import time

    log = tmp_path / "kern.log"
    log.write_text("")
    keep = Keep()
    receiver = XidReceiver(XidReceiverConfig(path=str(log), backend="none", poll_interval_s=0.05,
                                                   from_beginning=True),
                           Host("xid", {Signal.LOGS: keep}))
    receiver.start()
    try:
        with open(log, "a") as f:
            f.write("NVRM: Xid (PCI:0000:3b:00): 99999999999999999999999, pid=1\n"
                    "NVRM: Xid (PCI:0000:3b:00): 79, pid=99999999999999999999999\n"
                    "NVRM: Xid (PCI:0000:3b:00): 48, pid=7, DBE\n")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(keep.batches) < 2:
            time.sleep(0.05)
        assert receiver._thread.is_alive()
    finally:
        receiver.shutdown(2)
    codes = [kv.value.int_value for b in keep.batches for rl in b.message.resource_logs for sl in rl.scope_logs
             for lr in sl.log_records for kv in lr.attributes if kv.key == "gpu.xid.code"]
    assert codes == [79, 48], codes  # the absurd code is dropped, the absurd pid is left out


# -- sysfs counters ---------------------------------------------------------------------------------------------------

@fuzz(300)
@given(readings=st.lists(st.integers(min_value=0, max_value=2**64 - 1) | st.integers(0, 2**32 - 1)
                         | st.sampled_from([0, 2**31, 2**32 - 1, 2**63, 2**64 - 1]), min_size=1, max_size=30),
       steps=st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=30, max_size=30))
def test_counter_tracker_never_negative(readings, steps):
    tracker, t = CounterTracker(0), 0.0
    for i, raw in enumerate(readings):
        t += steps[i]
        rate = tracker.update(raw, t, i)
        assert rate is None or (rate >= 0 and math.isfinite(rate))
        assert tracker.cumulative >= 0


_IB = "class/infiniband/mlx5_0/ports/1"
_ETH = "class/net/eth0"
_FILES = [f"{_IB}/counters/symbol_error", f"{_IB}/counters/port_xmit_data", f"{_IB}/counters/link_downed",
          f"{_IB}/hw_counters/out_of_buffer", f"{_IB}/state", f"{_IB}/phys_state", f"{_IB}/rate",
          f"{_ETH}/statistics/rx_bytes", f"{_ETH}/statistics/rx_errors", f"{_ETH}/operstate", f"{_ETH}/carrier",
          f"{_ETH}/speed", f"{_ETH}/carrier_changes"]

_garbage = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(lambda n: f"{n}\n".encode()),
    st.sampled_from([b"", b"\n", b" ", b"-1\n", b"0x10\n", b"1e9\n", b"nan\n", b"inf\n", b"-inf Gb/sec\n",
                     b"18446744073709551615\n", b"18446744073709551616\n", b"4294967295\n", b"4: ACTIVE\n",
                     b"5: LinkUp\n", b"400 Gb/sec (4X NDR)\n", b"-400 Gb/sec\n", b"nan Gb/sec\n", b"up\n",
                     b"down\n", b"1_000\n", b"\x00\xff\xfe", b"9" * 300]),
    st.binary(max_size=64),
    st.none(),  # the file vanishes
)


def _write(root, rel: str, data: bytes | None) -> None:
    path = os.path.join(root, rel)
    if data is None:
        if os.path.exists(path):
            os.unlink(path)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _points(request):
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                for p in getattr(m, kind).data_points:
                    yield m.name, (p.as_double if p.WhichOneof("value") == "as_double" else p.as_int)


@fuzz(150)
@given(polls=st.lists(st.lists(_garbage, min_size=len(_FILES), max_size=len(_FILES)), min_size=2, max_size=6),
       rescan=st.booleans())
def test_sysfs_garbage_never_raises_and_never_gives_a_negative_value(tmp_path_factory, polls, rescan):
    root = str(tmp_path_factory.mktemp("sysfs"))
    for rel in _FILES:
        _write(root, rel, b"0\n")
    host = Host("nic", {})
    receiver = NicReceiver(NicReceiverConfig(sysfs_root=root, rescan_interval_s=0.5 if rescan else 1e9,
                                             hw_counters=["*"]), host)
    t = [0.0]
    receiver.clock = lambda: t[0]
    receiver._scan()
    for contents in polls:
        for rel, data in zip(_FILES, contents):
            _write(root, rel, data)
        t[0] += 1.0
        request = receiver.poll()
        if request is None:
            continue
        request.SerializeToString()
        for name, value in _points(request):
            assert math.isfinite(value), (name, value)
            assert value >= 0, (name, value)
    assert not host.swallowed, host.swallowed
