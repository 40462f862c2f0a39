"""The metrics a rank sends with every heartbeat: step duration (gauge), collective durations by op (cumulative
histogram of the collectives whose end is known) and records dropped (ring full, or spans not sent): what the
training dashboard plots.

Example:
    >>> req = metrics_request(None, step_s=0.5, started_ns=1, dropped=0, coll_hist={})
    >>> [m.name for m in req.resource_metrics[0].scope_metrics[0].metrics]
    ['otel_gpu.step.duration', 'otel_gpu.instrumentation.dropped']
"""
from __future__ import annotations

import time

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1 import metrics_pb2

from otel_gpu.instrumentation._spans import COLL_BOUNDS
from otel_gpu.schema import training as tr


def metrics_request(resource, step_s: float | None, started_ns: int, dropped: int,
                    coll_hist: dict[str, list]) -> ExportMetricsServiceRequest:
    """``step_s``: the latest step's duration (None: no step yet); ``coll_hist``: op -> [bucket counts, sum s,
    count] over ``COLL_BOUNDS`` since ``started_ns``; ``resource``: the rank's Resource (None: none)."""
    now = time.time_ns()
    req = ExportMetricsServiceRequest()
    rm = req.resource_metrics.add()
    if resource is not None:
        rm.resource.CopyFrom(resource)
    sm = rm.scope_metrics.add()
    sm.scope.name = "otel_gpu.instrumentation"
    if step_s is not None:
        m = sm.metrics.add(name=str(tr.STEP_DURATION), unit=tr.STEP_DURATION.unit,
                           description=tr.STEP_DURATION.description)
        m.gauge.data_points.add(time_unix_nano=now, as_double=float(step_s))
    m = sm.metrics.add(name=str(tr.INSTR_DROPPED), unit=tr.INSTR_DROPPED.unit,
                       description=tr.INSTR_DROPPED.description)
    m.sum.is_monotonic = True
    m.sum.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
    m.sum.data_points.add(start_time_unix_nano=started_ns, time_unix_nano=now, as_int=int(dropped))
    if coll_hist:
        m = sm.metrics.add(name=str(tr.COLLECTIVE_DURATION), unit=tr.COLLECTIVE_DURATION.unit,
                           description=tr.COLLECTIVE_DURATION.description)
        m.histogram.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
        for op, (counts, total, n) in coll_hist.items():
            p = m.histogram.data_points.add(start_time_unix_nano=started_ns, time_unix_nano=now, count=n,
                                            sum=total, explicit_bounds=COLL_BOUNDS, bucket_counts=counts)
            kv = p.attributes.add(key=str(tr.COLL_OP))
            kv.value.string_value = op
    return req
