"""Node digests (issue 20): the sidecar's compact processor folds its ranks' heartbeats and step spans into one
``otel_gpu.node.digest`` per node per interval; the aggregator's attribution processor applies it and gates its
per-rank detectors on it. Each job below runs twice through real compact and attribution processors on a simulated
clock, once with digests and once with every rank's own records, and both must name the same failure."""
from __future__ import annotations

import json

import pytest

from otel_gpu.collector.telemetry import PrometheusSelfTelemetry
from otel_gpu.component import ComponentHost
from otel_gpu.config import build
from otel_gpu.otlp_build import LogsBuilder, MetricsBuilder, SpansBuilder
from otel_gpu.pdata import Batch, Signal
from otel_gpu.processors.attribution import AttributionConfig, AttributionProcessor
from otel_gpu.processors.compact import CompactConfig, CompactProcessor
from otel_gpu.processors.compact._digest import NodeDigests
from otel_gpu.schema import gpu as G
from otel_gpu.schema import training as T

JOB = "digest-job"
T0 = 1_800_000_000.0
PER_NODE = 4
COLLECTIVES = 4


class _Into:
    """A consumer that hands batches to a processor (the next pipeline stage)."""

    def __init__(self, processor):
        self.processor = processor
        self.batches: list[Batch] = []

    def consume(self, batch: Batch) -> None:
        self.batches.append(batch)
        self.processor.process(batch)


