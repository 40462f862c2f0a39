"""The instrumentation, proven on real gloo jobs (torch.multiprocessing / subprocess) exporting to a real OTLP gRPC
sink. Each job runs once per module (fixtures) and several tests read its output."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from otel_gpu.testing.otlp_sink import OtlpSink  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "dist_jobs"
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


def run_job(args: list[str], sink: OtlpSink | None, timeout_s: float = 90, env: dict | None = None,
            endpoint: str | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OTEL_GPU_HEARTBEAT_S="0.5", OTEL_GPU_STACK_AFTER_S="1.5", PYTHONUNBUFFERED="1",
                    TEST_TMP=os.environ.get("TEST_TMP", "/tmp"))
    full_env.pop("OTEL_GPU_JOB_ID", None)
    if sink is not None or endpoint:
        full_env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint or sink.endpoint
    full_env.update(env or {})
    return subprocess.run(args, env=full_env, timeout=timeout_s, capture_output=True, text=True, cwd=ROOT)


class Seen:
    """Spans and log records of one job, by rank."""

    def __init__(self, sink: OtlpSink, proc: subprocess.CompletedProcess, wall_s: float):
        self.proc, self.wall_s = proc, wall_s
        self.spans: list[tuple[dict, str, dict, object]] = []  # (resource, name, attrs, span)
        self.logs: list[tuple[dict, str, dict, dict]] = []  # (resource, event, attrs, body)
        for req in sink.traces:
            for rs in req.resource_spans:
                res = attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for sp in ss.spans:
                        self.spans.append((res, sp.name, attrs(sp.attributes), sp))
        for req in sink.logs:
            for rl in req.resource_logs:
                res = attrs(rl.resource.attributes)
                for sl in rl.scope_logs:
                    for lr in sl.log_records:
                        self.logs.append((res, lr.event_name, attrs(lr.attributes), json.loads(lr.body.string_value)))

    def collectives(self, rank: int, source: str | None = None) -> list[dict]:
        return sorted((a for r, n, a, _ in self.spans if n == "otel_gpu.collective" and r.get("training.rank") == rank
                       and (source is None or a.get("collective.source") == source)),
                      key=lambda a: (a.get("collective.p2p", False), a["collective.seq"]))

    def events(self, name: str, rank: int | None = None) -> list[tuple[dict, dict, dict]]:
        return [(r, a, b) for r, n, a, b in self.logs if n == name and (rank is None or r.get("training.rank") == rank)]


def _run_seen(args, timeout_s=90, env=None) -> Seen:
    with OtlpSink() as sink:
        t0 = time.monotonic()
        proc = run_job(args, sink, timeout_s, env)
        wall = time.monotonic() - t0
        sink.wait_for(lambda s: False, timeout_s=0.3)
        return Seen(sink, proc, wall)


# ------------------------------------------------------------------------------------------------ plain + DDP job
@pytest.fixture(scope="module")
def collectives_job(tmp_path_factory) -> Seen:
    tmp = tmp_path_factory.mktemp("ckpt")
    seen = _run_seen([PY, str(JOBS / "collectives.py"), "2", str(free_port()), "3"], env={"TEST_TMP": str(tmp)})
    assert seen.proc.returncode == 0, seen.proc.stderr[-3000:]
    return seen


def test_every_python_collective_is_a_span_with_torch_sequence_numbers(collectives_job):
    r0 = collectives_job.collectives(0, "python")
    r1 = collectives_job.collectives(1, "python")
    ops0 = [(a["collective.op"], a["collective.seq"]) for a in r0 if not a.get("collective.p2p")]
    ops1 = [(a["collective.op"], a["collective.seq"]) for a in r1 if not a.get("collective.p2p")]
    # same op at the same per-group seq on both ranks; seq 8..15 are DDP's (flight recorder), the last one is 16
    assert ops0 == ops1
    assert ops0 == [("all_reduce", 1), ("all_reduce", 2), ("all_reduce", 3), ("all_gather_into_tensor", 4),
                    ("broadcast", 5), ("all_reduce", 6), ("barrier", 7), ("all_reduce", 16)]
    first = r0[0]
    assert first["collective.pg.name"] == "0" and first["collective.pg.size"] == 2
    assert first["collective.bytes"] == 256 * 4 and first["collective.dtype"] == "float32"
    assert first["collective.async"] is False
    bcast = next(a for a in r0 if a["collective.op"] == "broadcast")
    assert bcast["collective.peer"] == 0


def test_point_to_point_and_async_ops(collectives_job):
    send = [a for a in collectives_job.collectives(0, "python") if a.get("collective.p2p")]
    recv = [a for a in collectives_job.collectives(1, "python") if a.get("collective.p2p")]
    assert [(a["collective.op"], a["collective.peer"], a["collective.seq"]) for a in send] == [("send", 1, 1)]
    assert [(a["collective.op"], a["collective.peer"], a["collective.seq"]) for a in recv] == [("recv", 0, 1)]
    async_ops = [a for a in collectives_job.collectives(0) if a.get("collective.async")]
    assert [(a["collective.op"], a["collective.seq"]) for a in async_ops] == [("all_reduce", 6)]
    waits = [a for r, n, a, _ in collectives_job.spans if n == "otel_gpu.work.wait" and r["training.rank"] == 0]
    assert [(a["collective.op"], a["collective.seq"]) for a in waits] == [("all_reduce", 6)]


def test_ddp_gradient_all_reduces_come_from_the_flight_recorder(collectives_job):
    for rank in (0, 1):
        fr = collectives_job.collectives(rank, "flight_recorder")
        grads = [a for a in fr if a["collective.op"] == "all_reduce"]
        # DDP construction (all_gather of shapes, parameter broadcasts) + one bucket all-reduce per step
        assert len(grads) == 3, fr
        assert {a["training.step"] for a in grads} == {1, 2, 3}
        assert all(a["collective.bytes"] > 0 and a["collective.dtype"] == "float32" for a in grads)
        seqs = [a["collective.seq"] for a in fr]
        assert seqs == list(range(8, 16)), seqs  # no gap and no duplicate with the Python-issued ones
    assert [a["collective.seq"] for a in collectives_job.collectives(0, "flight_recorder")] == \
        [a["collective.seq"] for a in collectives_job.collectives(1, "flight_recorder")]


def test_steps_data_waits_checkpoints_and_identity(collectives_job):
    by_name = defaultdict(list)
    for res, name, a, sp in collectives_job.spans:
        by_name[name].append((res, a, sp))
    steps = sorted((res["training.rank"], a["training.step"]) for res, a, _ in by_name["otel_gpu.step"])
    assert steps == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert len(by_name["otel_gpu.data.wait"]) == 6
    saves = by_name["otel_gpu.checkpoint.save"]
    assert len(saves) == 2 and all(a["checkpoint.bytes"] > 0 for _, a, _ in saves)
    res = by_name["otel_gpu.step"][0][0]
    assert res["service.name"] == "otel-gpu-training" and res["training.world_size"] == 2
    assert res["host.name"] and res["process.pid"] > 0
    assert len({r["training.job.id"] for r, *_ in collectives_job.spans}) == 1  # ranks agreed on one job id
    # the spans of step n share one trace on every rank, children of that rank's step span
    step_spans = {(r["training.rank"], a["training.step"]): sp for r, a, sp in by_name["otel_gpu.step"]}
    assert step_spans[(0, 2)].trace_id == step_spans[(1, 2)].trace_id
    grad = next(sp for r, n, a, sp in collectives_job.spans if n == "otel_gpu.collective" and r["training.rank"] == 0
                and a.get("training.step") == 2 and a["collective.source"] == "flight_recorder"
                and a["collective.op"] == "all_reduce")
    assert grad.parent_span_id == step_spans[(0, 2)].span_id


def test_fsdp2_collectives_are_seen_through_the_flight_recorder():
    seen = _run_seen([PY, str(JOBS / "fsdp.py"), str(free_port())])
    if seen.proc.returncode != 0 and "fully_shard" in seen.proc.stderr:
        pytest.skip("FSDP2 not usable on this torch build (CPU/gloo)")
    assert seen.proc.returncode == 0, seen.proc.stderr[-3000:]
    per_rank = []
    for rank in (0, 1):
        fr = seen.collectives(rank, "flight_recorder")
        ops = {a["collective.op"] for a in fr}
        assert "all_gather" in ops or "all_gather_into_tensor" in ops or "_allgather_base" in ops, ops
        assert {a["training.step"] for a in fr} >= {1, 2}
        per_rank.append([(a["collective.op"], a["collective.seq"]) for a in fr])
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) >= 8


# ------------------------------------------------------------------------------------------------ hang
@pytest.fixture(scope="module")
def hang_job() -> Seen:
    """Rank 2 of 3 sleeps 4 s before all_reduce seq 3 (Python), then 4 s before step 2 of a DDP model (C++)."""
    seen = _run_seen([PY, str(JOBS / "hang.py"), "both", str(free_port()), "4"])
    assert seen.proc.returncode == 0, seen.proc.stderr[-3000:]
    return seen


def test_heartbeats_show_who_waits_in_which_collective_and_where_the_late_rank_is(hang_job):
    for rank in (0, 1):
        stuck = [b for _, _, b in hang_job.events("otel_gpu.progress", rank)
                 if b["inflight"] and b["inflight"].get("seq") == 3 and b["stalled_s"] >= 1.0]
        assert len(stuck) >= 3, rank
        b = stuck[-1]
        assert b["inflight"]["op"] == "all_reduce" and b["inflight"]["pg"] == "0" and b["state"] == "collective"
        assert b["inflight"]["kind"] == "collective"
        assert b["last_seq"] == {"0": 2} and b["last_started_seq"] == {"0": 3}
    late = [b for _, _, b in hang_job.events("otel_gpu.progress", 2)
            if b["stalled_s"] >= 1.0 and b["last_started_seq"] == {"0": 2}]
    assert len(late) >= 3 and all(b["inflight"] is None and b["last_seq"] == {"0": 2} for b in late)
    stacks = [b for _, _, b in hang_job.events("otel_gpu.stacks", 2) if b["user_top"].endswith("slow_data_prep")]
    assert stacks, "the late rank sends its stacks"
    body = stacks[0]
    assert "hang.py" in body["user_top"]
    main = next(t for t in body["threads"] if t["main"])
    assert any(f["function"] == "slow_data_prep" for f in main["frames"])
    waiting = [b for _, _, b in hang_job.events("otel_gpu.stacks", 0) if (b["inflight"] or {}).get("seq") == 3]
    assert waiting and waiting[0]["user_top"].endswith(" run")


def test_watchdog_keeps_beating_while_the_main_thread_is_blocked_in_gloo(hang_job):
    beats = [b for _, _, b in hang_job.events("otel_gpu.progress", 0)
             if b["inflight"] and b["inflight"].get("seq") == 3]
    # heartbeat every 0.5 s during a ~4 s wait inside all_reduce
    assert len(beats) >= 5
    assert beats[-1]["stalled_s"] > beats[0]["stalled_s"] + 1.5


def test_a_hang_inside_ddps_cpp_collectives_is_seen_through_the_flight_recorder(hang_job):
    late = [b for _, _, b in hang_job.events("otel_gpu.progress", 2)
            if b["stalled_s"] >= 1.5 and b["last_started_seq"].get("0", 0) > 3]
    assert late
    late_seq = late[-1]["last_started_seq"]["0"]
    for rank in (0, 1):
        stuck = [b for _, _, b in hang_job.events("otel_gpu.progress", rank)
                 if b["inflight"] and b["inflight"]["kind"] == "flight_recorder" and b["stalled_s"] >= 1.5]
        assert stuck, rank
        assert stuck[-1]["inflight"]["seq"] > late_seq  # the others are past the late rank's last op
        assert stuck[-1]["state"] == "collective"
    ddp_stacks = [b for _, _, b in hang_job.events("otel_gpu.stacks", 2) if b["user_top"].endswith("slow_data_prep")]
    assert len(ddp_stacks) == 2  # once per stall: the Python phase and the DDP phase


# ------------------------------------------------------------------------------------------------ crashes via otel-gpu run
def _run_crash(mode: str) -> Seen:
    return _run_seen([PY, "-m", "otel_gpu", "run", "--", PY, str(JOBS / "crash.py"), mode, str(free_port())],
                     timeout_s=120)


@pytest.fixture(scope="module")
def crash_raise() -> Seen:
    return _run_crash("raise")


def _exits(seen: Seen) -> dict:
    return {b.get("rank"): b for _, _, b in seen.events("otel_gpu.process.exit") if "source" in b
            and b["source"] != "self"}


def test_a_rank_raising_is_reported_with_type_hint_and_exit(crash_raise):
    assert crash_raise.proc.returncode == 1
    exc = crash_raise.events("otel_gpu.exception", 1)
    assert len(exc) == 1
    _, a, b = exc[0]
    assert a["exception.type"] == "ValueError" and a["exception.hint"] == "user_code"
    assert "bad batch" in a["exception.message"] and "crash.py" in a["exception.stacktrace"]
    assert b["frames"][-1]["function"] == "run"
    exits = _exits(crash_raise)
    assert exits[1]["code"] == 1 and exits[1]["how"] == "exception"
    # the others are consequences: stopped by torch.multiprocessing (SIGTERM) after rank 1 failed, or failed first
    # in the collective rank 1 never joined (peer_failure), whichever came first
    for rank in (0, 2):
        other = exits[rank]
        assert other["signal"] == "SIGTERM" or other.get("exception", {}).get("hint") == "peer_failure", other
        assert exits[1]["ended_at"] <= other["ended_at"] + 0.5  # the parent reaps in its own order
    res = crash_raise.events("otel_gpu.process.exit")[0][0]
    assert res["training.job.id"].startswith("job-")


def test_ranks_killed_by_sigkill_or_ending_in_os_exit_are_named_by_the_launcher():
    seen = _run_crash("exit_kill")
    assert seen.proc.returncode == 1
    exits = _exits(seen)
    assert exits[1]["code"] == 3 and exits[1]["signal"] is None and exits[1].get("no_atexit") is True
    assert exits[2]["signal"] == "SIGKILL" and exits[2]["code"] == -9 and exits[2]["how"] == "killed"
    assert "rank 2" in seen.proc.stderr and "SIGKILL" in seen.proc.stderr
    assert not seen.events("otel_gpu.exception", 1) and not seen.events("otel_gpu.exception", 2)


# ------------------------------------------------------------------------------------------------ ways in
def test_opentelemetry_instrument_on_an_unmodified_script():
    exe = Path(PY).with_name("opentelemetry-instrument")
    if not exe.exists():
        pytest.skip("opentelemetry-instrument not installed")
    # OTEL_*_EXPORTER keep their default (otlp): otel-gpu's export path honours them too, so "none" would silence it
    # along with the SDK's (which has nothing to send here).
    seen = _run_seen([str(exe), PY, str(JOBS / "collectives.py"), "2", str(free_port())],
                     env={"OTEL_GPU_TEST_NO_INSTRUMENT": "1"})
    assert seen.proc.returncode == 0, seen.proc.stderr[-3000:]
    ops = [(a["collective.op"], a["collective.seq"]) for a in seen.collectives(1, "python")
           if not a.get("collective.p2p")]
    assert ops[:3] == [("all_reduce", 1), ("all_reduce", 2), ("all_reduce", 3)]


def test_otel_gpu_run_on_an_unmodified_script_and_a_clean_exit():
    seen = _run_seen([PY, "-m", "otel_gpu", "run", "--", PY, str(JOBS / "collectives.py"), "2", str(free_port())],
                     env={"OTEL_GPU_TEST_NO_INSTRUMENT": "1"})
    assert seen.proc.returncode == 0, seen.proc.stderr[-3000:]
    assert len(seen.collectives(0, "python")) >= 8 and len(seen.collectives(1, "python")) >= 8
    exits = _exits(seen)
    assert exits[0]["code"] == 0 and exits[1]["code"] == 0
    assert "ended:" not in seen.proc.stderr, [line for line in seen.proc.stderr.splitlines() if "ended:" in line]


def test_instrument_uninstrument_reinstrument():
    with OtlpSink() as sink:
        proc = run_job([PY, str(JOBS / "reinstrument.py"), str(free_port())], sink, timeout_s=60)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        stages = {s["stage"]: s for s in json.loads(line[len("RESULT "):])}
        sink.wait_for(lambda s: s.span_count() >= 9, timeout_s=3)
        seen = Seen(sink, proc, 0)
    assert stages["instrumented"] == {"stage": "instrumented", "wrapped": True, "records": 3, "flushed": True}
    assert stages["uninstrumented"]["wrapped"] is False and stages["uninstrumented"]["records"] == 0
    assert all(stages["restored"][k] for k in ("all_reduce", "save", "wait", "excepthook"))
    assert stages["reinstrumented"]["wrapped"] is True and stages["reinstrumented"]["records"] == 4
    seqs = [a["collective.seq"] for r, n, a, _ in seen.spans if n == "otel_gpu.collective"]
    # torch counted 3 + 5 + 4 + 1 all_reduces; the uninstrumented 5 are not exported, the numbering stays torch's
    assert 1 in seqs and 3 in seqs and 4 not in seqs[:3]
    explicit = [a for r, n, a, _ in seen.spans if n == "otel_gpu.step"]
    assert [a["training.step"] for a in explicit] == [41]
    ck = [a for r, n, a, _ in seen.spans if n == "otel_gpu.checkpoint.save"]
    assert ck and ck[0]["checkpoint.path"] == "/nonexistent/explicit.pt"


def test_no_collector_the_job_finishes_normally_and_as_fast():
    args = [PY, str(JOBS / "collectives.py"), "2", None, "0"]
    t0 = time.monotonic()
    plain = run_job(args[:3] + [str(free_port())] + args[4:], None, env={"OTEL_GPU_TEST_NO_INSTRUMENT": "1"})
    plain_s = time.monotonic() - t0
    assert plain.returncode == 0, plain.stderr[-2000:]
    t0 = time.monotonic()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    inst = run_job(args[:3] + [str(free_port())] + args[4:], None, endpoint=dead)
    inst_s = time.monotonic() - t0
    assert inst.returncode == 0, inst.stderr[-2000:]
    assert inst.stderr.count("OTLP export to") <= 2  # one warning per rank, not one per batch
    assert inst_s < plain_s * 1.6 + 3.0, (plain_s, inst_s)


def test_otel_gpu_run_torchrun_instruments_workers_not_the_agent_and_names_the_killed_worker():
    torchrun = Path(PY).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed")
    seen = _run_seen([PY, "-m", "otel_gpu", "run", "--", str(torchrun), "--standalone", "--nproc-per-node", "2",
                      "--max-restarts", "0", str(JOBS / "torchrun_job.py")], env={"KILL_RANK": "1"}, timeout_s=120)
    assert seen.proc.returncode == 1
    exits = _exits(seen)
    assert exits[1]["signal"] == "SIGKILL" and exits[1]["local_rank"] == 1
    agent = [b for _, _, b in seen.events("otel_gpu.process.exit") if b.get("role") == "agent"]
    assert agent and agent[0]["code"] == 1
    # the survivor is a consequence: it failed in a collective because its peer vanished (classified as such), or
    # the agent stopped it (SIGTERM) before gloo noticed, whichever came first on a loaded machine
    survivor = seen.events("otel_gpu.exception", 0)
    if survivor:
        assert survivor[0][1]["exception.hint"] == "peer_failure", survivor
    else:
        assert exits[0]["signal"] == "SIGTERM", exits[0]
    assert exits[1]["ended_at"] <= exits[0]["ended_at"]
    # workers were instrumented (job id from the launcher), the agent was not (no rank-less spans)
    jobs = {r["training.job.id"] for r, *_ in seen.spans}
    assert len(jobs) == 1 and all("training.rank" in r for r, *_ in seen.spans)
    fr = [a for r, n, a, _ in seen.spans if a.get("collective.source") == "flight_recorder"]
    assert fr, "DDP's all-reduces in torchrun workers"
