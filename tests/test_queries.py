"""docs/queries.md: every Tempo (TraceQL) and Jaeger query it gives names only span names, attributes and values the
schema defines, and the failure attributes they search are the ones the attribution processor puts on the spans it
exports (its own span-building code, fed a real failure record).
"""
from __future__ import annotations

import json
import re
import urllib.parse
from pathlib import Path

import pytest

from otel_gpu import schema
from otel_gpu.schema import failure as F
from otel_gpu.schema import identity as I

DOC = Path(__file__).resolve().parents[1] / "docs" / "queries.md"

_BLOCK = re.compile(r"```(traceql|jaeger|promql)\n(.*?)```", re.S)
# One TraceQL condition: scope.attribute op value, or an intrinsic (name, duration, status) op value.
_COND = re.compile(r'(?P<lhs>(?:span|resource)\.[A-Za-z0-9_.]+|name|duration|status)\s*'
                   r'(?P<op>=~|!=|>=|<=|=|>|<)\s*(?P<value>"[^"]*"|[0-9.]+[a-z]*|true|false|[a-z]+)')


def blocks(lang: str) -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    return [line.strip() for kind, body in _BLOCK.findall(text) if kind == lang
            for line in body.splitlines() if line.strip()]


def traceql_conditions(query: str) -> list[tuple[str, str, str]]:
    assert query.startswith("{") and query.endswith("}"), query
    inner = query[1:-1].strip()
    conds = [(m["lhs"], m["op"], m["value"]) for m in _COND.finditer(inner)]
    # Nothing but conditions joined with && may be left over: an unparsed fragment means a typo.
    rest = _COND.sub("", inner).replace("&&", "").strip()
    assert not rest, f"unparsed part {rest!r} in {query}"
    return conds


def jaeger_search(url: str) -> tuple[str, str, dict[str, str], dict[str, str]]:
    parsed = urllib.parse.urlsplit(url)
    assert parsed.path == "/api/traces", url
    params = dict(urllib.parse.parse_qsl(parsed.query))
    tags = json.loads(params.pop("tags", "{}"))
    return params.pop("service"), params.pop("operation", ""), tags, params


def attribute(name: str) -> schema.Attr:
    assert name in schema.REGISTRY.attributes, f"{name!r} is not an attribute of otel_gpu.schema"
    return schema.REGISTRY.attributes[name]


def check_value(attr: schema.Attr, op: str, raw: str, where: str) -> None:
    value = raw.strip('"')
    if attr.type == "int":
        assert re.fullmatch(r"-?\d+", value), f"{where}: {attr.name} is an int, compared with {raw}"
    elif attr.type == "double":
        float(value)
    elif attr.type == "bool":
        assert value in ("true", "false"), f"{where}: {attr.name} is a bool"
    else:
        assert raw.startswith('"'), f"{where}: {attr.name} is a string, compared with {raw}"
    if attr.values and op in ("=", "!="):
        assert value in attr.values, f"{where}: {value!r} is not a value of {attr.name} ({', '.join(attr.values)})"
    if attr.values and op == "=~":
        assert any(re.fullmatch(value, v) for v in attr.values), f"{where}: {value!r} matches no {attr.name} value"


def exported_failure_span_attributes() -> set[str]:
    """The attribute keys on the otel_gpu.failure span the attribution processor exports for a revised record whose
    culprit is fully known, built by the processor's own code."""
    pytest.importorskip("otel_gpu.processors.attribution")
    from otel_gpu.processors.attribution import _encode as attribution
    from otel_gpu.failure import Culprit, FailureRecord

    record = FailureRecord(kind=F.Kind.HANG, root_cause=F.RootCause.RANK_NOT_IN_COLLECTIVE, job_id="job-1",
                           onset_time=100.0, detected_time=109.0, confidence=0.9,
                           culprit=Culprit(rank=3, host="node-a", gpu=3), evidence=["progress seq=41 @105"],
                           details={"xid": 79})
    # A revision carries the revision-only attributes too (withdrawn, the root cause it replaced).
    record.version, record.withdrawn, record.previous_root_cause = 2, True, F.RootCause.UNKNOWN.value
    request = attribution.failure_spans(record)
    (span,) = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert span.name == F.FAILURE_SPAN.name
    tagged = {kv.key for kv in attribution.failure_kvs(record)}  # what step/collective spans get while it lasts
    assert tagged == {kv.key for kv in span.attributes}
    return {kv.key for kv in span.attributes}


def test_doc_has_queries_for_every_question():
    traceql, jaeger = blocks("traceql"), blocks("jaeger")
    assert len(traceql) >= 20 and len(jaeger) >= 12
    text = "\n".join(traceql + jaeger)
    for kind in F.Kind:
        assert f'span.failure.kind = "{kind.value}"' in text and f'"failure.kind":"{kind.value}"' in text
    for needle in ("span.failure.root_cause", "span.failure.culprit.rank", "span.failure.culprit.host",
                   "span.failure.culprit.gpu", "span.failure.category", '"failure.culprit.rank"',
                   '"failure.root_cause":"rank_not_in_collective"', '"failure.root_cause":"straggler_compute"',
                   'name = "otel_gpu.collective" && span.failure.kind = "hang"', "straggler_compute"):
        assert needle in text, needle


