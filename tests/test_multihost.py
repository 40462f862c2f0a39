"""Many hosts for real (issue 11): network-namespace hosts, a multi-node job across real links, a sidecar per host and
the job's aggregator, and real link and node faults named by host.

The bed (``otel_gpu.testing.cluster`` / ``multinode``): 2 node hosts with a management link (telemetry) and a data
link (torchrun's rendezvous and gloo), an ``agg`` host with the job's aggregator, one sidecar per node host built from
docs/examples/sidecar.yaml, reading the host's real ``/sys/class/net``. Each job: ``otel-gpu run -- torchrun
--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node0:29400`` per host. One bed serves every test
(module fixture); the last test checks that tearing it down leaves no namespace, veth or process behind.

Node digests (issue 20, docs/scale.md): ``TestNodeDigests`` runs the user exception after an agent restart, the
degraded then cut link and the lost node again on a bed whose sidecars send node digests, and asks for the same
verdicts. ``OTEL_GPU_BED_DIGESTS=1`` turns digests on for the module's bed too (every test then runs with them, the
one that needs every rank's step spans at the aggregator's backend skips).

Needs root and iproute2: elsewhere these tests skip, except under CI=true, where they fail (.ci/run installs iproute2).
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel_gpu.instrumentation import jobid
from otel_gpu.testing import cluster as cl

ROOT = Path(__file__).resolve().parent.parent


_WHY = cl.unavailable_reason()
needs_bed = pytest.mark.skipif(_WHY is not None and os.environ.get("CI") != "true",
                               reason=f"network-namespace hosts unavailable: {_WHY}")


# -- job identity (no bed needed) -------------------------------------------------------------------------------------
@pytest.mark.parametrize("env, argv, expected", [
    ({"OTEL_GPU_JOB_ID": "mine", "SLURM_JOB_ID": "7"}, ["torchrun", "--rdzv-id", "r1", "t.py"],
     ("mine", "OTEL_GPU_JOB_ID")),
    ({"SLURM_JOB_ID": "7"}, ["torchrun", "--nnodes", "2", "--rdzv-id", "r1", "t.py", "--rdzv-id", "x"],
     ("r1", "torchrun --rdzv-id")),
    ({}, ["/venv/bin/torchrun", "--rdzv_id=r2", "-m", "pkg.train"], ("r2", "torchrun --rdzv-id")),
    ({}, [sys.executable, "-m", "torch.distributed.run", "--rdzv-id", "r3", "t.py"], ("r3", "torchrun --rdzv-id")),
    ({}, ["python", "train.py", "--rdzv-id", "not-torchrun"], None),
    ({"TORCHELASTIC_RUN_ID": "abc"}, [], ("abc", "torchrun's run id (TORCHELASTIC_RUN_ID)")),
    ({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "81234", "SLURM_STEP_ID": "0"}, [],
     ("slurm-81234.0", "Slurm (SLURM_JOB_ID, SLURM_STEP_ID)")),
    ({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "3"}, [],
     ("slurm-5_3", "Slurm (SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID)")),
    ({"OTEL_GPU_K8S_JOB_NAME": "llama-2", "OTEL_GPU_K8S_JOBSET_NAME": "llama", "OTEL_GPU_K8S_NAMESPACE": "ml"}, [],
     ("k8s-ml/llama", "Kubernetes JobSet (OTEL_GPU_K8S_JOBSET_NAME)")),
    ({"OTEL_GPU_K8S_PYTORCHJOB_NAME": "bert"}, [], ("k8s-bert", "Kubernetes PyTorchJob (OTEL_GPU_K8S_PYTORCHJOB_NAME)")),
    ({"TORCHELASTIC_RUN_ID": "none"}, ["torchrun", "--rdzv-id", "none", "t.py"], None),
])
def test_job_id_comes_from_the_scheduler_or_launcher(env, argv, expected):
    found = jobid.resolve(env, argv)
    assert (None if found is None else (found.value, found.source)) == expected


def test_run_says_which_job_id_and_adopts_the_agreed_one():
    out = io.StringIO()
    job = jobid.LaunchJobId(["torchrun", "--nnodes", "2", "t.py"], env={"TORCHELASTIC_RUN_ID": "none"}, out=out)
    assert job.provisional and job.value.startswith("job-")
    env = job.apply({"OTEL_GPU_JOB_ID": "stale", "PATH": "/bin"})
    assert "OTEL_GPU_JOB_ID" not in env and env[jobid.PROVISIONAL_ENV] == job.value  # the ranks must agree
    job.announce()

    class Identity:
        job_id = job.value

    who = Identity()
    job.adopt("job-agreed", who)
    job.adopt("job-other", who)  # adopted once: later registry entries do not move it
    assert (job.value, who.job_id, job.source) == ("job-agreed", "job-agreed", jobid.RENDEZVOUS_SOURCE)
    text = out.getvalue()
    assert "the ranks agree on one at their rendezvous" in text and "job id job-agreed (agreed at the rendezvous" in text
    out = io.StringIO()
    job = jobid.LaunchJobId(["torchrun", "--rdzv-id", "myjob", "t.py"], env={}, out=out)
    job.announce()
    assert job.apply({})["OTEL_GPU_JOB_ID"] == "myjob" and "job id myjob (from torchrun --rdzv-id)" in out.getvalue()


# -- the bed ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bed():
    from otel_gpu.testing.multinode import Bed

    b = Bed(2)
    b.root_links_before = _root_links()
    yield from _running(b)  # test_zz checks nothing is left


def _running(b):
    """Starts bed ``b`` for a fixture and closes it afterwards, also on test failure."""
    try:
        b.start()
    except cl.ClusterUnavailable as exc:
        pytest.fail(f"the bed cannot be built here: {exc}")
    try:
        yield b
    finally:
        b.close()


def _failures_of(bed, job_id: str, predicate=lambda fs: bool(fs), timeout_s: float = 30.0):
    failures, when = bed.wait_failures(lambda fs: predicate([f for f in fs if f["job_id"] == job_id]), timeout_s)
    return [f for f in failures if f["job_id"] == job_id], when


def _agreed_id(job, host: str, timeout_s: float = 60.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in job.output(host).splitlines():
            if line.startswith("otel-gpu run: job id ") and "agreed at the rendezvous" in line:
                return line.split()[4]
        time.sleep(0.5)
    return None


def _trigger_host(bed) -> str | None:
    """Where the training script's fault fired (ground truth, written by the faulty rank into its host's workdir)."""
    hits = [h.name for h in bed.hosts if (h.workdir / "trigger").exists()]
    return hits[0] if len(hits) == 1 else None


def _clear_triggers(bed) -> None:
    for h in bed.hosts:
        (h.workdir / "trigger").unlink(missing_ok=True)


# Before the module's bed is first used: the two beds never run at once (the module fixture lives to the module's end).
@needs_bed
class TestNodeDigests:
    """Every sidecar with ``processors.compact.digests: true``: the aggregator gets one node digest per second
    instead of every rank's heartbeats and step spans, and names the same faults the same way."""

    @pytest.fixture(scope="class")
    def digest_bed(self):
        from otel_gpu.testing.multinode import Bed

        b = Bed(2, digests=True)
        yield from _running(b)
        assert cl.leftovers(b.cluster.prefix) == []

    @pytest.fixture(scope="class")
    def digest_restart_then_exception(self, digest_bed):
        return _restart_then_exception(digest_bed)

    @pytest.fixture(scope="class")
    def digest_degrade_then_cut(self, digest_bed):
        return _degrade_then_cut(digest_bed)

    def test_user_exception_after_an_agent_restart_names_the_rank(self, digest_bed, digest_restart_then_exception):
        run = digest_restart_then_exception
        _agent_restart_is_no_failure(run)
        _user_exception_names_rank3_on_node1(run)
        # The verdict came from node digests: no rank's step span reached the aggregator (and its backend).
        assert digest_bed.steps_seen(run["job_id"]) == {}

    def test_degraded_link_is_a_network_slowdown(self, digest_bed, digest_degrade_then_cut):
        _degraded_link_is_a_network_slowdown(digest_bed, digest_degrade_then_cut)

    def test_link_cut_is_nic_link_down_on_host1(self, digest_bed, digest_degrade_then_cut):
        _link_cut_is_nic_link_down_on_node1(digest_bed, digest_degrade_then_cut)

    def test_node1_lost_is_node_lost_on_node1(self, digest_bed):
        _node1_lost_is_node_lost_on_node1(digest_bed)


