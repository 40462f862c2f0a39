"""The job board of the verdict exporter (issue 19: one job-wide decision per failure, carried out on every node):
membership, compare-and-set on the generation, spares, shrinking, the rendezvous host moving, and what a sender
that may post still cannot do (exclude a host no verdict blames). Through the real exporter over HTTP on loopback."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from otel_gpu.component import ComponentHost
from otel_gpu.config import build
from otel_gpu.exporters.verdict import FACTORY, VerdictExporterConfig
from otel_gpu.exporters.verdict.jobs import JobBoard, Refused
from otel_gpu.instrumentation import _export
from otel_gpu.pdata import Batch, Signal
from otel_gpu.schema import failure as F
from otel_gpu.supervisor._job import JobLink
from otel_gpu.supervisor._verdict import Refused as ClientRefused
from otel_gpu.supervisor._verdict import VerdictClient, VerdictUnavailable

TOKEN = "board-token-0123456789"


class _Telemetry:
    def __getattr__(self, name):
        return lambda *a, **k: None


@pytest.fixture
def exporter():
    cfg = build(VerdictExporterConfig, {"endpoint": "127.0.0.1:0", "auth": {"bearer_token": TOKEN}},
                "exporters.verdict")
    exp = FACTORY.create(cfg, ComponentHost("verdict", _Telemetry()))
    exp.start()
    yield exp
    exp.shutdown()


def _failure(job, fid, host, cause="nic_link_down", kind="hang"):
    now = time.time()
    return {"failure_id": fid, "version": 1, "job_id": job, "kind": kind, "root_cause": cause,
            "category": "infrastructure", "action": "exclude_node_and_restart", "onset_time": now - 5,
            "detected_time": now, "confidence": 0.9, "culprit": {"rank": 2, "host": host, "gpu": None},
            "evidence": [], "summary": "x"}


def _deliver(exp, *records):
    req = _export.logs_request(_export.make_resource({"service.name": "otel-gpu"}),
                               [(F.FAILURE_EVENT.name, 1, {}, r, _export.ERROR) for r in records])
    exp.export(Batch.from_message(Signal.LOGS, req))


def _post(url, body, token=TOKEN, raw=None):
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


# -- the board alone --------------------------------------------------------------------------------------------------
def test_the_first_nodes_are_members_later_ones_spares_and_registering_again_changes_nothing():
    board = JobBoard()
    roles = [board.register("j", h, h, nnodes=2)["role"] for h in ("n1", "n0", "n2", "n3", "n0")]
    assert roles == ["active", "active", "spare", "spare", "active"]
    state = board.state("j")
    assert state["members"] == ["n1", "n0"] and state["spares"] == ["n2", "n3"] and state["generation"] == 0
    with pytest.raises(Refused, match="differs from the job's"):
        board.register("j", "n4", "n4", nnodes=3)  # every node must run the same command
    with pytest.raises(Refused, match="host"):
        board.register("j", "n5;rm -rf /", "n5", nnodes=2)


def test_one_decision_per_generation_whoever_proposes_first():
    board = JobBoard()
    for h in ("n0", "n1", "n2"):
        board.register("j", h, h, nnodes=2)
    failures = {"f": _failure("j", "f", "n1")}
    first = board.propose("j", 0, {"decision": "exclude_and_restart", "exclude_hosts": ["n1"], "failure_id": "f",
                                   "by": "n1", "backoff_s": 2.0}, failures)
    late = board.propose("j", 0, {"decision": "stop", "by": "n0", "exit_status": 1}, failures)
    assert first["accepted"] and not late["accepted"] and late["decision"] == first["decision"]
    d = first["decision"]
    assert (d["decision"], d["members"], d["joined"], d["exclude_hosts"], d["next_generation"], d["backoff_s"]) == \
        ("exclude_and_restart", ["n0", "n2"], ["n2"], ["n1"], 1, 2.0)
    assert d["hook_host"] == "n1" and d["root_cause"] == "nic_link_down"
    state = board.state("j", "n1")
    assert state["role"] == "excluded" and state["generation"] == 1 and state["spares"] == []
    # The excluded node registering again (its supervisor restarted) is told so, never made a member.
    assert board.register("j", "n1", "n1", nnodes=2)["role"] == "excluded"


def test_a_restart_in_place_keeps_the_nodes_and_the_budget_sees_every_restart_of_the_job():
    board = JobBoard()
    for h in ("n0", "n1"):
        board.register("j", h, h, nnodes=2)
    failures = {"f": _failure("j", "f", "n1", cause="rank_process_died", kind="crash")}
    d = board.propose("j", 0, {"decision": "restart", "failure_id": "f", "by": "n0"}, failures)["decision"]
    assert d["members"] == ["n0", "n1"] and d["joined"] == [] and d["exclude_hosts"] == []
    state = board.state("j")
    assert [x["decision"] for x in state["decisions"]] == ["restart"] and state["generation"] == 1


def test_no_spare_stops_unless_torchrun_is_elastic_and_the_policy_allows_a_smaller_job():
    fixed, elastic = JobBoard(), JobBoard()
    for h in ("n0", "n1"):
        fixed.register("j", h, h, nnodes=2)
        elastic.register("j", h, h, nnodes=2, min_nodes=1)
    failures = {"f": _failure("j", "f", "n1")}
    proposal = {"decision": "exclude_and_restart", "exclude_hosts": ["n1"], "failure_id": "f", "by": "n0"}
    d = fixed.propose("j", 0, proposal, failures)["decision"]
    assert d["decision"] == "stop" and "no spare node to take the place of n1" in d["reason"]
    assert fixed.state("j")["ended"] == "stop"
    d = elastic.propose("j", 0, proposal, failures)["decision"]
    assert d["decision"] == "stop" and "nodes.allow_shrink" in d["reason"]  # allowed by torchrun, not the policy
    elastic2 = JobBoard()
    for h in ("n0", "n1"):
        elastic2.register("j", h, h, nnodes=2, min_nodes=1)
    d = elastic2.propose("j", 0, dict(proposal, allow_shrink=True), failures)["decision"]
    assert d["decision"] == "exclude_and_restart" and d["members"] == ["n0"]


def test_the_rendezvous_moves_when_its_host_is_excluded_and_a_spare_gone_quiet_is_not_picked():
    board = JobBoard()
    for h in ("node0", "node1"):
        board.register("j", h, f"{h}.data", nnodes=2, rdzv_endpoint_host="node0.data")
    board.register("j", "quiet", "quiet", nnodes=2)
    board.register("j", "node2", "node2.data", nnodes=2)
    board._jobs["j"].nodes["quiet"]["seen"] -= 60  # registered, then never asked again: maybe gone
    failures = {"f": _failure("j", "f", "node0")}
    d = board.propose("j", 0, {"decision": "exclude_and_restart", "exclude_hosts": ["node0"], "failure_id": "f",
                               "by": "node1"}, failures)["decision"]
    assert d["members"] == ["node1", "node2"] and d["rdzv_host"] == "node1.data"


def test_link_rewrites_torchrun_for_the_generation_the_board_chose():
    client = VerdictClient("http://127.0.0.1:9")
    cmd = ["torchrun", "--nnodes", "1:2", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "j", "-m", "train"]
    link = JobLink(client, "j", "node1", cmd)
    assert JobLink.wanted(cmd) and not JobLink.wanted(["torchrun", "--standalone", "--nproc-per-node", "2", "t.py"])
    assert link.command() == cmd  # generation 0: exactly as given
    link.generation = 1
    link.state = {"members": ["node1"], "rdzv_host": "node1"}
    assert link.command() == ["torchrun", "--nnodes", "1", "--rdzv-endpoint", "node1:29400", "--rdzv-id", "j",
                              "-m", "train"]


# -- over HTTP, as a stranger would -------------------------------------------------------------------------------
def test_the_jobs_api_decides_once_and_refuses_what_no_verdict_supports(exporter):
    url = exporter.url
    _deliver(exporter, _failure("j1", "f1", "node1"))
    for host in ("node0", "node1", "node2"):
        status, body = _post(f"{url}/api/v1/jobs/register", {"job_id": "j1", "host": host, "rdzv_host": host,
                                                              "nnodes": 2, "min_nodes": 2})
        assert status == 200, body
    assert body["role"] == "spare"
    # Without the token: refused, nothing changes.
    status, _ = _post(f"{url}/api/v1/jobs/decisions", {"job_id": "j1", "generation": 0, "decision": {
        "decision": "exclude_and_restart", "exclude_hosts": ["node0"], "by": "node1", "exit_status": 1}}, token=None)
    assert status == 401
    # With the token, excluding a host that no verdict blames (node0; the verdict names node1): 409.
    status, body = _post(f"{url}/api/v1/jobs/decisions", {"job_id": "j1", "generation": 0, "decision": {
        "decision": "exclude_and_restart", "exclude_hosts": ["node0"], "failure_id": "f1", "by": "node1"}})
    assert status == 409 and "no failure this collector holds blames 'node0'" in body["error"]
    # A failure this collector does not hold (forged id): 409.
    status, body = _post(f"{url}/api/v1/jobs/decisions", {"job_id": "j1", "generation": 0, "decision": {
        "decision": "restart", "failure_id": "forged", "by": "node1"}})
    assert status == 409
    for raw, code in ((b"{", 400), (b"[1]", 400), (b"x" * 70000, 413)):
        assert _post(f"{url}/api/v1/jobs/decisions", None, raw=raw)[0] == code
    assert exporter.board.state("j1")["generation"] == 0 and not exporter.board.state("j1")["decisions"]
    client = VerdictClient(url, TOKEN)
    with pytest.raises(ClientRefused, match="blames"):
        client.propose("j1", 0, {"decision": "exclude_and_restart", "exclude_hosts": ["node2"], "failure_id": "f1",
                                 "by": "node0"})
    answer = client.propose("j1", 0, {"decision": "exclude_and_restart", "exclude_hosts": ["node1"],
                                      "failure_id": "f1", "by": "node0"})
    assert answer["accepted"] and answer["decision"]["members"] == ["node0", "node2"]
    state = client.job_state("j1", "node2")
    assert state["role"] == "active" and state["generation"] == 1
    with pytest.raises(VerdictUnavailable, match="HTTP 404"):
        client.job_state("nope", "node0")
    with pytest.raises(VerdictUnavailable, match="401"):
        VerdictClient(url).job_state("j1", "node0")


def test_a_drained_device_lets_its_host_be_excluded(exporter):
    from otel_gpu.schema import health as H

    req = _export.logs_request(_export.make_resource({"service.name": "otel-gpu"}), [(
        H.STATE_CHANGE_EVENT.name, 1, {}, {"device_id": "gpu:GPU-1", "kind": "gpu", "host": "node3", "state": "drain",
                                           "since": time.time(), "time": time.time(), "evidence": ["xid 79"]},
        _export.ERROR)])
    exporter.export(Batch.from_message(Signal.LOGS, req))
    _deliver(exporter, _failure("j2", "f2", "node1", cause="rank_process_died", kind="crash"))
    client = VerdictClient(exporter.url, TOKEN)
    for host in ("node1", "node3", "node4"):
        client.register("j2", host, host, 2, 2, None)
    answer = client.propose("j2", 0, {"decision": "exclude_and_restart", "exclude_hosts": ["node3"],
                                      "failure_id": "f2", "by": "node1"})
    assert answer["decision"]["members"] == ["node1", "node4"] and answer["decision"]["joined"] == ["node4"]


def test_a_spare_with_a_drained_device_is_not_picked():
    board = JobBoard()
    for h in ("n0", "n1", "sick", "well"):
        board.register("j", h, h, nnodes=2)
    failures = {"f": _failure("j", "f", "n1")}
    d = board.propose("j", 0, {"decision": "exclude_and_restart", "exclude_hosts": ["n1"], "failure_id": "f",
                               "by": "n0"}, failures, drained_hosts=lambda: {"sick"})["decision"]
    assert d["members"] == ["n0", "well"] and d["joined"] == ["well"]


def test_after_the_aggregator_restarts_the_nodes_tell_the_board_where_the_job_is(monkeypatch):
    """The board lives in the aggregator's memory: a restarted aggregator knows no job. Each node's link registers
    again with its generation and role when the board answers 404, and the job's next decision is made as before."""
    cfg = build(VerdictExporterConfig, {"endpoint": "127.0.0.1:0", "auth": {"bearer_token": TOKEN}},
                "exporters.verdict")
    first = FACTORY.create(cfg, ComponentHost("verdict", _Telemetry()))
    first.start()
    port = first.port
    cmd = ["torchrun", "--nnodes", "2", "--rdzv-endpoint", "node0:29400", "-m", "train"]
    links = {}
    for h in ("node0", "node1", "node2"):
        monkeypatch.setenv("OTEL_GPU_RDZV_HOST", h)  # as each node would say (its own host name)
        links[h] = JobLink(VerdictClient(first.url, TOKEN), "j", h, cmd)
    assert [links[h].register() for h in ("node0", "node1", "node2")] == ["active", "active", "spare"]
    _deliver(first, _failure("j", "f1", "node0"))
    ours, made = links["node1"].propose({"decision": "exclude_and_restart", "exclude_hosts": ["node0"],
                                         "failure_id": "f1"})
    assert ours and made["members"] == ["node1", "node2"] and made["rdzv_host"] == "node1"
    for h in ("node1", "node2"):
        links[h].generation = made["next_generation"]
        links[h].refresh()
    first.shutdown()
    cfg2 = build(VerdictExporterConfig, {"endpoint": f"127.0.0.1:{port}", "auth": {"bearer_token": TOKEN}},
                 "exporters.verdict")
    second = FACTORY.create(cfg2, ComponentHost("verdict", _Telemetry()))
    second.start()
    try:
        # node2 (a member now) asks first: it must not become a spare, nor the job fall back to generation 0.
        state = links["node2"].refresh()
        assert state["generation"] == 1 and state["role"] == "active" and state["rdzv_host"] == "node1"
        assert links["node1"].refresh()["members"] == ["node2", "node1"]
        _deliver(second, _failure("j", "f2", "node2", cause="rank_process_died", kind="crash"))
        ours, made = links["node1"].propose({"decision": "restart", "failure_id": "f2"})
        assert ours and made["generation"] == 1 and made["next_generation"] == 2
    finally:
        second.shutdown()


