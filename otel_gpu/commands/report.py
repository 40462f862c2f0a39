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
import json
import logging
import sqlite3
import sys
from typing import Any, TextIO

from otel_gpu.exporters.store import db
from otel_gpu.failure import (Revision, UnreadableRecord, failure_lines, finite, format_seconds, format_time,
                              from_json, printable, record_id)

__all__ = ["build_report", "format_text", "main"]

_logger = logging.getLogger(__name__)


def job_timelines(store: str, job_ids: list[str]) -> list[Any]:
    """:class:`otel_gpu.commands.plot.JobTimeline` of each job, from its latest goodput summary (whose ``timeline``
    is the ledger's record of where each second went) and its failure records (those that read: ``db.failures``
    leaves the others out)."""
    from otel_gpu.commands.plot import job_timeline

    conn = db.open_reader(store)
    try:
        conn.execute("BEGIN")
        out = [job_timeline(job, db.goodput(conn, job), db.failures(conn, job, None), db.restarts(conn, job))
               for job in job_ids]
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
    """The report as a JSON-ready dict: ``{"failures": [...], "unreadable": [...], "goodput": {...} | None,
    "devices": [...], "restarts": [...], "jobs": [...]}``. ``devices``: the devices to drain, then to watch
    (``db.device_states``), with evidence and the failures (and jobs) they were the culprit of.

    Each failure is the latest version of its record as stored (read with :func:`otel_gpu.failure.from_json`); one
    with a ``failure_id`` carries ``versions``, every version received (oldest first, ``{"version",
    "received_time", "record"}``). A withdrawn verdict (a hang whose ranks resumed) is kept with ``status:
    withdrawn``. A stored record that does not read is left out of ``failures`` and listed in ``unreadable``
    (``{"row_id", "id", "reason"}``): one bad record never hides the others.

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
        goodput = _summary_or_none(db.goodput(conn, job_id) if job_id is not None else db.latest_goodput(conn))
        jobs = db.jobs(conn, job_id)
        devices = db.device_states(conn, ("drain", "watch"))
        restarts = db.restarts(conn, job_id if job_id is not None else (goodput or {}).get("job_id"))
        conn.execute("COMMIT")
    finally:
        conn.close()
    lines: dict[str, Any] = {}
    try:
        from otel_gpu.commands.plot import one_line

        lines = {tl.job_id: one_line(tl) for tl in job_timelines(store, [j["job_id"] for j in jobs])}
    except sqlite3.Error:
        raise
    except Exception:  # a timeline that cannot be drawn leaves the rest of the report standing
        _logger.warning("otel-gpu report: cannot draw the job timelines; the report goes on without them",
                        exc_info=True)
    return {"failures": list(failures), "unreadable": [u.to_dict() for u in failures.unreadable],
            "goodput": _without_timeline(goodput), "devices": devices, "restarts": restarts,
            "jobs": [{**{k: j[k] for k in ("job_id", "first_seen", "last_seen", "ranks", "hosts", "world_size")},
                      "goodput": _without_timeline(j["goodput"]), "timeline": lines.get(j["job_id"])} for j in jobs]}


def _summary_or_none(summary: Any) -> dict[str, Any] | None:
    return summary if isinstance(summary, dict) else None


# -- text ----------------------------------------------------------------------------------------------------------
# Every string below that came from telemetry (job ids, hosts, device ids, decisions, evidence) goes through
# printable(); every number through finite(): a stranger's record prints as "unreadable", never as a traceback.
def _failure_text(entry: Any) -> list[str]:
    """One failure of the report (its stored JSON), read with from_json: its lines, or one "unreadable" line."""
    try:
        record = from_json(entry)
    except UnreadableRecord as exc:
        return [f"unreadable record {record_id(entry)}: {printable(str(exc))}"]
    versions = []
    for v in (entry.get("versions") or ()) if isinstance(entry.get("versions"), list) else ():
        if not isinstance(v, dict):
            continue
        try:
            versions.append(Revision(v.get("version"), v.get("received_time"), from_json(v.get("record"))))
        except UnreadableRecord as exc:
            versions.append(Revision(v.get("version"), v.get("received_time"), None, str(exc)))
    return failure_lines(record, versions)


def _restart_lines(decisions: list[dict[str, Any]]) -> list[str]:
    """The incarnations of a job on one timeline, from the decisions of ``otel-gpu run --restart``."""
    decisions = [d for d in decisions if isinstance(d, dict)]
    if not decisions:
        return []
    t0 = finite(decisions[0].get("incarnation_start")) or finite(decisions[0].get("time")) or 0.0
    lines = [f"incarnations (job {printable(decisions[0].get('job_id'))}, times from its first start):"]
    for d in decisions:
        start, end = finite(d.get("incarnation_start")), finite(d.get("incarnation_end"))
        span = f"{start - t0:7.1f} s .. {(end or start) - t0:7.1f} s" if start is not None else " " * 20
        what = d.get("root_cause") or ("completed" if d.get("decision") == "done" else "no verdict")
        line = (f"  #{printable(d.get('incarnation', '?'))} {span}  exit {printable(d.get('exit_status'))}  "
                f"{printable(what)}")
        if d.get("action"):
            line += f" -> {printable(d['action'])}"
        line += f" -> {printable(d.get('decision'))}"
        extras = []
        if finite(d.get("backoff_s")):
            extras.append(f"backoff {format_seconds(d['backoff_s'])}")
        elif d.get("backoff_s") not in (None, 0, 0.0):
            extras.append("backoff unreadable")
        if d.get("excluded"):
            extras.append(f"excluded {printable(d['excluded'])}")
        if isinstance(d.get("joined"), list) and d["joined"]:
            extras.append("spare " + ", ".join(printable(h) for h in d["joined"][:16]) + " joined")
        if isinstance(d.get("members"), list) and d["members"] and d.get("decision") in ("restart",
                                                                                          "exclude_and_restart"):
            extras.append("next on " + ", ".join(printable(h) for h in d["members"][:16]))
        if d.get("decided_by"):
            extras.append(f"decided by {printable(d['decided_by'])}")
        if finite(d.get("time_saved_s")):
            extras.append(f"saved {format_seconds(d['time_saved_s'])} vs "
                          + ("a blind restart" if d.get("exclude_hosts") else "the backend timeout"))
        if extras:
            line += " (" + ", ".join(extras) + ")"
        lines.append(line)
    return lines


def _goodput_lines(goodput: Any, title: str = "goodput") -> list[str]:
    if not isinstance(goodput, dict) or not goodput:
        return [f"{title}: no data"]
    ettr = finite(goodput.get("ettr"))
    head = f"{title} (job {printable(goodput.get('job_id') or 'unknown')}): ETTR "
    head += f"{ettr * 100:.1f}%" if ettr is not None else "unknown"
    wall, productive = finite(goodput.get("wall_time_s")), finite(goodput.get("productive_time_s"))
    if wall is not None and productive is not None:
        head += f" (productive {format_seconds(productive)} of {format_seconds(wall)} wall time)"
    lines = [head]
    badput = goodput.get("badput_s")
    badput = badput if isinstance(badput, dict) else {}
    buckets = sorted(((printable(k), finite(v)) for k, v in badput.items() if finite(v)), key=lambda kv: -kv[1])
    if buckets:
        lines.append("  badput:")
        width = min(40, max(len(k) for k, _ in buckets))
        for name, seconds in buckets:
            share = f"  {seconds / wall * 100:5.1f}% of wall time" if wall else ""
            lines.append(f"    {name:<{width}}  {format_seconds(seconds):>9}{share}")
    return lines


def _device_lines(devices: list[dict[str, Any]]) -> list[str]:
    """The "devices to drain / to watch" section."""
    lines: list[str] = []
    devices = [d for d in devices if isinstance(d, dict)]
    for state, title in (("drain", "devices to drain"), ("watch", "devices to watch")):
        chosen = [d for d in devices if d.get("state") == state]
        if not chosen:
            continue
        lines.append(f"{title} ({len(chosen)}):")
        for d in chosen:
            who = printable(d.get("device_id") or "?")
            extra = [f"GPU {printable(d['gpu_index'])}" if d.get("gpu_index") is not None else "",
                     printable(d.get("serial") or "")]
            where = f" on {printable(d['host'])}" if d.get("host") and d.get("kind") != "node" else ""
            tail = ", ".join(x for x in extra if x)
            score = finite(d.get("score"))
            lines.append(f"  {who}{where}{f' ({tail})' if tail else ''}: {state} since {format_time(d.get('since'))}"
                         + (f", score {score:.0f}" if score is not None else ""))
            evidence = d.get("evidence")
            for item in (evidence if isinstance(evidence, list) else [evidence] if evidence else [])[:6]:
                lines.append(f"    - {printable(item)}")
            failures = d.get("failures")
            failures = failures if isinstance(failures, dict) else {}
            n = finite(failures.get("failures"))
            if n:
                jobs = failures.get("jobs")
                jobs = jobs if isinstance(jobs, list) else []
                n = int(n)
                lines.append(f"    culprit of {n} failure{'s' if n != 1 else ''} from "
                             f"{format_time(failures.get('first'))} to {format_time(failures.get('last'))}; "
                             f"jobs hurt: {', '.join(printable(j) for j in jobs) or 'unknown'}")
    return lines


def _failure_section(report: dict[str, Any]) -> list[str]:
    failures = [f for f in report.get("failures") or () if isinstance(f, dict)]
    unreadable = [u for u in report.get("unreadable") or () if isinstance(u, dict)]
    blocks = [_failure_text(record) for record in failures]
    readable = [(record, block) for record, block in zip(failures, blocks) if not block[0].startswith("unreadable")]
    bad = len(blocks) - len(readable) + len(unreadable)
    if not failures and not unreadable:
        return ["no failures recorded"]
    taken_back = sum(1 for record, _ in readable if db.is_withdrawn(record))
    live = len(readable) - taken_back
    lines = [f"{live} failure{'s' if live != 1 else ''} (newest first)"
             + (f", {taken_back} withdrawn verdict{'s' if taken_back != 1 else ''}" if taken_back else "")
             + (f", {bad} unreadable record{'s' if bad != 1 else ''}" if bad else "")]
    for block in blocks:
        lines.append("")
        lines.extend(block)
    for u in unreadable:
        lines.append("")
        lines.append(f"unreadable record {printable(u.get('id') or u.get('row_id'))}: {printable(u.get('reason'))}")
    lines.append("")
    return lines


def _incarnation_lines(goodput: Any) -> list[str]:
    incarnations = goodput.get("incarnations") if isinstance(goodput, dict) else None
    incarnations = [i for i in incarnations if isinstance(i, dict)] if isinstance(incarnations, list) else []
    if len(incarnations) <= 1:
        return []
    lines = ["  per incarnation:"]
    for inc in incarnations:
        b = inc.get("badput_s") if isinstance(inc.get("badput_s"), dict) else {}
        lines.append(f"    restart_count {printable(inc.get('restart_count'))}: wall "
                     f"{format_seconds(finite(inc.get('wall_time_s')) or 0)}, productive "
                     f"{format_seconds(finite(inc.get('productive_time_s')) or 0)}, restart gap "
                     f"{format_seconds(finite(b.get('restart_gap')) or 0)}, progress lost since the last checkpoint "
                     f"{format_seconds(finite(b.get('wasted_progress')) or 0)}")
    return lines


def _job_lines(jobs: list[Any]) -> list[str]:
    jobs = [j for j in jobs if isinstance(j, dict)]
    if not jobs:
        return []
    lines = ["", "jobs:"]
    for job in jobs:
        ranks, hosts = finite(job.get("ranks")), finite(job.get("hosts"))
        world = f" of {printable(job['world_size'])}" if job.get("world_size") else ""
        goodput = job.get("goodput")
        ettr = finite(goodput.get("ettr")) if isinstance(goodput, dict) else None
        where = []
        if ranks:
            where.append(f"{int(ranks)} rank{'s' if ranks != 1 else ''}{world}")
        if hosts:
            where.append(f"{int(hosts)} host{'s' if hosts != 1 else ''}")
        lines.append(f"  {printable(job.get('job_id'))}: {' on '.join(where) or 'no resource data'}, seen "
                     f"{format_time(job.get('first_seen'))} to {format_time(job.get('last_seen'))}"
                     + (f", ETTR {ettr * 100:.1f}%" if ettr is not None else ""))
        timeline = job.get("timeline")
        if isinstance(timeline, str) and timeline.strip("[ ]"):
            lines.append(f"    {printable(timeline)}")
    if any(isinstance(j.get("timeline"), str) and j["timeline"].strip("[ ]") for j in jobs):
        from otel_gpu.commands.plot import legend_line

        lines.append(f"  timeline: {legend_line()}")
    return lines


def _section(name: str, make, *args: Any) -> list[str]:
    """A section's lines; one its formatter cannot make (a case no check foresaw) prints as unreadable, alone."""
    try:
        return make(*args)
    except Exception as exc:  # one bad section never takes the report down
        _logger.debug("report section %s", name, exc_info=True)
        return [f"{name}: unreadable ({type(exc).__name__})"]


