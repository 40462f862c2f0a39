"""The instrumentation's parts alone: span assembly, the failed-collective slot, the watchdog's stall decision; and
its shape: no import cycle among its modules, each importable alone, every environment variable read through the
config table."""
from __future__ import annotations

import ast
import collections
import subprocess
import sys
from pathlib import Path

import pytest

from otel_gpu.instrumentation import _hot, _watchdog
from otel_gpu.instrumentation._crash import CrashHooks
from otel_gpu.instrumentation._hot import COLL, DATA, STEP, WAIT
from otel_gpu.instrumentation._spans import SpanAssembler
from otel_gpu.instrumentation.config import VARIABLES, env
from otel_gpu.schema import training as tr

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "otel_gpu" / "instrumentation"
PREFIX = "otel_gpu.instrumentation"
S = 1_000_000_000


class _Group:
    """A process group with a name and a size."""

    def __init__(self, name: str, size: int = 2):
        self.name, self._size = name, size

    def size(self) -> int:
        return self._size


def _assembler(*groups: _Group) -> SpanAssembler:
    """An assembler that knows ``groups`` by name (torch, when imported, would not name a fake group)."""
    spans = SpanAssembler(collections.Counter())
    for g in groups:
        spans.pg_info[id(g)] = (g, g.name, g.size())
    return spans


def _by_name(spans: list) -> dict[str, list]:
    out: dict[str, list] = collections.defaultdict(list)
    for sp in spans:
        out[sp[0]].append(sp)
    return out


# -- span assembly ---------------------------------------------------------------------------------------------------
def test_a_step_gets_its_collective_and_data_time_and_children_share_its_trace():
    g = _Group("0")
    spans = _assembler(g)
    counters = spans.counters
    records = [(DATA, 0, 1 * S, 1, None),
               (COLL, "all_reduce", g, 1, 2 * S, 3 * S, 64, "torch.float32", False, None, 1, None),
               (COLL, "all_reduce", g, 2, 3 * S, 4 * S, 64, "torch.float32", False, None, 1, "RuntimeError: x"),
               (STEP, 1, 0, 5 * S, None)]
    out = spans.assemble(records, [], drain_ns=6 * S, final=False, cur=None)
    out = spans.hold_steps(out, final=False, fr_last_read_ns=0)
    spans.add_step_breakdown(out)
    named = _by_name(out)
    coll = named[str(tr.COLLECTIVE_SPAN)]
    assert [c[4][str(tr.COLL_SEQ)] for c in coll] == [1, 2] and coll[1][5] == "RuntimeError: x"
    assert coll[0][4][str(tr.COLL_DTYPE)] == "float32" and coll[0][4][str(tr.COLL_PG)] == "0"
    assert coll[0][4][str(tr.COLL_PG_SIZE)] == 2 and coll[0][4][str(tr.COLL_SOURCE)] == "python"
    step = named[str(tr.STEP_SPAN)][0][4]
    assert step[str(tr.STEP_COLLECTIVE_S)] == 2.0 and step[str(tr.STEP_DATA_S)] == 1.0
    assert counters["collectives"] == 2 and counters["steps"] == 1
    assert sum(spans.coll_hist["all_reduce"][0]) == 2  # both ended: histogram counts them

    reqs = list(spans.requests(out, b"", b"", "job", 0, 123))
    assert len(reqs) == 1 and reqs[0][1] == len(out)
    tid, sid = spans.trace_ids(1, "job", 0, 123)
    assert tid == spans.trace_ids(1, "job", 1, 456)[0] and sid != spans.trace_ids(1, "job", 1, 456)[1]


