"""Slowdown detector: steps slower than the job's own baseline, and which rank's own work grew.

A step is closed once every rank reported it (or a later one). After ``slowdown_warmup_steps``, the first healthy
steps form the baseline (median and MAD of the job step time, each rank's compute and data time). A step is slow when
it exceeds max(ratio x baseline, baseline + min_excess, baseline + 6 MAD); ``slowdown_confirm`` slow steps among the
last ``slowdown_confirm + 1`` make a slowdown (named within about ten steps). The rank whose compute or data time grew
by more than half the excess and more than twice any other rank's growth is the culprit (``straggler_compute`` or
``dataloader_stall``); a hardware fault on its GPU or node that began in its window (a hardware thermal/power-brake/
slowdown clock event, NVLink or PCIe errors rising above background, NIC errors) explains it. A slowdown ends when the
last ``slowdown_confirm`` steps are fast again; a later one is a new record.

A blocking checkpoint save longer than ``checkpoint_stall_s`` and three times the rank's usual (for a rank's first
save: the job's other ranks' usual) is a ``checkpoint_stall`` slowdown (one record per save). The job's very first
save has nothing to compare with and is never a record: it is badput (goodput's checkpoint_save), not a failure.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

from otel_gpu.processors.attribution._observations import NodeStep, SpanSeen, StepSeen
from otel_gpu.processors.attribution._state import JobState, RankState
from otel_gpu.processors.attribution._types import Evidence, Finding
from otel_gpu.schema.failure import Action, Category, Kind, RootCause

if TYPE_CHECKING:
    from otel_gpu.processors.attribution._engine import Engine

__all__ = ["close_steps", "checkpoint_span", "evaluate"]


def compute_s(st: StepSeen) -> float | None:
    if st.collective_s is None:
        return None
    return max(0.0, st.duration - st.collective_s - (st.data_s or 0.0) - (st.checkpoint_s or 0.0))


def checkpoint_span(engine: Engine, job: JobState, rank: RankState, span: SpanSeen) -> Finding | None:
    duration = span.end - span.start
    usual = statistics.median(rank.checkpoints) if rank.checkpoints else None
    if usual is None:  # the rank's first save: compare with what the job's other ranks usually take
        others = [d for r in job.ranks.values() if r is not rank for d in r.checkpoints]
        usual = statistics.median(others) if others else None
    rank.note_checkpoint(duration)
    # With no save of the job to compare with, a long save is how this job checkpoints (a first 40 s save of a
    # big model is normal): badput, never a failure. A hung save is the hang detector's (checkpoint_timeout_s).
    if usual is None or duration <= engine.settings.checkpoint_stall_s or duration <= 3 * usual:
        return None
    ev = [Evidence("otel_gpu.checkpoint.save.duration_s", round(duration, 2), span.start)]
    if usual:
        ev.append(Evidence("usual_checkpoint_s", round(usual, 2)))
    return Finding(Kind.SLOWDOWN, RootCause.CHECKPOINT_STALL, span.start, 0.8, rank.rank, rank.who.host, None, ev,
                   f"a blocking checkpoint save on rank {rank.rank} took {duration:.1f} s",
                   {"reason": "checkpoint_save"})


def close_steps(engine: Engine, job: JobState, now: float) -> list[Finding]:
    """A step is closed once every rank reported it (or a later step arrived from every reporting rank)."""
    out: list[Finding] = []
    expected = job.world_size or len(job.ranks)
    for step in sorted(job.step_times):
        per_rank = job.step_times[step]
        newer = all(r.steps and r.steps[-1].step > step for r in job.ranks.values() if r.exit is None)
        if len(per_rank) < expected and not newer:
            break
        del job.step_times[step]
        job.last_step_closed = step
        finding = _evaluate_step(engine, job, step, per_rank, now)
        if finding is not None:
            out.append(finding)
    return out


def _evaluate_step(engine: Engine, job: JobState, step: int, per_rank: dict[int, StepSeen],
                   now: float) -> Finding | None:
    return evaluate(engine, job, step, max(x.duration for x in per_rank.values()), per_rank,
                    lambda: _learn_rank_baselines(job, per_rank))


def evaluate(engine: Engine, job: JobState, step: int, duration: float, detail: dict[int, StepSeen] | NodeStep,
             learn: Callable[[], None] | None) -> Finding | None:
    """One closed step of the job (``duration``: its slowest rank's), against the job's baseline. ``detail`` is what
    attribution reads if the step is part of a slowdown: every rank's StepSeen, or the node digests' summary
    (:class:`NodeStep`); ``learn`` teaches the ranks' baselines from a healthy step (None: the sidecars do)."""
    s = engine.settings
    job.step_done.append((step, duration))
    if len(job.step_done) <= s.slowdown_warmup_steps:
        return None
    if len(job.baseline) < 5:
        job.baseline.append(duration)
        if learn is not None:
            learn()
        return None
    base = statistics.median(job.baseline)
    mad = statistics.median(abs(d - base) for d in job.baseline)
    limit = max(base * s.slowdown_ratio, base + s.slowdown_min_excess_s, base + 6 * 1.4826 * mad)
    slow = duration > limit
    job.slow_flags.append(slow)
    if not slow:
        job.baseline.append(duration)
        if learn is not None:
            learn()
        if job.slowdown_active is not None and not any(list(job.slow_flags)[-s.slowdown_confirm:]):
            job.slowdown_active = None  # recovered: a later slowdown is a new record
            job.slow_steps.clear()
        if not job.slowdown_active:
            job.slow_steps.clear()
        return None
    job.slow_steps.append((step, detail))
    # Bounded: only the last slowdown_confirm + 2 are read (_attribute), and each holds one StepSeen per rank, so a
    # long slowdown of a 16k-rank job would otherwise grow without limit.
    del job.slow_steps[:-(s.slowdown_confirm + 2)]
    recent = list(job.slow_flags)[-(s.slowdown_confirm + 1):]
    if job.slowdown_active is None and sum(recent) >= s.slowdown_confirm and job.terminal is None:
        finding = _attribute(engine, job, base)
        job.slowdown_active = finding.cause
        return finding
    return None


def _learn_rank_baselines(job: JobState, per_rank: dict[int, StepSeen]) -> None:
    for rank_no, st in per_rank.items():
        rank = job.ranks.get(rank_no)
        if rank is None:
            continue
        rank.learn(compute_s(st), st.data_s)


def _attribute(engine: Engine, job: JobState, base: float) -> Finding:
    engine.sync(job)  # the culprit's identity and the device evidence read the rank states
    episode = job.slow_steps[-(engine.settings.slowdown_confirm + 2):]
    onset_step, first = episode[0]
    by_node = isinstance(first, NodeStep)
    if by_node:
        onset = first.start
        slow_duration = statistics.median(ns.duration for _, ns in episode)
    else:
        onset = min(x.start for x in first.values())
        slow_duration = statistics.median(max(x.duration for x in pr.values()) for _, pr in episode)
    ev = [Evidence("otel_gpu.step.duration", f"{slow_duration:.3f}s vs baseline {base:.3f}s", onset),
          Evidence("first_slow_step", onset_step)]
    excess = slow_duration - base
    culprit_rank, kind_of, grew = (_which_nodes if by_node else _which_ranks)(job, episode, base, excess)
    rank = job.ranks.get(culprit_rank) if culprit_rank is not None else None
    if rank is None and culprit_rank is not None:  # a rank the job no longer holds (restarted): no culprit
        culprit_rank, kind_of = None, None
    if culprit_rank is not None:
        ev.append(Evidence(f"rank{culprit_rank}.{kind_of}_s_increase", f"{grew:.3f}"))
    elif kind_of == "network":
        ev.append(Evidence("collective_s_increase_on_all_ranks", f"> {0.5 * excess:.3f}"))
    suspects = [culprit_rank] if culprit_rank is not None else sorted(job.ranks)
    head = f"steps take {slow_duration:.2f} s instead of {base:.2f} s"
    if kind_of in ("data", "data_all"):
        finding = Finding(Kind.SLOWDOWN, RootCause.DATALOADER_STALL, onset, 0.8, culprit_rank,
                          rank.who.host if rank else None, None, ev,
                          f"{head}: " + (f"rank {rank.rank} waits for data" if rank else "every rank waits for data"),
                          {"reason": "data"}, explainable_by=suspects)
    elif kind_of == "compute":
        finding = Finding(Kind.SLOWDOWN, RootCause.STRAGGLER_COMPUTE, onset, 0.8, rank.rank, rank.who.host, None, ev,
                          f"{head}: rank {rank.rank} computes slower than its peers, with no hardware signal",
                          {"reason": "compute"}, explainable_by=suspects, no_fault_clause=", with no hardware signal")
    elif kind_of == "network":
        # Every rank waits longer in its collectives and none computes or loads slower: the network between the
        # ranks (or the collective library) slowed. Which node's link it is cannot be told from collective timing (in
        # a ring every rank waits for the slowest link); a link or NIC fault on a node, if one began, refines it.
        finding = Finding(Kind.SLOWDOWN, RootCause.UNKNOWN, onset, 0.5, None, None, None, ev,
                          f"{head}: every rank spends longer in collectives while compute and data loading did not "
                          f"change: the network between the ranks is slower (no link or NIC error seen)",
                          {"reason": "network"}, category=Category.INFRASTRUCTURE, action=Action.INVESTIGATE,
                          explainable_by=suspects)
    else:
        finding = Finding(Kind.SLOWDOWN, RootCause.UNKNOWN, onset, 0.4, None, None, None, ev,
                          f"{head}; no rank, device or link stands out", {"reason": "unexplained"},
                          explainable_by=suspects)
    engine.explain(finding, job, throttle=True)
    return finding


def _which_ranks(job: JobState, episode: list, base: float, excess: float) -> tuple[int | None, str | None, float]:
    """(culprit rank, what grew, by how much) from every rank's steps of the episode."""
    growth: dict[int, tuple[float, float]] = {}
    for rank_no, rank in job.ranks.items():
        computes = [compute_s(pr[rank_no]) for _, pr in episode if rank_no in pr]
        datas = [pr[rank_no].data_s for _, pr in episode if rank_no in pr and pr[rank_no].data_s is not None]
        c_base = statistics.median(rank.compute_baseline) if rank.compute_baseline else None
        d_base = statistics.median(rank.data_baseline) if rank.data_baseline else None
        dc = statistics.median(computes) - c_base if computes and None not in computes and c_base is not None \
            else 0.0
        dd = statistics.median(datas) - d_base if datas and d_base is not None else 0.0
        growth[rank_no] = (dc, dd)
    return _decide(growth, None, excess, lambda: all(dd > 0.5 * excess for _, dd in growth.values()),
                   lambda: _collective_grew_everywhere(job, episode, base, excess))


def _which_nodes(job: JobState, episode: list, base: float, excess: float) -> tuple[int | None, str | None, float]:
    """The same from the node digests' step rows (:class:`NodeStep`): the ranks whose own time grew most on their
    node, each rank's least data growth, and each rank's collective time against its usual share. A rank missing
    from a step's kept ranks grew at most as much as the least kept one (its bound)."""
    steps: list[NodeStep] = [ns for _, ns in episode]
    growth: dict[int, tuple[float, float]] = {}
    for n in {t[1] for ns in steps for t in ns.top}:
        got = [ns.growth_of(n) for ns in steps]
        growth[n] = (statistics.median(g[0] for g in got), statistics.median(g[1] for g in got))
    rest = statistics.median(ns.bound for ns in steps) if len(job.ranks) > len(growth) else None
    data_mins = [ns.data_min for ns in steps]
    floors = [ns.floor for ns in steps]
    return _decide(growth, rest, excess,
                   lambda: None not in data_mins and statistics.median(data_mins) > 0.5 * excess,  # type: ignore
                   lambda: None not in floors and statistics.median(floors) - base > 0.5 * excess)  # type: ignore


def _decide(growth: dict[int, tuple[float, float]], rest: float | None, excess: float, data_all: Callable[[], bool],
            network: Callable[[], bool]) -> tuple[int | None, str | None, float]:
    """The rank whose compute or data time grew by more than half the excess and more than twice any other's (``rest``:
    what the ranks not in ``growth`` grew at most); else every rank waits for data; else the network."""
    if not growth:
        return None, None, 0.0
    rank_no, (dc, dd) = max(growth.items(), key=lambda kv: max(kv[1]))
    others = [max(g) for r, g in growth.items() if r != rank_no] + ([rest] if rest is not None else [])
    runner_up = max(others) if others else 0.0
    if max(dc, dd) > 0.5 * excess and max(dc, dd) > 2 * max(runner_up, 0.0) + 0.01:
        return rank_no, ("data" if dd > dc else "compute"), max(dc, dd)
    if data_all():
        return None, "data_all", 0.0
    if network():
        return None, "network", 0.0
    return None, None, 0.0


def _collective_grew_everywhere(job: JobState, episode: list, base: float, excess: float) -> bool:
    """Each rank's collective time in the slow steps grew by more than half the excess over its usual share of a
    step (the step baseline less its own compute and data baselines)."""
    if excess <= 0 or not job.ranks:
        return False
    for rank_no, rank in job.ranks.items():
        colls = [pr[rank_no].collective_s for _, pr in episode if rank_no in pr and pr[rank_no].collective_s is not None]
        if not colls or not rank.compute_baseline:
            return False
        usual = base - statistics.median(rank.compute_baseline) - (
            statistics.median(rank.data_baseline) if rank.data_baseline else 0.0)
        if statistics.median(colls) - max(usual, 0.0) <= 0.5 * excess:
            return False
    return True