def format_text(report: dict[str, Any]) -> str:
    """What a person wants to read: each failure with its cause, culprit and evidence; then goodput and jobs.
    Total: every record read with from_json (one that does not read prints as "unreadable record <id>: <reason>"),
    every string from telemetry through printable()."""
    lines: list[str] = []
    lines.extend(_section("failures", _failure_section, report))
    lines.extend(_section("goodput", _goodput_lines, report.get("goodput")))
    lines.extend(_section("per incarnation", _incarnation_lines, report.get("goodput")))
    restart_lines = _section("incarnations", _restart_lines, report.get("restarts") or [])
    if restart_lines:
        lines.append("")
        lines.extend(restart_lines)
    device_lines = _section("devices", _device_lines, report.get("devices") or [])
    if device_lines:
        lines.append("")
        lines.extend(device_lines)
    lines.extend(_section("jobs", _job_lines, report.get("jobs") or []))
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point of ``otel-gpu report``; returns the exit status (0 ok, 1 no readable store)."""
    out = out or sys.stdout
    err = err or sys.stderr
    store = getattr(args, "store", None) or "./otel-gpu-data"
    limit = getattr(args, "limit", 50)
    try:
        report = build_report(store, getattr(args, "job", None), None if limit is None or limit < 0 else limit)
    except (db.StoreMissing, db.StoreTooNew) as exc:
        print(f"otel-gpu report: {printable(exc)}", file=err)
        return 1
    except sqlite3.Error as exc:
        print(f"otel-gpu report: cannot read the store at {printable(store)}: {printable(exc)}", file=err)
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
        except Exception as exc:  # noqa: BLE001 - the text above stands; the plot alone failed (PlotUnavailable too)
            print(f"otel-gpu report: cannot write the plot: {printable(exc)}", file=err)
            return 1
        print(f"goodput timeline of {len(jobs)} job{'s' if len(jobs) != 1 else ''} written to {printable(plot)}",
              file=err)
    return 0


_PLOT_JOBS = 20  # most recently active jobs drawn by --plot (select one with --job)