def test_an_async_collective_ends_at_its_wait_and_the_recorder_only_ops_shift_the_seq():
    g = _Group("0")
    spans = _assembler(g)
    counters = spans.counters
    issued = (COLL, "all_reduce", g, 1, 1 * S, 2 * S, 8, None, True, None, 1, None)
    assert spans.assemble([issued], [], drain_ns=3 * S, final=False, cur=None) == []  # waits for Work.wait
    cpp = {"process_group": ["0"], "time_created_ns": 5 * S, "collective_seq_id": 2,
           "profiling_name": "gloo:allreduce"}
    waited = (WAIT, "all_reduce", g, 1, 4 * S, 6 * S, 1 * S, 1, None)
    out = spans.assemble([waited], [cpp], drain_ns=7 * S, final=False, cur=None)
    named = _by_name(out)
    coll = named[str(tr.COLLECTIVE_SPAN)]
    python = [c for c in coll if c[4][str(tr.COLL_SOURCE)] == "python"][0]
    assert (python[2], python[3]) == (1 * S, 6 * S)  # issue to the end of its wait
    assert named[str(tr.WAIT_SPAN)][0][4][str(tr.COLL_SEQ)] == 1
    # the recorder saw a collective no Python call made (DDP's bucket): its own span, and later Python seqs shift
    fr = [c for c in coll if c[4][str(tr.COLL_SOURCE)] == "flight_recorder"][0]
    assert fr[4][str(tr.COLL_OP)] == "allreduce" and fr[4][str(tr.COLL_DURATION_KNOWN)] is False
    assert spans.cpp_count == {"0": 1} and counters["fr_collectives"] == 1
    assert spans.torch_seq(g, 2) == 3 and spans.torch_seq(g, -4) == 4


def test_a_recorder_entry_of_a_python_call_in_flight_waits_for_the_next_cycle():
    g = _Group("0")
    spans = _assembler(g)
    entry = {"process_group": ["0"], "time_created_ns": 2 * S, "collective_seq_id": 1, "profiling_name": "x"}
    cur = ("all_reduce", g, 1, 1 * S, "collective")
    assert spans.assemble([], [entry], drain_ns=3 * S, final=False, cur=cur) == []
    assert spans.fr_hold == [entry] and spans.cpp_count == {}


# -- the failed-collective slot --------------------------------------------------------------------------------------
def test_the_failed_collective_slot_names_the_op_and_torch_s_seq():
    def boom(tensor, op=None, group=None, async_op=False):
        raise RuntimeError("Connection closed by peer")

    _hot.reset(16)
    assert _hot.NS.get("_failed") is None
    g = _Group("7")
    wrapped = _hot.make_collective(boom, "all_reduce", nbytes=None, dtype=None)
    _hot.NS["_on"] = True
    try:
        with pytest.raises(RuntimeError):
            wrapped(object(), group=g)
    finally:
        _hot.NS["_on"] = False
    assert _hot.NS["_failed"] == ("all_reduce", g, 1, "RuntimeError: Connection closed by peer")

    class _Rt:
        spans = _assembler(g)

    _Rt.spans.cpp_count["7"] = 4  # four C++-issued collectives before it: torch's seq is 5
    assert CrashHooks(_Rt()).failed_collective() == {"op": "all_reduce", "pg": "7", "seq": 5,
                                                     "error": "RuntimeError: Connection closed by peer"}
    _hot.reset(16)
    assert CrashHooks(_Rt()).failed_collective() is None


# -- the watchdog's stall decision -----------------------------------------------------------------------------------
def test_no_progress_counts_from_the_newest_record_or_the_in_flight_start():
    clock = _watchdog.ProgressClock(now_ns=0, starting=False)
    assert clock.observe((3, None), 2 * S, None, now_ns=5 * S) == 3.0
    assert clock.observe((3, None), None, None, now_ns=9 * S) == 7.0  # nothing new: the stall grows
    cur = ("all_reduce", None, 4, 8 * S, "collective")
    assert clock.observe((3, 8 * S), 2 * S, cur, now_ns=10 * S) == 2.0  # a collective started at 8 s


def test_starting_up_is_not_a_stall_until_the_group_exists():
    clock = _watchdog.ProgressClock(now_ns=0, starting=True)
    assert clock.observe((0, None), None, None, now_ns=100 * S) == 0.0
    clock.group_created(now_ns=100 * S, step_t0_ns=None)
    assert clock.observe((0, None), None, None, now_ns=104 * S) == 4.0
    clock.starting = True  # init_process_group again (a re-formed group)
    assert clock.observe((0, None), None, None, now_ns=200 * S) == 0.0