@needs_bed
def test_hosts_are_separate_machines_on_real_links(bed):
    node0, node1 = bed.hosts
    assert node1.run(["hostname"]).stdout.strip() == "node1"
    assert sorted(node1.run(["ls", "/sys/class/net"]).stdout.split()) == ["data0", "eth0", "lo"]
    assert node1.run(["cat", "/sys/class/net/data0/operstate"]).stdout.strip() == "up"
    probe = ("import socket,sys; s=socket.socket(); s.bind(('10.77.1.10',0)); s.listen(); "
             "print(socket.gethostbyname('node1'))")
    assert node0.run([sys.executable, "-c", probe]).stdout.strip() == node1.data_addr
    before = node1.counters("data0")["tx_bytes"]
    node1.run([sys.executable, "-c", "import socket; socket.create_connection(('node0', 9), 2)"], check=False)
    assert node1.counters("data0")["tx_bytes"] > before  # the refused connection crossed the real veth


def _restart_then_exception(bed) -> dict:
    """One job that needs no job id from anyone (the ranks agree at their rendezvous): host node1's sidecar is killed
    and restarted mid-job, then the last rank raises a user exception at step 120."""
    _clear_triggers(bed)
    # Steps of ~0.2 s: CPU contention on a busy 2-core machine (stalls of 0.1 s) is then no slowdown.
    job = bed.launch(2, steps=140, rdzv_id=None, step_sleep_s=0.2,
                     env={"OTEL_GPU_FAULT": "exception", "OTEL_GPU_FAULT_RANK": "3", "OTEL_GPU_FAULT_STEP": "120"})
    from otel_gpu.testing.multinode import wait_training

    assert wait_training(bed, 2.0, 150, ranks=4), bed.report_text()
    t_kill = bed.restart_agent(bed.hosts[1], down_s=2.0)
    t_back = time.time()
    agreed = {h.name: _agreed_id(job, h.name, 60) for h in bed.hosts}
    job_id = agreed["node0"]
    failures, _ = _failures_of(bed, job_id, timeout_s=150)
    time.sleep(2.0)  # the last step spans through the sidecar's batch; later records would be revisions
    failures, _ = _failures_of(bed, job_id, timeout_s=1)
    rcs = job.wait(10)  # the survivors' torchrun agent waits for its rendezvous to close: not worth the test's time
    job.stop()
    return {"job": job, "rcs": rcs, "agreed": agreed, "job_id": job_id, "failures": failures, "t_kill": t_kill,
            "t_back": t_back, "trigger": _trigger_host(bed),
            "t_trigger": float((bed.cluster.root / (_trigger_host(bed) or "none") / "trigger").read_text())
            if _trigger_host(bed) else None}