def test_traceql_queries_use_only_schema_names():
    span_names = set(schema.REGISTRY.spans)
    for query in blocks("traceql"):
        conds = traceql_conditions(query)
        assert conds, query
        span_name = next((v.strip('"') for lhs, op, v in conds if lhs == "name"), None)
        assert span_name in span_names, f"{query}: span {span_name!r} is not in the schema"
        span_def = schema.REGISTRY.spans[span_name]
        for lhs, op, value in conds:
            if lhs in ("name", "status"):
                continue
            if lhs == "duration":
                assert re.fullmatch(r"\d+(ms|s|m)", value), query
                continue
            scope, _, name = lhs.partition(".")
            attr = attribute(name)
            check_value(attr, op, value, query)
            if scope == "resource":
                assert attr.group == I._G, f"{query}: {name} is not a resource attribute"
            elif not name.startswith("failure."):
                assert attr in span_def.attributes, f"{query}: {span_name} spans do not carry {name}"


def test_jaeger_searches_use_only_schema_names():
    for url in blocks("jaeger"):
        service, operation, tags, rest = jaeger_search(url)
        assert service in ("otel-gpu", "otel-gpu-training"), url
        assert operation in schema.REGISTRY.spans, f"{url}: operation {operation!r} is not a schema span"
        assert set(rest) <= {"minDuration", "maxDuration", "limit", "lookback"}, url
        assert tags or rest, url
        span_def = schema.REGISTRY.spans[operation]
        for key, value in tags.items():
            attr = attribute(key)
            assert isinstance(value, str), f"{url}: Jaeger tag values are strings"
            check_value(attr, "=", value if attr.type in ("int", "double", "bool") else f'"{value}"', url)
            if not key.startswith("failure."):
                assert attr in span_def.attributes or attr.group == I._G, f"{url}: {operation} lacks {key}"
        # The failure span comes from the collector (service otel-gpu); the others from training processes.
        assert (service == "otel-gpu") == (operation == F.FAILURE_SPAN.name), url


def test_failure_attributes_in_queries_are_on_the_exported_spans():
    used = set()
    for query in blocks("traceql"):
        used |= {lhs.partition(".")[2] for lhs, _, _ in traceql_conditions(query) if lhs.startswith("span.failure.")}
    for url in blocks("jaeger"):
        used |= {k for k in jaeger_search(url)[2] if k.startswith("failure.")}
    assert len(used) >= 8
    declared = {str(a) for a in F.FAILURE_SPAN.attributes}
    assert used <= declared, f"not declared on otel_gpu.failure in the schema: {sorted(used - declared)}"
    exported = exported_failure_span_attributes()
    assert used <= exported, f"used by docs/queries.md but not exported: {sorted(used - exported)}"
    # The exported span carries every attribute the schema declares for it (the culprit is fully known here).
    assert declared <= exported, f"declared but not exported: {sorted(declared - exported)}"
    assert exported <= set(schema.REGISTRY.attributes), sorted(exported - set(schema.REGISTRY.attributes))


def test_the_checks_can_fail():
    with pytest.raises(AssertionError):
        attribute("failure.culprit_rank")
    with pytest.raises(AssertionError):
        check_value(F.KIND, "=", '"stuck"', "x")
    with pytest.raises(AssertionError):
        traceql_conditions('{ name = "otel_gpu.failure" || span.failure.kind = "hang" }')


# -- PromQL: metric names by the reference translation, labels from the schema -------------------------------------
_PROMQL_WORDS = {"sum", "avg", "max", "min", "count", "rate", "increase", "irate", "topk", "bottomk", "quantile",
                 "histogram_quantile", "max_over_time", "by", "without", "on", "ignoring", "group_left",
                 "group_right", "and", "or", "unless", "offset", "vector"}
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"([^"]*)"')


def promql_names(query: str) -> tuple[set[str], set[str], list[tuple[str, str]]]:
    """(metric names, label names, (label, value) matchers) of a PromQL query."""
    labels = {x.strip() for group in _LABEL_LISTS.findall(query) for x in group.split(",") if x.strip()}
    matchers = _MATCHER.findall(query)
    labels |= {name for name, _ in matchers}
    rest = _LABEL_LISTS.sub(" ", _MATCHER.sub(" ", query))
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # range selectors
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rest)) - _PROMQL_WORDS
    return words, labels, matchers


def _prometheus_names() -> set[str]:
    names = {"target_info"}
    for m in schema.REGISTRY.metrics.values():
        names.add(m.prometheus_name)
        if m.type is schema.MetricType.HISTOGRAM:
            names |= {m.prometheus_name + suffix for suffix in ("_bucket", "_count", "_sum")}
    return names


def test_promql_queries_use_schema_names_and_labels():
    from otel_gpu.schema.prom import sanitize

    queries = blocks("promql")
    assert len(queries) >= 10
    known_metrics = _prometheus_names()
    labels_of = {sanitize(a.name): a for a in schema.REGISTRY.attributes.values()}
    used_metrics = set()
    for query in queries:
        metrics, labels, matchers = promql_names(query)
        assert metrics, query
        assert metrics <= known_metrics, f"{query}: {sorted(metrics - known_metrics)} are not exported names"
        used_metrics |= metrics
        unknown = labels - set(labels_of) - {"le", "job", "instance"}
        assert not unknown, f"{query}: unknown labels {unknown}"
        for name, value in matchers:
            attr = labels_of[name]
            if attr.values and not re.search(r"[.*|]", value):
                assert value in attr.values, f"{query}: {value!r} is not a value of {attr.name}"
    assert "target_info" in used_metrics  # the resource join is shown


def test_promql_checks_can_fail():
    metrics, labels, _ = promql_names('sum by (host_name) (rate(hw_errors{hw_type="gpu"}[5m]))')
    assert metrics == {"hw_errors"} and "hw_errors" not in _prometheus_names()  # the counter is hw_errors_total
    assert labels == {"host_name", "hw_type"}