def test_the_stack_threshold_follows_slow_steps_within_bounds():
    assert _watchdog.stack_threshold_s(10.0, []) == 10.0
    assert _watchdog.stack_threshold_s(10.0, [1.0, 2.0]) == 10.0
    assert _watchdog.stack_threshold_s(10.0, [1.0, 8.0]) == 24.0
    assert _watchdog.stack_threshold_s(10.0, [100.0]) == 60.0


# -- shape: imports and environment ----------------------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.glob("*.py")):
        out[PREFIX if path.stem == "__init__" else f"{PREFIX}.{path.stem}"] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The instrumentation modules that ``path`` imports, at any depth (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n in modules)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_instrumentation_modules_import_each_other_without_a_cycle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert f"{PREFIX}._runtime" not in graph[f"{PREFIX}._hot"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check catches one


def test_each_module_imports_alone_in_a_fresh_interpreter():
    code = "import importlib, sys; importlib.import_module(sys.argv[1])"
    for name in _modules():
        proc = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{name}:\n{proc.stderr[-2000:]}"


def _environ_uses(path: Path) -> list[str]:
    """``os.environ`` / ``os.getenv`` / ``os.putenv`` uses, as file:line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                and node.attr in ("environ", "getenv", "putenv", "unsetenv", "environb")):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_every_environment_variable_is_read_through_the_config_table():
    # sitecustomize runs at interpreter start-up, before it may import anything: it reads OTEL_GPU_AUTO and
    # OTEL_GPU_REGISTRY itself (both are in the table). The launcher (``otel-gpu run``) copies its whole environment
    # into the ranks', and jobid reads the schedulers' own variables (Slurm, Kubernetes, torchrun) from a mapping it is
    # given: neither reads a setting of ours.
    files = [p for p in PKG.rglob("*.py") if p.name not in ("config.py", "sitecustomize.py", "launcher.py", "jobid.py")]
    files.append(ROOT / "otel_gpu" / "auto.py")
    uses = [u for p in files for u in _environ_uses(p)]
    assert not uses, "read these through otel_gpu.instrumentation.config.env (and list them in VARIABLES): " + \
        ", ".join(uses)
    assert {"OTEL_GPU_AUTO", "OTEL_GPU_REGISTRY"} <= set(VARIABLES)
    with pytest.raises(KeyError, match="VARIABLES"):
        env("OTEL_GPU_NOT_A_SETTING")


def test_the_variables_that_config_py_names_are_in_its_table():
    """Every upper-case string literal in config.py that looks like a variable (OTEL_/TORCH_...) is listed."""
    text = (PKG / "config.py").read_text(encoding="utf-8")
    tree = ast.parse(text)
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and n.value.isupper() and n.value.startswith(("OTEL_", "TORCH_", "GRPC_")) and not n.value.endswith("_")}
    assert named - set(VARIABLES) == set()


# -- the heartbeat's metrics -----------------------------------------------------------------------------------------
def test_the_metrics_carry_the_latest_step_the_drops_and_the_collective_histogram():
    from otel_gpu.instrumentation._metrics import metrics_request

    g = _Group("0")
    spans = _assembler(g)
    rec = (COLL, "all_reduce", g, 1, 0, S // 100, 8, None, False, None, 1, None)  # 10 ms
    spans.add_step_breakdown(spans.assemble([rec], [], drain_ns=S, final=True, cur=None))
    req = metrics_request(None, step_s=0.25, started_ns=7, dropped=3, coll_hist=spans.coll_hist)
    metrics = {m.name: m for m in req.resource_metrics[0].scope_metrics[0].metrics}
    assert metrics[str(tr.STEP_DURATION)].gauge.data_points[0].as_double == 0.25
    assert metrics[str(tr.INSTR_DROPPED)].sum.data_points[0].as_int == 3
    point = metrics[str(tr.COLLECTIVE_DURATION)].histogram.data_points[0]
    assert point.count == 1 and point.start_time_unix_nano == 7 and point.attributes[0].value.string_value == \
        "all_reduce"
    assert list(point.bucket_counts).index(1) == list(point.explicit_bounds).index(0.01)  # (5 ms, 10 ms]