@pytest.fixture(scope="module")
def restart_then_exception(bed):
    return _restart_then_exception(bed)


def _agent_restart_is_no_failure(run: dict) -> None:
    assert run["t_trigger"] and run["t_trigger"] > run["t_back"], "the exception came before the agent was back"
    # The only record of the job is the user exception that came later: the agent's absence was no failure.
    assert [(f["kind"], f["root_cause"]) for f in run["failures"]] == [("crash", "python_exception")], run["failures"]


def _user_exception_names_rank3_on_node1(run: dict) -> None:
    assert run["trigger"] == "node1", "rank 3 ran on node1 (torchrun's c10d rendezvous orders nodes by name)"
    (failure,) = run["failures"]
    assert (failure["kind"], failure["root_cause"], failure["category"], failure["action"]) == \
        ("crash", "python_exception", "user", "user_fix")
    culprit = failure["culprit"]
    assert (culprit["rank"], culprit["host"]) == (3, "node1")  # the rank's host (a join), not a host's fault
    assert culprit["gpu"] == "GPU-00000001-0000-4000-8000-000000000001"  # node1's GPU 1: local rank 1
    assert not any(e.startswith("nic.") for e in failure["evidence"])


@needs_bed
def test_one_job_id_on_every_node_agreed_at_the_rendezvous(bed, restart_then_exception):
    run = restart_then_exception
    assert run["agreed"]["node0"] and run["agreed"]["node0"] == run["agreed"]["node1"], \
        {h: run["job"].output(h)[-2000:] for h in ("node0", "node1")}
    for host in ("node0", "node1"):
        assert "the ranks agree on one at their rendezvous" in run["job"].output(host)
    jobs = [j for j in bed.report().get("jobs", []) if j["ranks"]]
    mine = [j for j in jobs if j["job_id"] == run["job_id"]]
    assert mine and mine[0]["ranks"] == 4 and mine[0]["hosts"] == 2, jobs
    members = bed.members(run["job_id"])
    assert members == {"hosts": {"node0", "node1"}, "ranks": {0, 1, 2, 3}}
    # No stray job: no other id of this run's launchers reached the aggregator.
    provisional = [line.rsplit(": ", 1)[1].rstrip(")") for h in ("node0", "node1")
                   for line in run["job"].output(h).splitlines() if "(until then, " in line]
    assert len(provisional) == 2
    assert not [j for j in jobs if j["job_id"] in provisional and j["job_id"] != run["job_id"]]


