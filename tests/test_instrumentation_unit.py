"""In-process pieces of the instrumentation: config precedence, exception hints, the ring buffer under overflow,
the generated wrappers, the OTLP client against a real sink and an absent one, the launcher's exit reasoning."""
from __future__ import annotations

import os
import socket
import time

import pytest

torch = pytest.importorskip("torch")

from otel_gpu.instrumentation import _export, _hot, _registry  # noqa: E402
from otel_gpu.instrumentation._crash import classify  # noqa: E402
from otel_gpu.instrumentation.config import InstrumentationConfig  # noqa: E402
from otel_gpu.instrumentation.launcher import ExitWatcher, launch_env  # noqa: E402
from otel_gpu.testing.otlp_sink import OtlpSink  # noqa: E402


def test_config_precedence_and_bad_values():
    env = {"OTEL_GPU_HEARTBEAT_S": "0.5", "OTEL_GPU_STACK_AFTER_S": "nope", "OTEL_SERVICE_NAME": "trainer",
           "OTEL_RESOURCE_ATTRIBUTES": "team=ml,cluster=a%2Cb", "OTEL_EXPORTER_OTLP_HEADERS": "x-token=abc"}
    cfg = InstrumentationConfig.from_env(env, heartbeat_s=3)
    assert cfg.heartbeat_s == 3  # argument wins
    assert cfg.stack_after_s == 10.0  # bad env value warns and falls back
    assert cfg.service_name == "trainer" and cfg.resource_attributes == {"team": "ml", "cluster": "a,b"}
    assert cfg.headers == {"x-token": "abc"}
    with pytest.raises(ValueError, match="heartbeat_s must be > 0"):
        InstrumentationConfig.from_env({}, heartbeat_s=-1)
    with pytest.raises(ValueError, match="unknown instrumentation option"):
        InstrumentationConfig.from_env({}, heartbeat=1)


@pytest.mark.parametrize("exc,hint", [
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "cuda_oom"),
    (RuntimeError("CUDA out of memory. Tried to allocate"), "cuda_oom"),
    (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"), "peer_failure"),
    (RuntimeError("Read error [127.0.0.1]:5: Connection reset by peer"), "peer_failure"),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"), "nccl_error"),
    (RuntimeError("[gloo] Timed out waiting 1800000ms for recv operation to complete"), "dist_timeout"),
    (RuntimeError("gloo: invalid argument"), "gloo_error"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "cuda_error"),
    (KeyboardInterrupt(), "keyboard_interrupt"),
    (ValueError("bad batch"), "user_code"),
])
def test_exception_hints(exc, hint):
    assert classify(exc) == hint


def _noop(tensor, op=None, group=None, async_op=False):
    return "done"


def test_generated_wrapper_keeps_the_signature_and_records_one_tuple():
    _hot.reset(16)
    wrapped = _hot.make_collective(_noop, "all_reduce", nbytes="tensor.nbytes", dtype="tensor.dtype")
    _hot.NS["_on"] = True
    try:
        g = object()
        t = torch.ones(4)
        assert wrapped(t, None, g) == "done" and wrapped(t, group=g, async_op=False) == "done"
        with pytest.raises(TypeError):
            wrapped(t, bogus=1)
        assert _hot.NS["_w"] == 2
        rec = _hot.NS["_buf"][1]
        assert rec[:4] == (_hot.COLL, "all_reduce", g, 2) and rec[6] == 16 and rec[7] == torch.float32
        assert _hot.NS["_cur"] is None and _hot.NS["_seq"][g] == 2
    finally:
        _hot.NS["_on"] = False


def test_ring_overflow_drops_and_counts_never_blocks():
    _hot.reset(16)
    wrapped = _hot.make_collective(_noop, "all_reduce", nbytes=None, dtype=None)
    _hot.NS["_on"] = True
    try:
        g = object()
        t0 = time.perf_counter()
        for _ in range(1000):
            wrapped(torch.ones(1), group=g)
        assert time.perf_counter() - t0 < 5
        assert _hot.NS["_w"] == 16 and _hot.NS["_drops"] == 1000 - 16
        assert _hot.NS["_seq"][g] == 1000  # the sequence keeps counting: seq stays torch's
    finally:
        _hot.NS["_on"] = False


def test_failed_collective_is_recorded_and_reraised():
    def boom(tensor, op=None, group=None, async_op=False):
        raise RuntimeError("Connection closed by peer")

    _hot.reset(16)
    wrapped = _hot.make_collective(boom, "all_reduce", nbytes=None, dtype=None)
    _hot.NS["_on"] = True
    try:
        with pytest.raises(RuntimeError, match="closed by peer"):
            wrapped(torch.ones(1), group=object())
        rec = _hot.NS["_buf"][0]
        assert rec[0] == _hot.COLL and rec[-1].startswith("RuntimeError: Connection closed")
        assert _hot.NS["_cur"] is None and not _hot.NS["_in"]
    finally:
        _hot.NS["_on"] = False


def test_otlp_client_sends_to_a_sink_and_gives_up_fast_without_one():
    res = _export.make_resource({"service.name": "t", "training.rank": 3})
    with OtlpSink() as sink:
        client = _export.OtlpClient(f"http://{sink.endpoint}", timeout_s=2)
        req, ss = _export.trace_request(res)
        _export.add_span(ss, "otel_gpu.step", b"\x01" * 16, b"\x02" * 8, None, 1, 2, {"training.step": 1})
        assert client.send_traces(req)
        assert client.send_logs(_export.logs_request(res, [("otel_gpu.progress", 5, {"training.step": 1},
                                                            {"state": "idle"}, _export.INFO)]))
        assert sink.span_count() == 1 and sink.log_records()[0].event_name == "otel_gpu.progress"
        client.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = _export.OtlpClient(f"127.0.0.1:{port}", timeout_s=1, buffer_mib=0)  # no buffer (tests/test_outage.py)
    t0 = time.monotonic()
    assert not client.send_traces(req)
    assert client.is_down() and not client.send_traces(req)  # backoff: dropped without trying
    assert time.monotonic() - t0 < 1.5
    assert client.failed == 1 and client.dropped_backoff == 1
    client.close()


