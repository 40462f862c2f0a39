"""``otel-gpu report``: the failures the collector attributed, and goodput, read from the embedded store.

Reads the store read-only, so it works while a collector is writing to it.

Example:
    otel-gpu report                              # ./otel-gpu-data, text
    otel-gpu report --store /var/lib/otel-gpu --format json --job my-job --limit 10

    >>> import argparse, tempfile
    >>> from otel_gpu.exporters.store import db
    >>> folder = tempfile.mkdtemp(); db.open_writer(folder).close()
    >>> main(argparse.Namespace(store=folder, format="text", job=None, limit=50))
    no failures recorded
    goodput: no data
    0
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sqlite3
import sys
from typing import Any, TextIO

from otel_gpu.exporters.store import db

__all__ = ["build_report", "format_failure", "format_text", "main"]

_AT_TIME = re.compile(r"^(.*\S)\s+@(\d+(?:\.\d+)?)$")
_SUMMARY_KEYS = ("summary", "message", "description", "explanation", "title")


def job_timelines(store: str, job_ids: list[str]) -> list[Any]:
    """:class:`otel_gpu.commands.plot.JobTimeline` of each job, from its latest goodput summary (whose ``timeline``
    is the ledger's record of where each second went) and its failure records."""
    from otel_gpu.commands.plot import job_timeline

    conn = db.open_reader(store)
    try:
        conn.execute("BEGIN")
        out = [job_timeline(job, db.goodput(conn, job), db.failures(conn, job, None)) for job in job_ids]
        conn.execute("COMMIT")
    finally:
        conn.close()
    return out


def _without_timeline(summary: Any) -> Any:
    """A goodput summary for the report: its bins are for the picture (``--plot``), not for reading."""
    if isinstance(summary, dict) and "timeline" in summary:
        return {k: v for k, v in summary.items() if k != "timeline"}
    return summary


def build_report(store: str, job_id: str | None = None, limit: int | None = 50) -> dict[str, Any]:
    """The report as a JSON-ready dict: ``{"failures": [...], "goodput": {...} | None, "devices": [...],
    "jobs": [...]}``. ``devices``: the devices to drain, then to watch (``db.device_states``), with evidence and the
    failures (and jobs) they were the culprit of.

    Each failure is the latest version of its record; one with a ``failure_id`` carries ``versions``, every version
    received (oldest first, ``{"version", "received_time", "record"}``). A withdrawn verdict (a hang whose ranks
    resumed) is kept with ``status: withdrawn``.

    ``goodput`` is the selected job's latest summary, or (no job selected) the most recently updated job's.

    Raises:
        db.StoreMissing: no store at ``store``.
        db.StoreTooNew: written by a newer otel-gpu.
        sqlite3.Error: the file is not a readable store.
    """
    conn = db.open_reader(store)
    try:
        conn.execute("BEGIN")  # one snapshot for every query
        failures = db.failures(conn, job_id, limit, history=True)
        goodput = db.goodput(conn, job_id) if job_id is not None else db.latest_goodput(conn)
        jobs = db.jobs(conn, job_id)
        devices = db.device_states(conn, ("drain", "watch"))
        restarts = db.restarts(conn, job_id if job_id is not None else (goodput or {}).get("job_id"))
        conn.execute("COMMIT")
    finally:
        conn.close()
    from otel_gpu.commands.plot import one_line

    lines = {tl.job_id: one_line(tl) for tl in job_timelines(store, [j["job_id"] for j in jobs])}
    return {"failures": failures, "goodput": _without_timeline(goodput), "devices": devices, "restarts": restarts,
            "jobs": [{**{k: j[k] for k in ("job_id", "first_seen", "last_seen", "ranks", "hosts", "world_size")},
                      "goodput": _without_timeline(j["goodput"]), "timeline": lines.get(j["job_id"])} for j in jobs]}


# -- text ----------------------------------------------------------------------------------------------------------
def _time(t: Any) -> str:
    try:
        return datetime.datetime.fromtimestamp(float(t)).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    except (TypeError, ValueError, OverflowError, OSError):
        return "unknown time"


def _seconds(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _num(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _culprit(culprit: Any) -> str:
    if not isinstance(culprit, dict):
        return str(culprit) if culprit not in (None, "") else ""
    parts = []
    if culprit.get("rank") is not None:
        parts.append(f"rank {culprit['rank']}")
    if culprit.get("host"):
        parts.append(f"host {culprit['host']}")
    if culprit.get("gpu") not in (None, ""):
        parts.append(f"GPU {culprit['gpu']}")
    return ", ".join(parts)


def _summary(record: dict[str, Any]) -> str:
    for key in _SUMMARY_KEYS:
        if isinstance(record.get(key), str) and record[key].strip():
            return record[key].strip()
    who = _culprit(record.get("culprit"))
    cause = str(record.get("root_cause") or "unknown cause").replace("_", " ")
    if record.get("xid") is not None:
        cause += f" (XID {record['xid']})"
    return f"{cause} on {who}" if who else cause


def _evidence(item: Any, onset: float | None) -> str:
    if not isinstance(item, dict):
        match = _AT_TIME.match(str(item))  # the attribution processor's "signal=value @unix-seconds"
        if match is None:
            return str(item)
        t = float(match.group(2))
        when = f"at {t - onset:+.1f} s from onset" if onset is not None else f"at {_time(t)}"
        return f"{match.group(1)} {when}"
    name = item.get("metric") or item.get("signal") or item.get("name") or ""
    text = f"{name} = {item['value']}" if "value" in item else str(name)
    extra = {k: v for k, v in item.items() if k not in ("metric", "signal", "name", "value", "time")}
    if extra:
        text += " (" + ", ".join(f"{k} {v}" for k, v in extra.items()) + ")"
    t = _num(item.get("time"))
    if t is not None:
        text += f" at {t - onset:+.1f} s from onset" if onset is not None else f" at {_time(t)}"
    return text.strip() or json.dumps(item)


def _headline(record: dict[str, Any]) -> str:
    kind = str(record.get("kind") or "failure").upper()
    job = record.get("job_id") or "unknown job"
    cause = ", ".join(str(x) for x in (record.get("root_cause"), record.get("category")) if x)
    line = f"{kind} in job {job}: {_summary(record)}"
    if cause:
        line += f" ({cause})"
    if record.get("action"):
        line += f" -> action: {record['action']}"
    tail = []
    confidence = _num(record.get("confidence"))
    if confidence is not None:
        tail.append(f"confidence {confidence:.2g}")
    onset, detected = _num(record.get("onset_time")), _num(record.get("detected_time"))
    if onset is not None and detected is not None:
        tail.append(f"detected {_seconds(max(0.0, detected - onset))} after onset")
    return line + ("; " + "; ".join(tail) if tail else "")


def _verdict(record: dict[str, Any]) -> str:
    who = _culprit(record.get("culprit"))
    text = f"{record.get('kind') or '?'}/{record.get('root_cause') or '?'}"
    return f"{text} ({who})" if who else text


def _failure_lines(record: dict[str, Any]) -> list[str]:
    withdrawn = db.is_withdrawn(record)
    lines = [("WITHDRAWN " if withdrawn else "") + _headline(record)]
    versions = [v for v in record.get("versions") or () if isinstance(v, dict) and isinstance(v.get("record"), dict)]
    if withdrawn:
        summary = str(record.get("summary") or "")
        why = record.get("withdrawn_reason") or (summary.split(":", 1)[1].split(";")[0].strip()
                                                 if summary.startswith("withdrawn:") else "the verdict was taken back")
        lines.append(f"  status: withdrawn ({why}); not counted as a failure")
    if len(versions) > 1:
        steps = " -> ".join(f"v{v['version']} {_verdict(v['record'])}"
                            + (" withdrawn" if db.is_withdrawn(v["record"]) else "") for v in versions)
        lines.append(f"  revisions: {steps}")
    onset, detected = _num(record.get("onset_time")), _num(record.get("detected_time"))
    if detected is not None:
        lines.append(f"  detected: {_time(detected)}" + (f" (onset {_time(onset)})" if onset is not None else ""))
    who = _culprit(record.get("culprit"))
    lines.append(f"  culprit: {who or 'not identified'}")
    if record.get("auto_remediable") is not None:
        lines.append(f"  auto-remediable: {'yes' if record['auto_remediable'] else 'no'}")
    details = record.get("details")
    if isinstance(details, dict) and details:
        # Lists (e.g. every waiting rank of a hang) are for machines: --format json has them.
        lines.append("  details: " + ", ".join(f"{k} {v}" for k, v in details.items()
                                               if v not in (None, "") and not isinstance(v, (list, dict))))
    evidence = record.get("evidence") or []
    if isinstance(evidence, (str, dict)):
        evidence = [evidence]
    if evidence:
        lines.append("  evidence:")
        lines.extend(f"    - {_evidence(item, onset)}" for item in evidence)
    recurrence = record.get("recurrence")
    if isinstance(recurrence, (int, float)) and not isinstance(recurrence, bool):
        n = int(recurrence)
        seen = "first time seen" if n <= 0 else f"seen {n} time{'s' if n != 1 else ''} before"
        sig = f" (signature {record['signature']})" if record.get("signature") else ""
        lines.append(f"  recurrence: {seen}{sig}")
    return lines


def format_failure(record: dict[str, Any]) -> str:
    """One failure as ``otel-gpu report`` prints it (what ``otel-gpu run --restart`` prints when it stops)."""
    return "\n".join(_failure_lines(record)) + "\n"


def _restart_lines(decisions: list[dict[str, Any]]) -> list[str]:
    """The incarnations of a job on one timeline, from the decisions of ``otel-gpu run --restart``."""
    if not decisions:
        return []
    t0 = _num(decisions[0].get("incarnation_start")) or _num(decisions[0].get("time")) or 0.0
    lines = [f"incarnations (job {decisions[0].get('job_id')}, times from its first start):"]
    for d in decisions:
        start, end = _num(d.get("incarnation_start")), _num(d.get("incarnation_end"))
        span = f"{(start or t0) - t0:7.1f} s .. {(end or start or t0) - t0:7.1f} s" if start is not None else " " * 20
        what = d.get("root_cause") or ("completed" if d.get("decision") == "done" else "no verdict")
        line = f"  #{d.get('incarnation', '?')} {span}  exit {d.get('exit_status')}  {what}"
        if d.get("action"):
            line += f" -> {d['action']}"
        line += f" -> {d.get('decision')}"
        extras = []
        if d.get("backoff_s"):
            extras.append(f"backoff {_seconds(float(d['backoff_s']))}")
        if d.get("excluded"):
            extras.append(f"excluded {d['excluded']}")
        if _num(d.get("time_saved_s")):
            extras.append(f"saved {_seconds(float(d['time_saved_s']))} vs the backend timeout")
        if extras:
            line += " (" + ", ".join(extras) + ")"
        lines.append(line)
    return lines


def _goodput_lines(goodput: dict[str, Any] | None, title: str = "goodput") -> list[str]:
    if not goodput:
        return [f"{title}: no data"]
    ettr = _num(goodput.get("ettr"))
    head = f"{title} (job {goodput.get('job_id') or 'unknown'}): ETTR "
    head += f"{ettr * 100:.1f}%" if ettr is not None else "unknown"
    wall, productive = _num(goodput.get("wall_time_s")), _num(goodput.get("productive_time_s"))
    if wall is not None and productive is not None:
        head += f" (productive {_seconds(productive)} of {_seconds(wall)} wall time)"
    lines = [head]
    badput = goodput.get("badput_s") or {}
    buckets = sorted(((str(k), v) for k, v in badput.items() if _num(v)), key=lambda kv: -float(kv[1]))
    if buckets:
        lines.append("  badput:")
        width = max(len(k) for k, _ in buckets)
        for name, seconds in buckets:
            share = f"  {float(seconds) / wall * 100:5.1f}% of wall time" if wall else ""
            lines.append(f"    {name:<{width}}  {_seconds(float(seconds)):>9}{share}")
    return lines


def _device_lines(devices: list[dict[str, Any]]) -> list[str]:
    """The "devices to drain / to watch" section."""
    lines: list[str] = []
    for state, title in (("drain", "devices to drain"), ("watch", "devices to watch")):
        chosen = [d for d in devices if d.get("state") == state]
        if not chosen:
            continue
        lines.append(f"{title} ({len(chosen)}):")
        for d in chosen:
            who = d.get("device_id") or "?"
            extra = [f"GPU {d['gpu_index']}" if d.get("gpu_index") is not None else "", d.get("serial") or ""]
            where = f" on {d['host']}" if d.get("host") and d.get("kind") != "node" else ""
            tail = ", ".join(x for x in extra if x)
            score = _num(d.get("score"))
            lines.append(f"  {who}{where}{f' ({tail})' if tail else ''}: {state} since {_time(d.get('since'))}"
                         + (f", score {score:.0f}" if score is not None else ""))
            for item in (d.get("evidence") or [])[:6]:
                lines.append(f"    - {item}")
            failures = d.get("failures") or {}
            if failures.get("failures"):
                n, jobs = int(failures["failures"]), failures.get("jobs") or []
                lines.append(f"    culprit of {n} failure{'s' if n != 1 else ''} from {_time(failures.get('first'))} "
                             f"to {_time(failures.get('last'))}; jobs hurt: {', '.join(map(str, jobs)) or 'unknown'}")
    return lines


def format_text(report: dict[str, Any]) -> str:
    """What a person wants to read: each failure with its cause, culprit and evidence; then goodput and jobs."""
    lines: list[str] = []
    failures = report["failures"]
    if not failures:
        lines.append("no failures recorded")
    else:
        taken_back = sum(1 for f in failures if db.is_withdrawn(f))
        live = len(failures) - taken_back
        lines.append(f"{live} failure{'s' if live != 1 else ''} (newest first)"
                     + (f", {taken_back} withdrawn verdict{'s' if taken_back != 1 else ''}" if taken_back else ""))
        for record in failures:
            lines.append("")
            lines.extend(_failure_lines(record))
        lines.append("")
    lines.extend(_goodput_lines(report["goodput"]))
    incarnations = (report["goodput"] or {}).get("incarnations") or []
    if len(incarnations) > 1:
        lines.append("  per incarnation:")
        for inc in incarnations:
            b = inc.get("badput_s") or {}
            wall_s = _num(inc.get("wall_time_s")) or 0.0
            lines.append(f"    restart_count {inc.get('restart_count')}: wall {_seconds(wall_s)}, productive {_seconds(_num(inc.get('productive_time_s')) or 0)}, restart gap "
                         f"{_seconds(_num(b.get('restart_gap')) or 0)}, progress lost since the last checkpoint "
                         f"{_seconds(_num(b.get('wasted_progress')) or 0)}")
    restart_lines = _restart_lines(report.get("restarts") or [])
    if restart_lines:
        lines.append("")
        lines.extend(restart_lines)
    device_lines = _device_lines(report.get("devices") or [])
    if device_lines:
        lines.append("")
        lines.extend(device_lines)
    jobs = report["jobs"]
    if jobs:
        lines.append("")
        lines.append("jobs:")
        for job in jobs:
            world = f" of {job['world_size']}" if job.get("world_size") else ""
            ettr = _num((job.get("goodput") or {}).get("ettr"))
            where = []
            if job["ranks"]:
                where.append(f"{job['ranks']} rank{'s' if job['ranks'] != 1 else ''}{world}")
            if job["hosts"]:
                where.append(f"{job['hosts']} host{'s' if job['hosts'] != 1 else ''}")
            lines.append(f"  {job['job_id']}: {' on '.join(where) or 'no resource data'}, seen "
                         f"{_time(job['first_seen'])} to {_time(job['last_seen'])}"
                         + (f", ETTR {ettr * 100:.1f}%" if ettr is not None else ""))
            if job.get("timeline") and job["timeline"].strip("[ ]"):
                lines.append(f"    {job['timeline']}")
        if any(j.get("timeline") and j["timeline"].strip("[ ]") for j in jobs):
            from otel_gpu.commands.plot import legend_line

            lines.append(f"  timeline: {legend_line()}")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point of ``otel-gpu report``; returns the exit status (0 ok, 1 no readable store)."""
    out = out or sys.stdout
    err = err or sys.stderr
    store = getattr(args, "store", None) or "./otel-gpu-data"
    limit = getattr(args, "limit", 50)
    try:
        report = build_report(store, getattr(args, "job", None), None if limit is None or limit < 0 else limit)
    except db.StoreMissing as exc:
        print(f"otel-gpu report: {exc}", file=err)
        return 1
    except db.StoreTooNew as exc:
        print(f"otel-gpu report: {exc}", file=err)
        return 1
    except sqlite3.Error as exc:
        print(f"otel-gpu report: cannot read the store at {store}: {exc}", file=err)
        return 1
    if getattr(args, "format", "text") == "json":
        json.dump(report, out, indent=2, sort_keys=False)
        out.write("\n")
    else:
        out.write(format_text(report))
    plot = getattr(args, "plot", None)
    if plot:
        from otel_gpu.commands import plot as plotting

        jobs = [j["job_id"] for j in report["jobs"]][:_PLOT_JOBS]
        try:
            plotting.write(plot, job_timelines(store, jobs))
        except (OSError, ValueError, plotting.PlotUnavailable) as exc:
            print(f"otel-gpu report: cannot write the plot: {exc}", file=err)
            return 1
        print(f"goodput timeline of {len(jobs)} job{'s' if len(jobs) != 1 else ''} written to {plot}", file=err)
    return 0


_PLOT_JOBS = 20  # most recently active jobs drawn by --plot (select one with --job)