@needs_bed
def test_node_agent_restart_is_no_failure(restart_then_exception):
    _agent_restart_is_no_failure(restart_then_exception)


@needs_bed
def test_node_agent_restart_loses_no_step_span(bed, restart_then_exception):
    """Per-rank mode (digests off): the aggregator's backend gets every rank's step spans. With digests the sidecar
    folds them into node digests and the backend gets none (docs/scale.md): nothing to count there."""
    if bed.digests:
        pytest.skip("digests on: the aggregator forwards no rank's step spans to its backend (docs/scale.md)")
    run = restart_then_exception
    # Every step of every rank reached the aggregator, also those of node1 while its sidecar was down.
    steps = bed.steps_seen(run["job_id"])
    assert sorted(steps) == [0, 1, 2, 3]
    for rank, seen in steps.items():
        assert seen >= set(range(1, 119)), (rank, sorted(set(range(1, 119)) - seen)[:20])


@needs_bed
def test_user_exception_on_a_rank_of_host1_names_the_rank_not_the_host(restart_then_exception):
    _user_exception_names_rank3_on_node1(restart_then_exception)


@needs_bed
def test_report_shows_every_host_and_rank(bed, restart_then_exception):
    text = bed.report_text()
    assert f"{restart_then_exception['job_id']}: 4 ranks of 4 on 2 hosts" in text, text


def _degrade_then_cut(bed) -> dict:
    """One job over the data links: host node1's link is rate-limited (``tc ... tbf rate 20mbit``) until a slowdown
    is recorded, restored, then cut (``ip link set data0 down``) until the hang is named."""
    from otel_gpu.testing.multinode import wait_training

    node1 = bed.hosts[1]
    job = bed.launch(2, steps=3000, rdzv_id="mh-net", env={"OTEL_GPU_HIDDEN": "1024"})
    out: dict = {}
    try:
        assert wait_training(bed, 3.0, 150, ranks=4, job_id="mh-net"), bed.report_text()
        out["t_degrade"] = bed.degrade_link(node1, rate="20mbit")
        out["slow"], out["t_slow"] = _failures_of(bed, "mh-net", timeout_s=60)
        node1.restore("data0")
        time.sleep(3.0)  # a few healthy steps again
        out["t_cut"] = bed.cut_link(node1)
        out["all"], out["t_hang"] = _failures_of(bed, "mh-net", lambda fs: any(f["kind"] != "slowdown" for f in fs),
                                                 timeout_s=40)
    finally:
        node1.restore("data0")
        node1.set_link("data0", up=True)
        job.stop()
    return out


@pytest.fixture(scope="module")
def degrade_then_cut(bed):
    return _degrade_then_cut(bed)