def test_exit_watcher_names_signals_codes_and_vanished_processes(tmp_path):
    folder = str(tmp_path)
    dead = [os.fork() for _ in range(3)]
    for i, pid in enumerate(dead):
        if pid == 0:  # children: exit at once in three different ways
            os._exit(0 if i == 0 else 7) if i < 2 else os.kill(os.getpid(), 9)
    statuses = {pid: os.waitpid(pid, 0)[1] for pid in dead}
    for rank, pid in enumerate(dead):
        _registry.write_proc(folder, {"pid": pid, "role": "rank", "rank": rank})
    _registry.append_wait(folder, dead[1], statuses[dead[1]])
    _registry.append_wait(folder, dead[2], statuses[dead[2]])
    _registry.write_proc(folder, {"pid": os.getpid(), "role": "rank", "rank": 9})  # alive: not reported
    reports = {r["rank"]: r for r in ExitWatcher(folder, grace_s=0).scan()}
    assert set(reports) == {0, 1, 2}
    assert reports[0]["how"] == "vanished" and reports[0]["code"] is None  # nobody here reaped it with a record
    assert reports[1]["code"] == 7 and reports[1]["no_atexit"] is True
    assert reports[2]["signal"] == "SIGKILL" and reports[2]["how"] == "killed"


def test_launch_env_prepends_the_bootstrap_and_keeps_pythonpath():
    env = launch_env("/tmp/reg", "http://x:4317", "job-1", base={"PYTHONPATH": "/a:/b"})
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0].endswith("_bootstrap") and parts[1:] == ["/a", "/b"]
    assert env["OTEL_GPU_AUTO"] == "1" and env["OTEL_GPU_JOB_ID"] == "job-1"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://x:4317"


def test_otlp_client_http_protobuf_posts_to_v1_paths_with_headers():
    import http.server

    from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    got = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            msg = (trace_service_pb2.ExportTraceServiceRequest() if self.path == "/v1/traces"
                   else logs_service_pb2.ExportLogsServiceRequest())
            msg.ParseFromString(body)
            got.append((self.path, self.headers["Content-Type"], self.headers.get("x-token"), msg))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    import threading

    th = threading.Thread(target=server.serve_forever, daemon=True)
    th.start()
    try:
        client = _export.OtlpClient(f"http://127.0.0.1:{server.server_address[1]}", protocol="http/protobuf",
                                    headers={"x-token": "s3"}, timeout_s=2)
        res = _export.make_resource({"training.rank": 1})
        req, ss = _export.trace_request(res)
        _export.add_span(ss, "otel_gpu.collective", b"\x01" * 16, b"\x02" * 8, None, 1, 2, {"collective.seq": 4})
        assert client.send_traces(req)
        assert client.send_logs(_export.logs_request(res, [("otel_gpu.stacks", 1, {}, {"top": "x"}, _export.WARN)]))
    finally:
        server.shutdown()
    assert [(p, ct, tok) for p, ct, tok, _ in got] == [("/v1/traces", "application/x-protobuf", "s3"),
                                                        ("/v1/logs", "application/x-protobuf", "s3")]
    assert got[0][3].resource_spans[0].scope_spans[0].spans[0].name == "otel_gpu.collective"
    assert got[1][3].resource_logs[0].scope_logs[0].log_records[0].event_name == "otel_gpu.stacks"


def test_hand_encoded_spans_parse_as_otlp():
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    from otel_gpu.instrumentation import _pbenc

    res = _export.make_resource({"training.rank": 3})
    attrs = {"collective.op": "all_reduce", "collective.seq": 300000, "neg": -5, "ok": False, "d": 1.5,
             "l": ["a", "b"], "none": None, "big": 2**40}
    raw = [_pbenc.span("otel_gpu.collective", b"\x01" * 16, b"\x02" * 8, b"\x03" * 8, 5, 3, attrs, "Err: x"),
           _pbenc.span("otel_gpu.step", b"\x01" * 16, b"\x04" * 8, None, 7, 9, {"training.step": 2})]
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(
        _pbenc.trace_request(res.SerializeToString(), _export.SCOPE.SerializeToString(), raw))
    rs = req.resource_spans[0]
    assert rs.resource == res and rs.scope_spans[0].scope.name == "otel_gpu.instrumentation"
    a, b = rs.scope_spans[0].spans
    assert (a.name, a.kind, a.start_time_unix_nano, a.end_time_unix_nano) == ("otel_gpu.collective", 1, 5, 5)
    assert a.parent_span_id == b"\x03" * 8 and a.status.code == 2 and a.status.message == "Err: x"
    got = {kv.key: kv.value for kv in a.attributes}
    assert got["collective.op"].string_value == "all_reduce" and got["collective.seq"].int_value == 300000
    assert got["neg"].int_value == -5 and got["ok"].bool_value is False and got["d"].double_value == 1.5
    assert [v.string_value for v in got["l"].array_value.values] == ["a", "b"] and "none" not in got
    assert got["big"].int_value == 2**40
    assert b.parent_span_id == b"" and b.status.code == 0 and b.attributes[0].value.int_value == 2