class Job:
    """``nodes`` nodes of PER_NODE ranks, each node with its own compact processor (the sidecar), one attribution
    processor (the aggregator). ``stuck``: ranks that never start the collective after step ``hang_at``;
    ``lost``: hosts whose ranks, sidecar and device metrics all stop at ``hang_at``."""

    def __init__(self, nodes: int, digests: bool, stuck: set[int] = frozenset(), lost: set[str] = frozenset(),
                 hang_at: int = 30, slow: str | None = None, slow_rank: int | None = None, slow_at: int = 10_000):
        self.sim = [T0]
        cfg = build(AttributionConfig, {"hang_timeout": "8s", "heartbeat_timeout": "6s", "tick_interval": "1h"},
                    "processors.attribution")
        self.attribution = AttributionProcessor(cfg, ComponentHost("attribution", PrometheusSelfTelemetry()))
        self.attribution._clock = lambda: self.sim[0]
        into = _Into(self.attribution)
        self.into = into
        self.sidecars = []
        for _ in range(nodes):
            c = CompactProcessor(build(CompactConfig, {"job_id": JOB, "digests": digests,
                                                       "batch_interval": "1s" if digests else "0s"},
                                       "processors.compact"),
                                 ComponentHost("compact", PrometheusSelfTelemetry(),
                                               {s: into for s in Signal}))
            c._wall = lambda: self.sim[0]
            self.sidecars.append(c)
        self.n = nodes * PER_NODE
        self.stuck, self.lost, self.hang_at = set(stuck), set(lost), hang_at
        # A slowdown from step slow_at on: "compute" or "data" (slow_rank's own time grows by 0.6 s, the others wait
        # that long in their collectives) or "network" (every rank's collectives take 0.6 s longer).
        self.slow, self.slow_rank, self.slow_at = slow, slow_rank, slow_at
        self.records: list = []

    def _step_times(self, rank: int, s: int) -> tuple[float, float, float]:
        """(duration, collective s, data s) of ``rank``'s step ``s``; a little noise per rank and step."""
        noise = ((rank * 7 + s * 13) % 10) * 0.002
        duration, coll, data = 0.9 + noise, 0.3 + noise, 0.02
        if self.slow is not None and s >= self.slow_at:
            duration += 0.6
            if self.slow == "network" or rank != self.slow_rank:
                coll += 0.6
            elif self.slow == "data":
                data += 0.6
        return duration, coll, data

    @staticmethod
    def host(rank: int) -> str:
        return f"node-{rank // PER_NODE}"

    def _resource(self, rank: int) -> dict:
        return {"training.job.id": JOB, "training.rank": rank, "training.world_size": self.n,
                "training.local_rank": rank % PER_NODE, "host.name": self.host(rank), "process.pid": 1000 + rank,
                "gpu.index": rank % PER_NODE, "service.name": "train"}

    def _send(self, rank: int, signal: Signal, request) -> None:
        out = self.sidecars[rank // PER_NODE].process(Batch.from_message(signal, request))
        if out is not None:
            self.into.consume(out)

    def second(self, s: int) -> None:
        now = T0 + s
        hung = s > self.hang_at
        for rank in range(self.n):
            if hung and self.host(rank) in self.lost:
                continue
            step = min(s, self.hang_at)
            seq = step * COLLECTIVES
            if not hung:
                duration, coll, data = self._step_times(rank, s)
                sb = SpansBuilder(self._resource(rank))
                sb.span(T.STEP_SPAN, int((now - duration) * 1e9), int(now * 1e9),
                        {str(T.STEP): s, str(T.STEP_COLLECTIVE_S): coll, str(T.STEP_DATA_S): data})
                self._send(rank, Signal.TRACES, sb.build())
                body = {"step": step, "state": "step", "inflight": None, "last_seq": {"0": seq},
                        "last_started_seq": {"0": seq}, "stalled_s": 0.1, "counters": {"steps": step}}
            elif rank in self.stuck:
                body = {"step": step, "state": "step", "inflight": None, "last_seq": {"0": seq},
                        "last_started_seq": {"0": seq}, "stalled_s": now - (T0 + self.hang_at),
                        "counters": {"steps": step}}
            else:
                body = {"step": step, "state": "collective", "last_seq": {"0": seq},
                        "last_started_seq": {"0": seq + 1}, "stalled_s": now - (T0 + self.hang_at),
                        "inflight": {"kind": "collective", "op": "all_reduce", "pg": "0", "seq": seq + 1,
                                     "since": T0 + self.hang_at}, "counters": {"steps": step}}
            lb = LogsBuilder(self._resource(rank))
            lb.event(T.PROGRESS_EVENT, body, time_ns=int(now * 1e9))
            if hung and s == self.hang_at + 4:  # the watchdogs send their stacks
                top = "/home/me/train.py:88 evaluate" if rank in self.stuck else "/home/me/train.py:70 step"
                lb.event(T.STACKS_EVENT, {"threads": [{"name": "MainThread", "main": True, "frames": [
                    {"file": "/home/me/train.py", "line": int(top.split(":")[1].split()[0]),
                     "function": top.split()[-1]}]}], "top": top, "inflight": body["inflight"]},
                         time_ns=int(now * 1e9))
            self._send(rank, Signal.LOGS, lb.build())
        for i, sidecar in enumerate(self.sidecars):
            if hung and f"node-{i}" in self.lost:
                continue
            mb = MetricsBuilder({"host.name": f"node-{i}"}, scope="otel_gpu.receivers.nvml",
                                time_ns=int(self.sim[0] * 1e9))  # polled as its ranks last reported
            for g in range(PER_NODE):
                mb.record(G.XID_ERRORS, 0, {"gpu.index": g})
            self.attribution.process(Batch.from_message(Signal.METRICS, mb.build()))
            sidecar.flush()
        self.sim[0] = now
        self.records += self.attribution.tick()

    def run(self, seconds: int) -> list:
        for s in range(1, seconds + 1):
            self.second(s)
        return self.records


def _verdicts(records) -> list[tuple]:
    return [(r.kind.value, r.root_cause.value, r.culprit.rank, r.culprit.host) for r in records]


def _both(seconds: int, **job) -> tuple[list, list, Job]:
    digest = Job(digests=True, **job)
    per_rank = Job(digests=False, **job)
    return _verdicts(digest.run(seconds)), _verdicts(per_rank.run(seconds)), digest


def test_a_digest_sums_up_the_node_ranks_in_groups_with_who_is_behind():
    d = NodeDigests("node-7", clock=lambda: 10.0)
    for rank in range(8):
        res = {"training.job.id": JOB, "training.rank": rank, "host.name": "node-7", "process.pid": 50 + rank}
        behind = rank == 5
        body = {"step": 3, "state": "step" if behind else "collective", "last_seq": {"0": 24},
                "last_started_seq": {"0": 24 if behind else 25}, "stalled_s": 4.0,
                "inflight": None if behind else {"kind": "collective", "op": "all_reduce", "pg": "0", "seq": 25,
                                                 "since": 6.0 + rank * 0.1}}
        assert d.heartbeat(res, body, 9.5)
        assert d.step(res, 3, 1.0, 2.0 + rank * 0.01, 0.3, 0.01, None)
    ((job, body),) = d.bodies(10.0)
    assert job == JOB and body["host"] == "node-7" and body["ranks"] == list(range(8))
    assert body["pg"]["0"] == {"completed": [24, 24], "started": [24, 25], "inflight": [25, 25], "behind": [5]}
    groups = sorted(body["groups"], key=lambda g: g["ranks"])
    assert [g["ranks"] for g in groups] == [[0, 1, 2, 3, 4, 6, 7], [5]]
    assert groups[0]["inflight"]["since"] == 6.0  # the group's oldest: its longest stall
    assert body["stalled"] == {"rank": 0, "s": 4.0}
    # One row for step 3: all 8 ranks, rank 0's times (the lowest), the slowest rank's duration, no baseline yet.
    ((row),) = body["step_rows"]
    assert row[:5] == [3, 8, 1.0, 2.0, pytest.approx(1.07)] and row[8] is None
    assert body["step_s"][0] == pytest.approx(1.0) and body["step_s"][2] == pytest.approx(1.07)
    assert set(body["who"]) == {str(r) for r in range(8)}  # new ranks: their identities
    # The next interval: nothing arrived, so nothing is fresh, nothing changed, identities are not sent again.
    ((_, again),) = d.bodies(11.0)
    assert again["who"] == {} and again["changed"] == [] and again["step_rows"] == [] and again["step_s"] is None
    assert all(not g["fresh"] for g in again["groups"])
    json.dumps(again)  # the body is plain JSON


def test_a_digest_holds_back_a_waiter_stacks_and_forgets_a_rank_that_exited():
    d = NodeDigests("node-1", clock=lambda: 10.0)
    res = {"training.job.id": JOB, "training.rank": 2, "host.name": "node-1"}
    assert d.stacks_held(res, {"inflight": {"kind": "collective", "pg": "0", "seq": 9, "since": 1.0}})
    assert not d.stacks_held(res, {"inflight": None})  # not waiting in a collective: it may be the culprit
    d.heartbeat(res, {"step": 1, "state": "step"}, 9.0)
    d.exited(res, {})
    ((_, body),) = d.bodies(10.0)
    assert body["ranks"] == [] and body["gone"] == [2]


def test_a_step_row_waits_for_the_node_ranks_then_goes_with_those_that_reported():
    clock = [100.0]
    d = NodeDigests("node-1", clock=lambda: clock[0])
    res = [{"training.job.id": JOB, "training.rank": r, "host.name": "node-1"} for r in range(3)]
    for r in range(3):
        d.heartbeat(res[r], {"step": 0, "state": "step"}, 99.0)
    d.step(res[0], 1, 99.0, 100.0, 0.3, 0.02, None)
    d.step(res[1], 1, 99.0, 100.2, 0.3, 0.02, None)
    ((_, body),) = d.bodies(100.0)
    assert body["step_rows"] == []  # rank 2 has not finished step 1
    clock[0] = 103.0  # rank 2 died: after three intervals the row goes with the two that did
    ((_, body),) = d.bodies(103.0)
    ((row),) = body["step_rows"]
    assert row[:5] == [1, 2, 99.0, 100.0, pytest.approx(1.2)]
    d.step(res[2], 1, 99.0, 104.0, 0.3, 0.02, None)  # late: a sign of life, not a second row
    ((_, body),) = d.bodies(104.0)
    assert body["step_rows"] == [] and all(g["fresh"] for g in body["groups"] if 2 in g["ranks"])


def test_a_straggler_stands_out_of_its_node_row_against_its_own_baseline():
    d = NodeDigests("node-1", clock=lambda: 0.0)
    res = [{"training.job.id": JOB, "training.rank": r, "host.name": "node-1"} for r in range(4)]
    rows = []
    for step in range(1, 21):
        for r in range(4):
            # From step 16 on rank 3 computes 0.5 s longer and the others wait that long in their collectives.
            late = step > 15
            d.step(res[r], step, step - 1.0, step - 0.1 + (0.5 if late else 0.0),
                   0.3 + (0.5 if late and r != 3 else 0.0), 0.02, None)
        rows += d.bodies(float(step))[0][1]["step_rows"]
    assert [row[0] for row in rows] == list(range(1, 21))
    last = rows[-1]
    (top, second) = last[9]
    assert top[0] == 3 and top[1] == pytest.approx(0.5, abs=0.01)  # its compute grew by 0.5 s over its usual
    assert second[1] < 0.01 and last[7] == pytest.approx(0.0, abs=1e-6)  # nobody else's work grew, no data wait
    # collective 0.3 + compute baseline 0.58 + data baseline 0.02: a healthy step's time, as the job's baseline is
    assert rows[10][8] == pytest.approx(0.9, abs=0.01)


def test_a_job_past_65536_ranks_gets_a_digest_every_two_intervals_with_every_step_in_it():
    assert [NodeDigests.intervals_for(n) for n in (None, 8, 65536, 65537, 131072, 200_000)] == [1, 1, 1, 2, 2, 4]
    d = NodeDigests("node-1", clock=lambda: 0.0)
    res = {"training.job.id": JOB, "training.rank": 5, "host.name": "node-1", "training.world_size": 131072}
    sent = []
    for s in range(1, 7):
        d.heartbeat(res, {"step": s, "state": "step"}, s - 0.5)
        d.step(res, s, s - 1.0, s - 0.1, 0.3, 0.02, None)
        sent += [(s, [row[0] for row in body["step_rows"]]) for _, body in d.bodies(float(s))]
    assert sent == [(1, [1]), (3, [2, 3]), (5, [4, 5])]


def test_a_node_whose_ranks_all_exited_holds_no_step_of_the_job_back():
    job = Job(nodes=2, digests=True)
    job.run(5)
    state = job.attribution.engine.jobs[JOB]
    dj = state.digest
    assert dj.live == 2 and state.last_step_closed >= 3
    node = dj.nodes["node-1"]
    dj.uncount(node)
    assert dj.live == 1 and dj.past(0) == 1 and not node.counted


def test_digests_replace_every_rank_heartbeat_and_step_span_with_one_record_per_node():
    job = Job(nodes=2, digests=True)
    job.run(5)
    names = {r.event_name for b in job.into.batches if b.signal is Signal.LOGS
             for rl in b.message.resource_logs for sl in rl.scope_logs for r in sl.log_records}
    assert names == {T.NODE_DIGEST_EVENT.name}
    assert not [b for b in job.into.batches if b.signal is Signal.TRACES]
    state = job.attribution.engine.jobs[JOB]
    assert sorted(state.ranks) == list(range(8)) and state.step_done  # the steps closed from the digests
    assert sorted(state.digest.nodes) == ["node-0", "node-1"]


def test_a_hang_whose_culprit_is_behind_on_its_node_is_named_as_with_every_rank_records():
    digest, per_rank, job = _both(45, nodes=3, stuck={6})
    assert digest == per_rank == [("hang", "rank_not_in_collective", 6, "node-1")]
    behind = job.attribution.engine.jobs[JOB].digest.behind()
    assert behind == {"0": [{"host": "node-1", "started": 120, "ranks": [6]}]}


def test_a_hang_whose_culprit_is_a_whole_node_names_its_first_rank_as_with_every_rank_records():
    digest, per_rank, job = _both(45, nodes=3, stuck={8, 9, 10, 11})
    assert digest == per_rank and digest[0][:3] == ("hang", "rank_not_in_collective", 8)
    assert job.attribution.engine.jobs[JOB].digest.behind()["0"][0]["ranks"] == [8, 9, 10, 11]


def test_a_hang_whose_culprit_is_rank_0_is_named_as_with_every_rank_records():
    digest, per_rank, _ = _both(45, nodes=2, stuck={0})
    assert digest == per_rank == [("hang", "rank_not_in_collective", 0, "node-0")]


def test_a_lost_node_is_named_as_with_every_rank_records():
    digest, per_rank, _ = _both(45, nodes=3, lost={"node-2"})
    assert digest == per_rank and digest[0][:2] == ("crash", "node_lost") and digest[0][3] == "node-2"


@pytest.mark.parametrize("slow, slow_rank, expected", [
    ("compute", 6, ("slowdown", "straggler_compute", 6, "node-1")),
    ("compute", 0, ("slowdown", "straggler_compute", 0, "node-0")),
    ("data", 9, ("slowdown", "dataloader_stall", 9, "node-2")),
    ("network", None, ("slowdown", "unknown", None, None)),
])
def test_a_slowdown_is_named_from_the_node_step_rows_as_from_every_rank_step(slow, slow_rank, expected):
    """The slowdown detector reads each node's step rows (the sidecar keeps each rank's baselines) instead of every
    rank's step span, and names the same straggler, data stall or slow network."""
    digest, per_rank, job = _both(40, nodes=3, slow=slow, slow_rank=slow_rank, slow_at=25, hang_at=10_000)
    assert digest == per_rank == [expected]
    reason = [r.details.get("reason") for r in job.records]
    assert reason == [{"compute": "compute", "data": "data", "network": "network"}[slow]]
    state = job.attribution.engine.jobs[JOB]
    assert not state.step_times and all(not r.steps for r in state.ranks.values())  # no per-rank step kept


def test_a_healthy_job_with_noisy_steps_gets_no_slowdown_either_way():
    digest, per_rank, _ = _both(40, nodes=3, hang_at=10_000)
    assert digest == per_rank == []


def test_a_healthy_job_gets_no_verdict_and_its_ticks_skip_the_per_rank_walk(monkeypatch):
    from otel_gpu.processors.attribution import _hang

    calls = []
    real = _hang.decide_hang
    monkeypatch.setattr(_hang, "decide_hang", lambda *a: calls.append(1) or real(*a))
    job = Job(nodes=2, digests=True, hang_at=10_000)
    assert job.run(30) == []
    assert calls == []  # the node digests said nobody is stalled


def test_a_late_digest_changes_nothing():
    job = Job(nodes=1, digests=True)
    job.run(3)
    node = job.attribution.engine.jobs[JOB].digest.nodes["node-0"]
    sent = node.sent
    lb = LogsBuilder({"training.job.id": JOB, "host.name": "node-0"})
    lb.event(T.NODE_DIGEST_EVENT, {"v": 1, "host": "node-0", "time": sent - 5, "ranks": [0], "groups": [
        {"ranks": [0], "fresh": True, "time": sent - 5, "step": 0, "state": "step", "inflight": None}]})
    job.attribution.process(Batch.from_message(Signal.LOGS, lb.build()))
    assert node.sent == sent
    state = job.attribution.engine.jobs[JOB]
    job.attribution.engine.sync(state)
    assert state.ranks[0].last_heartbeat.step == 3


def _rank_view(job: Job) -> dict:
    state = job.attribution.engine.jobs[JOB]
    out = {}
    for n, r in sorted(state.ranks.items()):
        hb = r.last_heartbeat
        out[n] = (r.last_seen, hb.time, hb.step, hb.state, hb.stalled_s, hb.inflight, hb.last_seq, hb.steps_done)
    nodes = {h: (x.stall_t0, x.seen_floor, x.last_step) for h, x in state.digest.nodes.items()}
    return {"ranks": out, "nodes": nodes}


def test_a_healthy_digest_reaches_the_ranks_when_they_are_read_as_it_would_have_at_once(monkeypatch):
    """The usual digest (every group fresh) is kept on its node and applied to the ranks when something reads them;
    what they then hold, and what the gate read meanwhile, is what applying each digest at once gave."""
    from otel_gpu.processors.attribution import _digest

    lazy = Job(nodes=3, digests=True, hang_at=10_000)
    lazy.run(12)
    state = lazy.attribution.engine.jobs[JOB]
    assert set(state.digest.unsynced) == {"node-0", "node-1", "node-2"}  # kept, not applied rank by rank
    monkeypatch.setattr(_digest, "_whole_fresh", lambda *a: None)  # every digest applied to its ranks at once
    eager = Job(nodes=3, digests=True, hang_at=10_000)
    eager.run(12)
    assert not eager.attribution.engine.jobs[JOB].digest.unsynced
    monkeypatch.undo()
    gate_before = _rank_view(lazy)["nodes"]
    # A rank's own record (its stacks, forwarded because it stands out) reads the ranks: the job is brought up to date.
    for job in (lazy, eager):
        lb = LogsBuilder(job._resource(5))
        lb.event(T.STACKS_EVENT, {"threads": [], "top": "/home/me/train.py:88 evaluate", "inflight": None},
                 time_ns=int(job.sim[0] * 1e9))
        job.attribution.process(Batch.from_message(Signal.LOGS, lb.build()))
    assert not state.digest.unsynced
    assert _rank_view(lazy) == _rank_view(eager) and gate_before == _rank_view(eager)["nodes"]


def test_a_kept_digest_of_the_wrong_shape_is_dropped_when_applied_and_the_ranks_keep_what_they_had():
    """Hostile input: a digest that passes the usual-digest check (fresh groups naming the node's ranks) but whose
    sequence numbers are not numbers is kept, then skipped when the ranks are read; nothing raises."""
    job = Job(nodes=1, digests=True, hang_at=10_000)
    job.run(3)
    state = job.attribution.engine.jobs[JOB]
    job.attribution.engine.sync(state)
    before = _rank_view(job)["ranks"]
    node = state.digest.nodes["node-0"]
    lb = LogsBuilder({"training.job.id": JOB, "host.name": "node-0"})
    lb.event(T.NODE_DIGEST_EVENT, {"v": 2, "host": "node-0", "time": node.sent + 1, "ranks": list(range(PER_NODE)),
                                   "groups": [{"ranks": list(range(PER_NODE)), "fresh": True, "time": node.sent + 1,
                                               "step": 9, "state": "step", "inflight": None,
                                               "last_seq": {"0": "nine"}}]})
    job.attribution.process(Batch.from_message(Signal.LOGS, lb.build()))
    assert "node-0" in state.digest.unsynced  # kept: its groups looked like the usual ones
    job.sim[0] += 1
    assert job.attribution.tick() == []
    job.attribution.engine.sync(state)
    assert not state.digest.unsynced
    assert {n: v[1:] for n, v in _rank_view(job)["ranks"].items()} == {n: v[1:] for n, v in before.items()}


def _restarted_job_goodput(digests: bool) -> dict:
    """One node of PER_NODE ranks through a real compact processor into a real goodput processor: steps 1-10 of
    incarnation 0 (1 s each), a SIGKILL, 5 s of restart gap, then incarnation 1 (new processes, restart count 1)
    resumes from the checkpoint of step 5 and runs steps 6-15."""
    import time

    from otel_gpu.processors.goodput import GoodputConfig, GoodputProcessor

    goodput = GoodputProcessor(build(GoodputConfig, {}, "processors.goodput"),
                               ComponentHost("goodput", PrometheusSelfTelemetry(), {}))
    into = _Into(goodput)
    sim = [time.time() - 600.0]  # inside the goodput window around receipt
    start = sim[0]
    sidecar = CompactProcessor(build(CompactConfig, {"digests": digests, "batch_interval": "1s" if digests else "0s"},
                                     "processors.compact"),
                               ComponentHost("compact", PrometheusSelfTelemetry(), {s: into for s in Signal}))
    sidecar._wall = lambda: sim[0]

    def send(signal, request):
        out = sidecar.process(Batch.from_message(signal, request))
        if out is not None:
            into.consume(out)

    def resource(rank: int, restarts: int) -> dict:
        return {"training.job.id": JOB, "training.rank": rank, "training.world_size": PER_NODE,
                "training.local_rank": rank, "host.name": "node-0", "process.pid": 1000 + 10 * restarts + rank,
                "training.restart_count": restarts, "service.name": "train"}

    def second(s: float, step: int | None, restarts: int) -> None:
        sim[0] = start + s
        for rank in range(PER_NODE):
            if step is not None:
                sb = SpansBuilder(resource(rank, restarts))
                sb.span(T.STEP_SPAN, int((sim[0] - 0.9) * 1e9), int(sim[0] * 1e9),
                        {str(T.STEP): step, str(T.STEP_COLLECTIVE_S): 0.2, str(T.STEP_DATA_S): 0.01})
                send(Signal.TRACES, sb.build())
            lb = LogsBuilder(resource(rank, restarts))
            lb.event(T.PROGRESS_EVENT, {"step": step or 0, "state": "step", "inflight": None,
                                        "last_seq": {"0": 4 * (step or 0)}, "last_started_seq": {"0": 4 * (step or 0)},
                                        "stalled_s": 0.1, "counters": {"steps": step or 0}},
                     time_ns=int(sim[0] * 1e9))
            send(Signal.LOGS, lb.build())
        sidecar.flush()

    for s in range(1, 11):
        second(s, s, 0)
    sim[0] = start + 10.5
    exits = LogsBuilder({"training.job.id": JOB, "host.name": "node-0", "service.name": "otel-gpu-run",
                         "training.restart_count": 0})
    for rank in range(PER_NODE):
        exits.event(T.EXIT_EVENT, {"exit_code": -9, "signal": "SIGKILL"}, {"training.rank": rank},
                    time_ns=int(sim[0] * 1e9))
    send(Signal.LOGS, exits.build())
    sidecar.flush()
    for s in range(16, 26):  # the new processes' first reports at 16 s, their steps 6-15
        second(s, s - 10, 1)
    sidecar.flush()
    (summary,) = goodput.summaries()
    return summary


def test_a_restarted_jobs_steps_count_in_its_new_incarnation_with_digests_as_with_every_rank_records():
    """A digest names the incarnation its ranks are in (training.restart_count on its resource): without it the
    aggregator counted a restarted job's step rows in incarnation 0, found those step numbers already counted and
    dropped them (a real restarted job through a digest sidecar read 0.0 s productive in every restart)."""
    digest, per_rank = _restarted_job_goodput(True), _restarted_job_goodput(False)
    by_rc = {inc["restart_count"]: inc for inc in digest["incarnations"]}
    assert sorted(by_rc) == [0, 1], digest["incarnations"]
    assert by_rc[1]["productive_time_s"] > 8.0, digest["incarnations"]  # steps 6-15, redone ones included
    for d, p in zip(digest["incarnations"], per_rank["incarnations"]):
        assert d["restart_count"] == p["restart_count"]
        assert d["productive_time_s"] == pytest.approx(p["productive_time_s"], abs=0.5), (d, p)
    assert digest["productive_time_s"] == pytest.approx(per_rank["productive_time_s"], abs=1.0)