def _degraded_link_is_a_network_slowdown(bed, run: dict) -> None:
    assert run["slow"], bed.report_text()
    (failure,) = run["slow"]
    assert (failure["kind"], failure["details"].get("reason"), failure["category"]) == \
        ("slowdown", "network", "infrastructure"), failure
    # Which node's link is shaped cannot be told from collective timing (docs/scale.md): no rank is blamed.
    assert failure["culprit"]["rank"] is None and failure["culprit"]["host"] is None


def _link_cut_is_nic_link_down_on_node1(bed, run: dict) -> None:
    terminal = [f for f in run["all"] if f["kind"] != "slowdown"]
    assert terminal, bed.report_text()
    (failure,) = terminal
    assert (failure["root_cause"], failure["category"], failure["action"]) == \
        ("nic_link_down", "infrastructure", "exclude_node_and_restart"), failure
    assert failure["culprit"]["host"] == "node1" and failure["culprit"]["rank"] in (2, 3)
    state = [e for e in failure["evidence"] if e.startswith("nic.data0.")]
    assert state, failure["evidence"]  # host node1's real operstate transition, read by its own sidecar
    assert run["t_hang"] - run["t_cut"] < 15.0  # the floor is 10 s on an idle machine (benchmarks/multihost.py)


@needs_bed
def test_degraded_link_on_host1_is_a_network_slowdown(bed, degrade_then_cut):
    _degraded_link_is_a_network_slowdown(bed, degrade_then_cut)


@needs_bed
def test_link_cut_on_host1_is_nic_link_down_on_host1(bed, degrade_then_cut):
    _link_cut_is_nic_link_down_on_node1(bed, degrade_then_cut)


def _node1_lost_is_node_lost_on_node1(bed) -> None:
    node1 = bed.hosts[1]
    job = bed.launch(2, steps=2000, rdzv_id="mh-nodelost", step_sleep_s=0.2)
    from otel_gpu.testing.multinode import wait_training

    try:
        assert wait_training(bed, 2.0, 150, ranks=4, job_id="mh-nodelost")
        t_lost = bed.lose_node(node1)  # ranks, torchrun agent, otel-gpu run and the sidecar, at once
        failures, seen = _failures_of(bed, "mh-nodelost", lambda fs: any(f["kind"] != "slowdown" for f in fs),
                                      timeout_s=40)
    finally:
        job.stop()
    assert not node1.pids()
    terminal = [f for f in failures if f["kind"] != "slowdown"]  # a busy machine may slow the job first
    assert terminal, bed.report_text()
    (failure,) = terminal
    assert (failure["kind"], failure["root_cause"], failure["action"]) == \
        ("crash", "node_lost", "exclude_node_and_restart"), failure
    assert failure["culprit"]["host"] == "node1" and sorted(failure["details"]["ranks"]) == [2, 3]
    assert seen - t_lost < 15.0
    bed.start_sidecar(node1)  # the node is back for whatever follows


@needs_bed
def test_node1_lost_is_node_lost_on_node1(bed):
    _node1_lost_is_node_lost_on_node1(bed)


@needs_bed
def test_interrupted_cli_tears_everything_down(tmp_path):
    """Ctrl-C during ``python -m otel_gpu.testing.cluster``: namespaces, veths and processes of that run are gone."""
    proc = subprocess.Popen([sys.executable, "-m", "otel_gpu.testing.cluster", "--hosts", "2"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    prefix = f"{cl.PREFIX}{proc.pid}-"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not cl.leftovers(prefix):
        time.sleep(0.2)
    assert cl.leftovers(prefix), "the bed never came up"
    time.sleep(3)  # collectors and the job starting
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert cl.leftovers(prefix) == [], out[-2000:]


@needs_bed
def test_zz_tearing_down_the_bed_leaves_nothing(bed):
    netns = [h.netns for h in bed.cluster.all_hosts] + [bed.cluster.switch]
    pids = [p for h in bed.cluster.all_hosts for p in h.pids()]
    assert pids  # sidecars and the aggregator were running
    bed.close()
    assert cl.leftovers(bed.cluster.prefix) == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in netns if n in listed]
    assert not [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]
    assert _root_links() <= bed.root_links_before  # no veth (or other link) left in the machine's own namespace


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "gone"
