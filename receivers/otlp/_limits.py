"""Per-request attribute bounds (``limits``): what one request can make the collector hold and walk.

A hostile sender's resource with a million attributes, or attribute values of megabytes, would be kept by every
cache and processor that keys on resources and served on every scrape; these bounds cut such a request at the door.
Attributes past ``max_attributes`` on a resource, a scope, an item (span, span event, span link, data point, log
record) are dropped; a string or bytes value longer than ``max_attribute_value_bytes`` is cut (a string at a UTF-8
character boundary); a list or map value is kept up to that many bytes of elements. Each cut counts 1.

The screen is cheap, since honest requests never need a cut: a message whose encoded size is within the value bound
holds no value over it, and ``len()`` of an attribute list is one C call. Only a message that fails the screen is
walked attribute by attribute.
"""
from __future__ import annotations

from typing import Any

from otel_gpu.pdata import Batch, Signal, data_points

__all__ = ["enforce"]


class _Cutter:
    __slots__ = ("batch", "max_n", "max_b", "cuts", "_mutable")

    def __init__(self, batch: Batch, max_n: int, max_b: int):
        self.batch, self.max_n, self.max_b = batch, max_n, max_b
        self.cuts = 0
        self._mutable = False

    def _mutate(self) -> None:
        if not self._mutable:
            self.batch.mutable()  # the same message object: only the cached wire bytes go
            self._mutable = True

    def attrs(self, owner: Any) -> None:
        """Bounds ``owner.attributes`` (owner: a resource, scope, span, point, record, ...)."""
        kvs = owner.attributes
        if len(kvs) > self.max_n:
            self._mutate()
            self.cuts += len(kvs) - self.max_n
            del kvs[self.max_n:]
        if owner.ByteSize() <= self.max_b:
            return
        for kv in kvs:
            if kv.ByteSize() > self.max_b:
                self.value(kv.value)

    def value(self, v: Any) -> None:
        kind = v.WhichOneof("value")
        limit = self.max_b
        if kind == "string_value":
            raw = v.string_value.encode("utf-8", "surrogatepass")
            if len(raw) > limit:
                self._mutate()
                v.string_value = raw[:limit].decode("utf-8", "ignore")
                self.cuts += 1
        elif kind == "bytes_value":
            if len(v.bytes_value) > limit:
                self._mutate()
                v.bytes_value = v.bytes_value[:limit]
                self.cuts += 1
        elif kind in ("array_value", "kvlist_value"):
            items = v.array_value.values if kind == "array_value" else v.kvlist_value.values
            total, keep = 0, 0
            for item in items:
                size = item.ByteSize()
                if total + size > limit:
                    if keep == 0 and size > 0:  # a first element alone over the bound: cut it, keep it
                        self.value(item if kind == "array_value" else item.value)
                        keep = 1
                    break
                total += size
                keep += 1
            if keep < len(items):
                self._mutate()
                del items[keep:]
                self.cuts += 1


def enforce(batch: Batch, max_attributes: int, max_value_bytes: int) -> int:
    """Applies the bounds to ``batch`` in place; returns the number of cuts (0: the batch and its wire bytes are as
    they came)."""
    cut = _Cutter(batch, max_attributes, max_value_bytes)
    message = batch.message
    resource_field, scope_field, item_field = batch.signal.fields
    metrics, traces = batch.signal is Signal.METRICS, batch.signal is Signal.TRACES
    for rs in getattr(message, resource_field):
        cut.attrs(rs.resource)
        for ss in getattr(rs, scope_field):
            cut.attrs(ss.scope)
            small = ss.ByteSize() <= max_value_bytes  # then only attribute counts can be over
            for item in getattr(ss, item_field):
                if metrics:
                    for point in data_points(item):
                        if len(point.attributes) > max_attributes or (not small and point.ByteSize() > max_value_bytes):
                            cut.attrs(point)
                    continue
                if len(item.attributes) > max_attributes or (not small and item.ByteSize() > max_value_bytes):
                    cut.attrs(item)
                if traces:
                    for sub in item.events:
                        if len(sub.attributes) > max_attributes or (not small and sub.ByteSize() > max_value_bytes):
                            cut.attrs(sub)
                    for sub in item.links:
                        if len(sub.attributes) > max_attributes or (not small and sub.ByteSize() > max_value_bytes):
                            cut.attrs(sub)
    return cut.cuts
