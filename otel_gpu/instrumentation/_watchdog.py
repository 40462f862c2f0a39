"""The watchdog: a thread that sends a heartbeat (``otel_gpu.progress`` and the metrics) every ``heartbeat_s``, and
the stacks of all threads once when the process makes no progress for longer than the (adaptive) threshold.

Progress is what Python sees: a record written to the ring, or the in-flight operation changing. While a rank of a
multi-rank job waits in the rendezvous, it is starting, not stalled.

Example:
    >>> clock = ProgressClock(now_ns=0, starting=False)
    >>> clock.observe(marker=(1, None), newest_end_ns=1_000_000_000, cur=None, now_ns=4_000_000_000)
    3.0
    >>> clock.observe(marker=(1, None), newest_end_ns=None, cur=None, now_ns=6_000_000_000)  # nothing new
    5.0
    >>> stack_threshold_s(10.0, [2.0, 5.0])  # 3x the slowest recent step, at least stack_after_s
    15.0
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Iterable

from otel_gpu.instrumentation import _export, _flight
from otel_gpu.instrumentation._hot import NS
from otel_gpu.instrumentation._spans import record_end_ns
from otel_gpu.schema import training as tr

_logger = logging.getLogger(__name__)


def stack_threshold_s(stack_after_s: float, step_durs: Iterable[float]) -> float:
    """No progress for this long sends the stacks: ``stack_after_s``, or 3x the slowest recent step (at most 6x
    ``stack_after_s``) when steps are slow."""
    durs = list(step_durs)
    if durs:
        return max(stack_after_s, min(3 * max(durs), 6 * stack_after_s))
    return stack_after_s


class ProgressClock:
    """When the process last made Python-visible progress (``last_ns``), and so for how long it has not."""

    def __init__(self, now_ns: int, starting: bool):
        self.marker = None
        self.last_ns = now_ns
        # A rank of a multi-rank job is starting up until its process group exists: imports and the rendezvous
        # with peers that still start are not a stall (under load they outlast the hang timeout).
        self.starting = starting

    def observe(self, marker, newest_end_ns: int | None, cur, now_ns: int) -> float:
        """Seconds without progress. ``marker`` changes with progress (records written, in-flight op);
        ``newest_end_ns`` is when the newest record ended (None: none in the ring); ``cur`` the in-flight slot."""
        if marker != self.marker:
            self.marker = marker
            # when the progress happened (not when we noticed): the newest record's end, or the in-flight start
            t = newest_end_ns
            if cur is not None:
                t = max(t or 0, cur[3])
            self.last_ns = t or now_ns
        if self.starting:
            self.last_ns = now_ns
        return (now_ns - self.last_ns) / 1e9

    def group_created(self, now_ns: int, step_t0_ns: int | None) -> None:
        """The process group exists: start-up is over, and joining it is progress (as is the first step's start)."""
        self.starting = False
        self.last_ns = now_ns if step_t0_ns is None else max(now_ns, step_t0_ns)


def _frames(frame) -> list[dict]:
    return [{"file": fs.filename, "line": fs.lineno, "function": fs.name}
            for fs in traceback.extract_stack(frame, limit=64)]


def is_internal(path: str) -> bool:
    """A frame of torch or of this instrumentation (not the user's code)."""
    p = path.replace("\\", "/")
    return ("/torch/" in p or "/otel_gpu/instrumentation/" in p or p.endswith("/threading.py")
            or p.startswith("<otel_gpu"))


def stacks() -> tuple[list[dict], str | None, str | None]:
    """(threads other than the caller, main thread first; main thread's innermost frame; its innermost frame
    outside torch and otel_gpu)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    me = threading.get_ident()
    threads, top, user_top = [], None, None
    for tid, frame in sys._current_frames().items():
        if tid == me:
            continue
        frames = _frames(frame)
        threads.append({"name": names.get(tid, str(tid)), "id": tid, "main": tid == main_id, "frames": frames})
        if tid == main_id and frames:
            f = frames[-1]
            top = f"{f['file']}:{f['line']} {f['function']}"
            for f in reversed(frames):
                if not is_internal(f["file"]):
                    user_top = f"{f['file']}:{f['line']} {f['function']}"
                    break
    threads.sort(key=lambda t: not t["main"])
    return threads, top, user_top


class Watchdog:
    """Heartbeats and stacks of one runtime (``rt``: its spans, recorder reads, steps, client and logs)."""

    def __init__(self, rt, starting: bool):
        self.rt = rt
        self.clock = ProgressClock(time.time_ns(), starting)
        self._stacks_sent_for = None

    def loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.rt.cfg.heartbeat_s):
            try:
                self.heartbeat()
            except Exception:
                _logger.warning("otel-gpu heartbeat failed", exc_info=True)

    def stack_threshold_s(self) -> float:
        return stack_threshold_s(self.rt.cfg.stack_after_s, self.rt.step_durs)

    def progress(self) -> tuple[dict, dict]:
        """(attributes, body) of one heartbeat."""
        rt = self.rt
        spans, reads, fr = rt.spans, rt.reads, rt.reads.fr
        now = time.time_ns()
        cur = NS["_cur"]
        last = NS["_buf"][(NS["_w"] - 1) & NS["_M"]]
        newest = record_end_ns(last) if last is not None else spans.last_record_end_ns
        stalled_s = self.clock.observe((NS["_w"], cur[3] if cur else None), newest, cur, now)
        if stalled_s >= rt.cfg.heartbeat_s and reads.enabled:
            reads.poll(stalled=True)  # a C++ collective may be what we are stuck in
        last_started: dict[str, int] = dict(fr.last_started)
        for g, s in list(NS["_seq"].items()):
            name, _ = spans.pg(g)
            last_started[name] = max(last_started.get(name, 0), s + spans.cpp_count.get(name, 0))
        inflight = None
        if cur is not None:
            op, g, s, t0, kind = cur
            inflight = {"kind": kind, "op": op, "since": t0 / 1e9}
            if g is not None:
                name, _ = spans.pg(g)
                seq = -s if s < 0 else s + spans.cpp_count.get(name, 0)
                latest = fr.latest.get(name)
                if s > 0 and latest is not None and int(latest.get("time_created_ns") or 0) >= t0:
                    seq = int(latest["collective_seq_id"])
                inflight.update(pg=name, seq=seq, p2p=s < 0)
                if s > 0:
                    last_started[name] = max(last_started.get(name, 0), seq)
        elif stalled_s >= rt.cfg.heartbeat_s:
            # Not in a Python call: blocked in a collective that C++ issued (DDP's backward, FSDP)?
            newest_e = None
            for name, e in fr.latest.items():
                created = int(e.get("time_created_ns") or 0)
                done = fr.last_completed.get(name, 0) >= int(e.get("collective_seq_id") or 0)
                # issued after the last Python-visible progress (step end, data, collective) and not completed
                if not done and created >= self.clock.last_ns and (newest_e is None or created > newest_e[1]):
                    newest_e = (name, created, e)
            if newest_e is not None:
                name, created, e = newest_e
                inflight = {"kind": "flight_recorder", "op": _flight.entry_op(e), "pg": name,
                            "seq": int(e["collective_seq_id"]), "since": created / 1e9}
        if inflight is None and not rt.steps_done and not NS["_w"]:
            # Starting up (imports, rendezvous, building the model and DDP) with nothing in flight and nothing
            # recorded yet: initialization, not a hang. On a busy node this took 7 s between init_process_group and
            # the first collective and read as a job-wide hang (the multi-node bed, tests/test_multihost.py). Once
            # a collective ran, a rank that stops in user code before its first step is stalled (its peers wait).
            stalled_s = 0.0
        last_seq = dict(last_started)
        if inflight is not None and inflight.get("pg") and not inflight.get("p2p"):
            last_seq[inflight["pg"]] = inflight["seq"] - 1
        for name, s in fr.last_completed.items():
            last_seq[name] = max(s, last_seq.get(name, 0)) if name != (inflight or {}).get("pg") else last_seq[name]
        state = "idle"
        if inflight is not None:
            state = {"collective": "collective", "wait": "collective", "flight_recorder": "collective",
                     "data": "data", "checkpoint": "checkpoint"}.get(inflight["kind"], "step")
        elif rt.steps_done or NS["_w"]:
            state = "step"
        counters, client = rt.counters, rt.client
        counters = {"steps": rt.steps_done, "collectives": counters["collectives"],
                    "fr_collectives": counters["fr_collectives"], "dropped": NS["_drops"],
                    "fr_lost": fr.entries_lost, "spans_sent": counters["spans_sent"],
                    "spans_dropped": counters["spans_dropped"], "export_failures": client.failed,
                    "logs_dropped": counters["logs_dropped"], "export_buffered": client.buffer_requests,
                    "export_buffer_dropped": client.buffer_dropped}
        body = {"step": NS["_step"], "state": state, "inflight": inflight, "last_seq": last_seq,
                "last_started_seq": last_started, "counters": counters, "stalled_s": round(stalled_s, 3),
                "flight_recorder": bool(reads.enabled and fr.available is not False)}
        attrs = {str(tr.STEP): NS["_step"], str(tr.STATE): state}
        if inflight is not None:
            attrs.update({str(tr.COLL_OP): inflight.get("op"), str(tr.COLL_PG): inflight.get("pg"),
                          str(tr.COLL_SEQ): inflight.get("seq"), str(tr.INFLIGHT_SINCE): inflight["since"],
                          str(tr.INFLIGHT_FOR): round(now / 1e9 - inflight["since"], 3)})
        return attrs, body

    def heartbeat(self) -> None:
        rt = self.rt
        if not rt.is_training_process() or not rt.may_send_metrics():
            return
        attrs, body = self.progress()
        rt.log(tr.PROGRESS_EVENT, attrs, body, now=True)
        try:
            rt.send_metrics()
        except Exception:  # metrics are a convenience; heartbeats matter more
            _logger.debug("otel-gpu: metrics export failed", exc_info=True)
        stalled_s = body["stalled_s"]
        if stalled_s >= self.stack_threshold_s() and self._stacks_sent_for != self.clock.marker:
            self._stacks_sent_for = self.clock.marker
            self.send_stacks(body, stalled_s)

    def send_stacks(self, progress_body: dict, stalled_s: float) -> None:
        threads, top, user_top = stacks()
        inflight = progress_body.get("inflight") or {}
        attrs = {str(tr.STEP): progress_body["step"], str(tr.COLL_OP): inflight.get("op"),
                 str(tr.COLL_SEQ): inflight.get("seq"), str(tr.INFLIGHT_FOR): round(stalled_s, 3)}
        body = {"threads": threads, "top": top, "user_top": user_top, "inflight": progress_body.get("inflight"),
                "state": progress_body.get("state"), "stalled_s": round(stalled_s, 3)}
        self.rt.log(tr.STACKS_EVENT, attrs, body, severity=_export.WARN, now=True)
        self.rt.counters["stacks_sent"] += 1
