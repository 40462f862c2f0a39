"""Hand-written protobuf encoding of OTLP spans (opentelemetry/proto/trace/v1/trace.proto field numbers).

Building a Span message through the protobuf runtime costs ~55 us in Python here; writing the wire bytes directly,
with every repeating attribute (op, group, dtype, source, ...) encoded once and cached, costs a few us. The export
thread shares the training process's GIL, so this is what keeps exporting cheap. Tests parse the result with the
real protobuf classes.
"""
from __future__ import annotations

import struct

_pack_d = struct.Struct("<d").pack
_pack_q = struct.Struct("<Q").pack


def varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def any_value(value) -> bytes:
    if isinstance(value, bool):
        return b"\x10" + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + _pack_d(value)
    if isinstance(value, (list, tuple)):
        return _ld(5, b"".join(_ld(1, any_value(str(v))) for v in value))
    return _ld(1, str(value).encode())


def key_value(key: str, value) -> bytes:
    return _ld(1, key.encode()) + _ld(2, any_value(value))


_KV_CACHE: dict = {}
_NAMES: dict[str, bytes] = {}


def attribute(field: int, key: str, value) -> bytes:
    """``key=value`` as repeated KeyValue field ``field`` (9 on Span), cached for values that repeat."""
    cacheable = isinstance(value, (str, bool, float)) or (isinstance(value, int) and -1 <= value <= 64)
    if cacheable:
        ck = (field, key, type(value), value)
        hit = _KV_CACHE.get(ck)
        if hit is not None:
            return hit
    enc = _ld(field, key_value(key, value))
    if cacheable and len(_KV_CACHE) < 65536:
        _KV_CACHE[ck] = enc
    return enc


#: (attribute count limit, value length limit) of spans, from OTEL_SPAN_ATTRIBUTE_* / OTEL_ATTRIBUTE_*; None: no limits
#: (the default, and then the encoding costs what it did before limits existed).
LIMITS: tuple[int | None, int | None] | None = None


def limited(attrs: dict, limits: tuple[int | None, int | None]) -> dict:
    """``attrs`` within (count, value length) limits: strings (and strings in lists) cut, attributes past the count
    dropped, as the SDK's attribute limits do."""
    count, length = limits
    out = {}
    for k, v in attrs.items():
        if v is None:
            continue
        if count is not None and len(out) >= count:
            break
        if length is not None:
            if isinstance(v, str):
                v = v[:length]
            elif isinstance(v, (list, tuple)):
                v = [x[:length] if isinstance(x, str) else x for x in v]
        out[k] = v
    return out


def span(name: str, trace_id: bytes, span_id: bytes, parent_id: bytes | None, start_ns: int, end_ns: int,
         attrs: dict, error: str | None = None) -> bytes:
    parts = [b"\x0a\x10", trace_id, b"\x12\x08", span_id]
    if parent_id:
        parts.append(b"\x22\x08")
        parts.append(parent_id)
    enc_name = _NAMES.get(name)
    if enc_name is None:
        enc_name = _NAMES[name] = _ld(5, name.encode())
    parts.append(enc_name)
    parts.append(b"\x30\x01")  # kind = SPAN_KIND_INTERNAL
    parts.append(b"\x39" + _pack_q(start_ns))
    parts.append(b"\x41" + _pack_q(max(end_ns, start_ns)))
    if LIMITS is not None:
        attrs = limited(attrs, LIMITS)
    for k, v in attrs.items():
        if v is not None:
            parts.append(attribute(9, k, v))
    if error is not None:
        parts.append(_ld(15, _ld(2, error.encode()) + b"\x18\x02"))  # Status{message, code=ERROR}
    return b"".join(parts)


def trace_request(resource: bytes, scope: bytes, spans: list[bytes]) -> bytes:
    """ExportTraceServiceRequest{resource_spans: [{resource, scope_spans: [{scope, spans}]}]} as bytes.
    ``resource`` and ``scope`` are serialized Resource / InstrumentationScope messages."""
    scope_spans = _ld(1, scope) + b"".join(_ld(2, s) for s in spans)
    resource_spans = _ld(1, resource) + _ld(2, scope_spans)
    return _ld(1, resource_spans)
