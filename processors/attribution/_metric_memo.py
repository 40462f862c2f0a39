"""Unchanged node metrics are not decoded again (issue 20: the aggregator's cost per node).

A node's GPU and NIC metrics are the same every poll on a healthy node; the sidecar forwards them again every
``metrics_refresh`` all the same (an aggregator that restarted must learn them). Decoding one node's metrics costs
the aggregator about 3 ms (benchmarks/aggregator_scale.py), most of it the data points' attributes; at 16,384 nodes
the refreshes alone were 3 CPU s per second. An unchanged metric changes nothing in the device evidence but when the
device was last seen (counter series keep changes only, clock-event reasons and process maps are compared), so for a
metric whose points, timestamps aside, are those it had last time, :class:`MetricMemo` says so and the processor only
marks its node's devices as seen.

Example:
    >>> from opentelemetry.proto.metrics.v1 import metrics_pb2
    >>> memo, m = MetricMemo(), metrics_pb2.Metric(name="gpu.xid.errors")
    >>> p = m.sum.data_points.add(as_int=0, time_unix_nano=10**9)
    >>> memo.unchanged(1, m), memo.unchanged(1, m)
    (None, 1.0)
    >>> p.time_unix_nano = 2 * 10**9  # the next poll: only the time differs
    >>> memo.unchanged(1, m)
    2.0
    >>> p.as_int = 1  # a counter rose
    >>> memo.unchanged(1, m) is None
    True
"""
from __future__ import annotations

from otel_gpu.pdata import data_points

__all__ = ["MetricMemo"]

_ZERO = bytes(8)
_MAX = 400_000  # (resource, metric) pairs remembered: a node sends a dozen or two


class MetricMemo:
    """Per (resource, metric name): a fingerprint of the last points decoded, and the devices the resource names."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, str], int] = {}
        self._devices: dict[int, tuple[frozenset[str], frozenset[str]]] = {}

    def unchanged(self, resource_key: int, metric) -> float | None:
        """The metric's first point time (seconds; 0.0 when it has none) when its points are as last time; None
        otherwise (and it is remembered as the last)."""
        points = data_points(metric)
        first = points[0] if len(points) else None
        raw = metric.SerializeToString()  # metrics hold no maps: the encoding is deterministic as it is
        # Timestamps aside: a receiver stamps every point of a poll with the same time (and a cumulative sum with
        # the same start), so those eight bytes are masked in the encoding (fixed64, little-endian) rather than
        # cleared on a copy of the metric (a copy cost ~0.1 ms for a node's 128 points). Points with times of their
        # own still compare as changed: decoded again, never wrongly skipped.
        if first is not None:
            for t in (first.time_unix_nano, first.start_time_unix_nano):
                if t:
                    raw = raw.replace(t.to_bytes(8, "little"), _ZERO)
        fingerprint = hash(raw)
        key = (resource_key, metric.name)
        if self._seen.get(key) == fingerprint:
            return first.time_unix_nano / 1e9 if first is not None else 0.0
        if len(self._seen) >= _MAX:
            self._seen.clear()
        self._seen[key] = fingerprint
        return None

    def devices(self, resource_key: int) -> tuple[frozenset[str], frozenset[str]]:
        """(GPU keys, port keys) the resource's metrics named so far."""
        return self._devices.get(resource_key, (frozenset(), frozenset()))

    def learn(self, resource_key: int, gpus, ports) -> None:
        known = self._devices.get(resource_key)
        if known is None or not known[0].issuperset(gpus) or not known[1].issuperset(ports):
            if known is None and len(self._devices) >= _MAX:
                self._devices.clear()
            g, p = known or (frozenset(), frozenset())
            self._devices[resource_key] = (g | frozenset(gpus), p | frozenset(ports))
