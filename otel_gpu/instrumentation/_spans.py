"""Span assembly: the ring's records and the flight recorder's entries become spans, encoded for export.

Runs on the export thread only. A span is the list ``[name, step, t0_ns, t1_ns, attributes, error]``. The assembler
keeps what spans across export cycles: process group names, the collectives only the recorder saw (``cpp_count``,
which shifts the Python-counted seq to torch's), async collectives awaiting their ``Work.wait``, step spans held for
the recorder read that covers them, and the recent intervals behind each step's time breakdown.

Example:
    >>> import collections
    >>> from otel_gpu.instrumentation._hot import DATA, STEP
    >>> spans = SpanAssembler(collections.Counter())
    >>> out = spans.assemble([(STEP, 1, 0, 100, None), (DATA, 10, 30, 1, None)], [], drain_ns=200, final=True,
    ...                      cur=None)
    >>> [(s[0], s[2], s[3]) for s in spans.hold_steps(out, final=True, fr_last_read_ns=0)]
    [('otel_gpu.data.wait', 10, 30), ('otel_gpu.step', 0, 100)]
"""
from __future__ import annotations

import bisect
import collections
import hashlib
import os
import random
import sys
import time

from otel_gpu.instrumentation import _flight, _pbenc
from otel_gpu.instrumentation._hot import CKPT, COLL, DATA, NS, STEP, WAIT
from otel_gpu.schema import training as tr

# Bucket bounds (seconds) of the collective-duration histogram: microsecond all-reduces to minute-long stalls.
COLL_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_SPANS_PER_REQUEST = 2000
_ASYNC_HOLD_NS = 10_000_000_000


def record_end_ns(rec: tuple) -> int:
    """When the operation of one ring record ended."""
    kind = rec[0]
    return int(rec[5] if kind in (COLL, WAIT) else rec[3] if kind in (STEP, CKPT) else rec[2])


def _rand_id(n: int) -> bytes:
    return random.getrandbits(n * 8).to_bytes(n, "big")


def drain() -> list[tuple]:
    """Takes every record written to the ring since the last drain."""
    w, r = NS["_w"], NS["_r"]
    buf, mask = NS["_buf"], NS["_M"]
    out = []
    for i in range(r, w):
        rec = buf[i & mask]
        buf[i & mask] = None
        if rec is not None:
            out.append(rec)
    NS["_r"] = w
    if len(NS["_pend"]) > 65536:  # Works awaited through futures never come back to Work.wait
        NS["_pend"].clear()
    return out