def test_the_rendezvous_moves_when_its_owner_leaves_even_when_the_endpoint_is_an_address():
    """torchrun --rdzv-endpoint 10.0.0.5:29400: no node is called that, but the node whose address it is says so
    when it registers (is_this_machine); excluding that node moves the rendezvous."""
    board = JobBoard()
    board.register("j", "gpu-a", "gpu-a", nnodes=2, rdzv_endpoint_host="10.0.0.5", serves_rdzv=True)
    for h in ("gpu-b", "gpu-c"):
        board.register("j", h, h, nnodes=2, rdzv_endpoint_host="10.0.0.5")
    assert board.state("j")["rdzv_owner"] == "gpu-a"
    d = board.propose("j", 0, {"decision": "exclude_and_restart", "exclude_hosts": ["gpu-a"], "failure_id": "f",
                               "by": "gpu-b"}, {"f": _failure("j", "f", "gpu-a")})["decision"]
    assert d["rdzv_host"] == "gpu-b" and board.state("j")["rdzv_owner"] == "gpu-b"
    # A restart in place keeps it where it is.
    d = board.propose("j", 1, {"decision": "restart", "by": "gpu-c", "exit_status": 1})["decision"]
    assert d["rdzv_host"] == "gpu-b"


def test_an_address_is_this_machines_only_when_it_can_bind_to_it():
    import socket

    from otel_gpu.supervisor._job import is_this_machine

    assert not is_this_machine("127.0.0.1") and not is_this_machine("::1")  # every machine's loopback
    assert not is_this_machine("203.0.113.77")  # TEST-NET-3 (documentation range): nobody's here
    assert not is_this_machine("") and not is_this_machine(None)
    import shutil
    import subprocess

    if shutil.which("ip"):  # this machine's own non-loopback addresses, as the kernel lists them
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
        own = [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]
        for ip in [a for a in own if not a.startswith("127.")][:3]:
            assert is_this_machine(ip), ip
    assert socket.gethostname()  # the default rendezvous host (rdzv_host_of) is the kernel's name
