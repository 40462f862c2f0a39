"""Failure records out: the attribution processor's encoder (a failure span, the stuck ranks' collective spans,
the failure event for the store and log backends, and the ``failure.*`` attributes a tagged span gets)."""
from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from otel_gpu.otlp_build import LogsBuilder, SpansBuilder, attributes, merge
from otel_gpu.failure import FailureRecord
from otel_gpu.schema import failure as F
from otel_gpu.schema import identity as I
from otel_gpu.schema import training as T

SCOPE = "otel_gpu.processors.attribution"  # the instrumentation scope of everything the processor emits


def failure_kvs(record: FailureRecord) -> list[KeyValue]:
    pairs: list[tuple[str, Any]] = [
        (F.KIND, record.kind.value), (F.ROOT_CAUSE, record.root_cause.value),
        (F.CATEGORY, record.category.value), (F.ACTION, record.action.value),
        (F.AUTO_REMEDIABLE, bool(record.auto_remediable)), (F.JOB_ID, record.job_id),
        (F.ONSET_TIME, float(record.onset_time)), (F.DETECTED_TIME, float(record.detected_time)),
        (F.CONFIDENCE, float(record.confidence)), (F.EVIDENCE, list(record.evidence)),
        (F.SIGNATURE, record.signature), (F.RECURRENCE, int(record.recurrence)),
        (F.FAILURE_ID, record.failure_id), (F.VERSION, int(record.version))]
    if record.withdrawn:
        pairs.append((F.WITHDRAWN, True))
    if record.previous_root_cause is not None:
        pairs.append((F.PREVIOUS_ROOT_CAUSE, record.previous_root_cause))
    if record.culprit.rank is not None:
        pairs.append((F.CULPRIT_RANK, int(record.culprit.rank)))
    if record.culprit.host is not None:
        pairs.append((F.CULPRIT_HOST, record.culprit.host))
    if record.culprit.gpu is not None:
        pairs.append((F.CULPRIT_GPU, str(record.culprit.gpu)))
    if record.details.get("xid") is not None:
        pairs.append((F.XID, int(record.details["xid"])))
    return attributes(dict(pairs))


def _resource(record: FailureRecord) -> dict[str, Any]:
    return {I.SERVICE_NAME: "otel-gpu", I.JOB_ID: record.job_id}


def failure_spans(record: FailureRecord) -> ExportTraceServiceRequest:
    sb = SpansBuilder(_resource(record), scope=SCOPE)
    sb.span(F.FAILURE_SPAN, int(record.onset_time * 1e9), int(max(record.detected_time, record.onset_time) * 1e9),
            failure_kvs(record), status=SpansBuilder.ERROR, status_message=record.summary[:500])
    return sb.build()


def stuck_spans(record: FailureRecord) -> ExportTraceServiceRequest:
    """One ``otel_gpu.collective`` span per rank that waits in the hung collective, from when it entered it to the
    detection, tagged with the failure: the collective never completes, so no other span would show it."""
    kvs = failure_kvs(record)
    requests = []
    for w in record.details.get("waiting", []):
        resource = {**_resource(record), I.RANK: int(w["rank"])}
        if w.get("host"):
            resource[I.HOST_NAME] = w["host"]
        sb = SpansBuilder(resource, scope=SCOPE)
        where = {str(key): value for key, value in ((T.COLL_OP, w.get("op")), (T.COLL_PG, w.get("pg")),
                                                    (T.COLL_SEQ, w.get("seq"))) if value is not None}
        sb.span(T.COLLECTIVE_SPAN, int(w["since"] * 1e9), int(max(record.detected_time, w["since"]) * 1e9), where,
                kvs, status=SpansBuilder.ERROR, status_message="stuck: " + record.summary[:400])
        requests.append(sb.build())
    return merge(requests) or ExportTraceServiceRequest()


def failure_logs(record: FailureRecord) -> ExportLogsServiceRequest:
    lb = LogsBuilder(_resource(record), scope=SCOPE)
    lb.event(F.FAILURE_EVENT, record.to_json(), failure_kvs(record), time_ns=int(record.detected_time * 1e9),
             severity=LogsBuilder.ERROR)
    return lb.build()