class SpanAssembler:
    """Records and recorder entries in, spans out; ``counters`` gets collectives, steps and fr_collectives."""

    def __init__(self, counters: collections.Counter):
        self.counters = counters
        self.cpp_count: dict[str, int] = {}  # pg name -> collectives seen only in the flight recorder
        self.pg_info: dict[int, tuple[object, str, int]] = {}  # id(pg) -> (pg, name, size)
        self.fr_hold: list[dict] = []  # recorder entries whose Python call was still running
        self.held_steps: list = []  # step spans waiting for the recorder read that covers their collectives
        self.coll_hist: dict[str, list] = {}  # op -> [bucket counts, sum s, count]
        self.last_record_end_ns = 0
        self._py_windows: dict[str, collections.deque] = {}  # pg name -> (t0, t1) of recent Python collectives
        self._pending_async: dict[tuple[int, int], list] = {}
        self._step_ends: collections.deque = collections.deque(maxlen=256)  # (n, t_end_ns)
        # Recent collective, data-wait and checkpoint intervals (kind, t0, t1, end_known), for the per-step
        # breakdown on the step span: what separates a straggler's compute from its peers' waiting.
        self._recent_iv: collections.deque = collections.deque(maxlen=8192)
        self._ids_cache: dict = {}

    # ---------------------------------------------------------------- process groups
    def pg(self, g) -> tuple[str, int]:
        """(name, size) of a process group, cached."""
        info = self.pg_info.get(id(g))
        if info is None or info[0] is not g:
            name, size = "?", -1
            try:
                # never import torch from these threads: the main thread may be importing it right now
                c10d = sys.modules["torch.distributed.distributed_c10d"]
                name = str(c10d._get_process_group_name(g))
            except Exception:  # noqa: BLE001
                name = str(getattr(g, "group_name", "?"))
            try:
                size = int(g.size())
            except Exception:  # noqa: BLE001
                pass
            info = (g, name, size)
            self.pg_info[id(g)] = info
        return info[1], info[2]

    def torch_seq(self, g, s: int) -> int:
        """torch's seq of the Python op counted ``s`` on group ``g`` (p2p: its own count, positive)."""
        return -s if s < 0 else s + self.cpp_count.get(self.pg(g)[0], 0)

    def drain(self) -> list[tuple]:
        out = drain()
        if out:
            self.last_record_end_ns = max(self.last_record_end_ns, record_end_ns(out[-1]))
        return out

    # ---------------------------------------------------------------- assembly
    def assemble(self, records: list[tuple], fr_entries: list[dict], drain_ns: int, final: bool, cur) -> list:
        """Spans of one export cycle. ``cur`` is the in-flight slot when the ring was drained at ``drain_ns``."""
        spans: list[list] = []
        # Python collectives by pg name, for matching against the flight recorder
        py_by_pg: dict[str, list[list]] = {}
        for rec in records:
            kind = rec[0]
            if kind == COLL:
                _, op, g, s, t0, t1, nbytes, dtype, is_async, peer, step, err = rec
                name, size = self.pg(g)
                p2p = s is not None and s < 0
                seq = None if s is None else (-s if p2p else s + self.cpp_count.get(name, 0))
                attrs = {str(tr.COLL_OP): op, str(tr.COLL_PG): name, str(tr.COLL_PG_SIZE): size,
                         str(tr.COLL_SEQ): seq, str(tr.COLL_BYTES): nbytes,
                         str(tr.COLL_DTYPE): str(dtype).replace("torch.", "") if dtype is not None else None,
                         str(tr.COLL_ASYNC): bool(is_async), str(tr.COLL_PEER): peer,
                         str(tr.COLL_SOURCE): "python", str(tr.STEP): step}
                if p2p:
                    attrs[str(tr.COLL_P2P)] = True
                span = [str(tr.COLLECTIVE_SPAN), step, t0, t1, attrs, err]
                if not p2p and s is not None:
                    py_by_pg.setdefault(name, []).append([t0, t1, span])
                    win = self._py_windows.get(name)
                    if win is None:
                        win = self._py_windows[name] = collections.deque(maxlen=4096)
                    win.append((t0, t1))
                if is_async and err is None and s is not None:
                    self._pending_async[(id(g), s)] = [span, drain_ns]
                else:
                    spans.append(span)
                self.counters["collectives"] += 1
            elif kind == WAIT:
                _, op, g, s, t0, t1, issue_t0, step, err = rec
                name, _size = self.pg(g)
                pending = self._pending_async.pop((id(g), s), None)
                seq = -s if s < 0 else s + self.cpp_count.get(name, 0)
                if pending is not None:
                    pending[0][3] = t1
                    seq = pending[0][4][str(tr.COLL_SEQ)]
                    spans.append(pending[0])
                spans.append([str(tr.WAIT_SPAN), step, t0, t1,
                              {str(tr.COLL_OP): op, str(tr.COLL_PG): name, str(tr.COLL_SEQ): seq,
                               str(tr.STEP): step}, err])
            elif kind == STEP:
                _, n, t0, t1, err = rec
                self._step_ends.append((n, t1))
                spans.append([str(tr.STEP_SPAN), n, t0, t1, {str(tr.STEP): n}, err])
                self.counters["steps"] += 1
            elif kind == DATA:
                _, t0, t1, step, err = rec
                spans.append([str(tr.DATA_SPAN), step, t0, t1, {str(tr.STEP): step}, err])
            elif kind == CKPT:
                _, what, t0, t1, path, step, err = rec
                nbytes = None
                if isinstance(path, str) and os.path.isfile(path):
                    try:
                        nbytes = os.path.getsize(path)
                    except OSError:
                        pass
                spans.append([str(tr.CKPT_SAVE_SPAN if what == "save" else tr.CKPT_LOAD_SPAN), step, t0, t1,
                              {str(tr.STEP): step, str(tr.CHECKPOINT_PATH): path,
                               str(tr.CHECKPOINT_BYTES): nbytes}, err])
        # Flight recorder: entries that a Python call made get torch's seq onto the Python span; the others were
        # issued in C++ (DDP reducer, FSDP, functional collectives) and become spans of their own.
        cur_pg = self.pg(cur[1])[0] if cur is not None and cur[1] is not None else None
        for e in fr_entries:
            if e.get("is_p2p"):
                continue
            pg = str((e.get("process_group") or [e.get("pg_id", "")])[0])
            created = int(e.get("time_created_ns") or 0)
            seq = int(e.get("collective_seq_id") or 0)
            match = None
            for item in py_by_pg.get(pg, ()):
                if item[0] <= created <= item[1] + 1000:
                    match = item
                    break
            if match is not None:
                py_by_pg[pg].remove(match)
                match[2][4][str(tr.COLL_SEQ)] = seq
                continue
            if created >= drain_ns or (cur_pg == pg and cur[3] <= created):
                if not final:
                    self.fr_hold.append(e)  # its Python call is still running: decide next cycle
                    continue
            if not self._is_own_pending(pg, created):
                self.cpp_count[pg] = self.cpp_count.get(pg, 0) + 1
                spans.append(self._fr_span(e, pg, seq, created))
                self.counters["fr_collectives"] += 1
        # async ops never awaited through Work.wait (futures): export at issue after a while
        for key, (span, since) in list(self._pending_async.items()):
            if final or drain_ns - since > _ASYNC_HOLD_NS:
                spans.append(span)
                del self._pending_async[key]
        return spans

    def hold_steps(self, spans: list, final: bool, fr_last_read_ns: int) -> list:
        """Keeps back step spans that end after the last flight-recorder read (``fr_last_read_ns``, wall clock)
        while this process has C++-issued collectives (DDP, FSDP), for at most 3 s: their collectives are read in a
        later cycle, and the step's breakdown needs them."""
        step_name = str(tr.STEP_SPAN)
        candidates = self.held_steps + [sp for sp in spans if sp[0] == step_name]
        if not candidates:
            return spans
        rest = [sp for sp in spans if sp[0] != step_name]
        self.held_steps = []
        if final or not self.counters["fr_collectives"]:
            return rest + candidates
        now_ns = time.time_ns()
        for sp in candidates:
            if sp[3] > fr_last_read_ns and now_ns - sp[3] < 3_000_000_000:
                self.held_steps.append(sp)
            else:
                rest.append(sp)
        return rest

    def _observe_collective(self, op: str, seconds: float) -> None:
        entry = self.coll_hist.get(op)
        if entry is None:
            if len(self.coll_hist) >= 64:
                return
            entry = self.coll_hist[op] = [[0] * (len(COLL_BOUNDS) + 1), 0.0, 0]
        entry[0][bisect.bisect_left(COLL_BOUNDS, seconds)] += 1
        entry[1] += seconds
        entry[2] += 1

    def add_step_breakdown(self, spans: list) -> None:
        """Sets training.step.collective_time / data_time / checkpoint_time on the step spans of this cycle, and
        counts the collectives of known duration into ``coll_hist``.

        Collective time is the union of the step's collective intervals. For collectives whose end the backend does
        not record (gloo's flight recorder: DDP's bucket all-reduces), the rank waits from the creation of the last
        of them in the step to the step's end: its backward finished computing when it handed over the last bucket,
        and the optimizer runs only once every bucket is reduced. A straggler hands its last bucket over late and so
        shows little collective time and much compute; its peers show the reverse.
        """
        coll, data, ckpt = str(tr.COLLECTIVE_SPAN), str(tr.DATA_SPAN), str(tr.CKPT_SAVE_SPAN)
        steps = []
        for span in spans:
            name = span[0]
            if name == coll:
                known = bool(span[4].get(str(tr.COLL_DURATION_KNOWN), True))
                self._recent_iv.append(("c", span[2], span[3], known))
                if known and span[3] >= span[2]:
                    self._observe_collective(str(span[4].get(str(tr.COLL_OP))), (span[3] - span[2]) / 1e9)
            elif name == data:
                self._recent_iv.append(("d", span[2], span[3], True))
            elif name == ckpt:
                self._recent_iv.append(("k", span[2], span[3], True))
            elif name == str(tr.STEP_SPAN):
                steps.append(span)
        for span in steps:
            t0, t1 = span[2], span[3]
            intervals, data_ns, ckpt_ns, last_unknown = [], 0, 0, None
            for kind, a, b, known in self._recent_iv:
                if not known:
                    if t0 <= a <= t1 and (last_unknown is None or a > last_unknown):
                        last_unknown = a
                    continue
                if b < t0 or a > t1:
                    continue
                lo, hi = max(a, t0), min(b, t1)
                if hi <= lo:
                    continue
                if kind == "c":
                    intervals.append((lo, hi))
                elif kind == "d":
                    data_ns += hi - lo
                else:
                    ckpt_ns += hi - lo
            if last_unknown is not None:
                intervals.append((last_unknown, t1))  # from the last bucket handed to the backend: waiting
            busy, end = 0, t0
            for lo, hi in sorted(intervals):
                if hi > end:
                    busy += hi - max(lo, end)
                    end = hi
            attrs = span[4]
            attrs[str(tr.STEP_COLLECTIVE_S)] = round(busy / 1e9, 6)
            attrs[str(tr.STEP_DATA_S)] = round(data_ns / 1e9, 6)
            attrs[str(tr.STEP_CHECKPOINT_S)] = round(ckpt_ns / 1e9, 6)
        horizon = max((sp[3] for sp in steps), default=0) - 60_000_000_000
        while self._recent_iv and self._recent_iv[0][2] < horizon:
            self._recent_iv.popleft()

    def _is_own_pending(self, pg: str, created: int) -> bool:
        """A Python op exported in an earlier cycle, or an async one awaiting its Work.wait, is also in the
        recorder: not a C++ op."""
        for t0, t1 in reversed(self._py_windows.get(pg, ())):
            if t0 <= created <= t1 + 1000:
                return True
            if t1 < created:
                break
        for span, _ in self._pending_async.values():
            a = span[4]
            if a[str(tr.COLL_PG)] == pg and span[2] <= created <= span[3] + 1000:
                return True
        return False

    def _step_at(self, t_ns: int) -> int:
        for n, t_end in reversed(self._step_ends):
            if t_end < t_ns:
                return n + 1
        return self._step_ends[0][0] if self._step_ends else NS["_step"]

    def _fr_span(self, e: dict, pg: str, seq: int, created: int) -> list:
        nbytes, dtype = _flight.entry_bytes_dtype(e)
        end = int(e.get("time_discovered_completed_ns") or 0)
        if not end and e.get("duration_ms"):
            end = created + int(float(e["duration_ms"]) * 1e6)
        step = self._step_at(created)
        size = -1
        for info in self.pg_info.values():
            if info[1] == pg:
                size = info[2]
        attrs = {str(tr.COLL_OP): _flight.entry_op(e), str(tr.COLL_PG): pg, str(tr.COLL_PG_SIZE): size,
                 str(tr.COLL_SEQ): seq, str(tr.COLL_BYTES): nbytes, str(tr.COLL_DTYPE): dtype,
                 str(tr.COLL_SOURCE): "flight_recorder", str(tr.STEP): step,
                 str(tr.COLL_DURATION_KNOWN): bool(end)}
        return [str(tr.COLLECTIVE_SPAN), step, created, end or created, attrs, None]

    # ---------------------------------------------------------------- encoding
    def trace_ids(self, step: int, job_id: str, rank: int | None, pid: int) -> tuple[bytes, bytes]:
        """Same trace for step n on every rank of the job; the step span's id is per rank."""
        key = (step, job_id, rank)
        ids_ = self._ids_cache.get(key)
        if ids_ is None:
            tid = hashlib.sha256(f"{job_id}:{step}".encode()).digest()[:16]
            sid = hashlib.sha256(f"{job_id}:{rank}:{pid}:{step}".encode()).digest()[:8]
            if len(self._ids_cache) > 1024:
                self._ids_cache.clear()
            ids_ = self._ids_cache[key] = (tid, sid)
        return ids_

    def requests(self, spans: list, resource_bytes: bytes, scope_bytes: bytes, job_id: str, rank: int | None,
                 pid: int):
        """Yields (encoded ExportTraceServiceRequest, span count), up to MAX_SPANS_PER_REQUEST spans each; every
        span of step n is a child of the rank's step-n span."""
        step_name = str(tr.STEP_SPAN)
        for i in range(0, len(spans), MAX_SPANS_PER_REQUEST):
            encoded = []
            for name, step, t0, t1, attrs, err in spans[i:i + MAX_SPANS_PER_REQUEST]:
                trace_id, step_span_id = self.trace_ids(step if step is not None else 0, job_id, rank, pid)
                if name == step_name:
                    encoded.append(_pbenc.span(name, trace_id, step_span_id, None, t0, t1, attrs, err))
                else:
                    encoded.append(_pbenc.span(name, trace_id, _rand_id(8), step_span_id, t0, t1, attrs, err))
            yield _pbenc.trace_request(resource_bytes, scope_bytes, encoded), len(encoded)
