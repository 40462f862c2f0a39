"""The slowdown detector on synthetic steps: which rank's own work grew, and a hardware throttle only when it began
around the first slow step (never the power cap a busy GPU always has, never a flag active since before the job);
late device evidence revises the verdict."""
from __future__ import annotations

import random

import pytest

from attribution_synth import T0, Cluster, latest
from otel_gpu.processors.attribution._observations import StepSeen


def _run(c: Cluster, culprit: int, *, onset_step: int = 20, steps: int = 45, thermal_at: float | None = None,
         thermal_from_start: bool = False):
    t, found, onset_t = T0, [], None
    c.history(T0 - 300, T0, clock={c.uuid(culprit): frozenset({"sw_power_cap", "hw_thermal_slowdown"})}
              if thermal_from_start else None)
    for step in range(steps):
        slow = step >= onset_step
        if slow and onset_t is None:
            onset_t = t
        hot = thermal_from_start or (thermal_at is not None and onset_t is not None and t >= onset_t + thermal_at)
        clock = {c.uuid(culprit): frozenset({"sw_power_cap", "hw_thermal_slowdown"} if hot else {"sw_power_cap"})}
        c.devices(t, clock=clock)
        d = 0.3 if slow else 0.1
        for r in range(c.world):
            coll = (0.22 if slow else 0.03) if r != culprit else 0.02
            c.engine.observe_step(StepSeen(c.who(r), step, t, t + d, coll, 0.0), t + d)
        t += d
        found += [(step, r) for r in c.engine.tick(t)]
    for extra in range(40):  # time passes after the last step (late device samples arrive)
        t += 0.5
        c.devices(t, clock={c.uuid(culprit): frozenset({"sw_power_cap", "hw_thermal_slowdown"} if (
            thermal_from_start or thermal_at is not None) else {"sw_power_cap"})})
        found += [(steps, r) for r in c.engine.tick(t)]
    return found, onset_step


@pytest.mark.parametrize("seed", range(4))
def test_a_straggler_on_a_power_capped_gpu_is_a_compute_straggler(seed):
    c = Cluster(world=4)
    culprit = random.Random(seed).randrange(4)
    found, onset = _run(c, culprit)
    (step, rec), = found
    assert (rec.root_cause.value, rec.culprit.rank) == ("straggler_compute", culprit)
    assert step - onset < 10


def test_a_thermal_throttle_active_since_before_the_job_does_not_explain_a_later_slowdown():
    c = Cluster(world=4)
    found, _ = _run(c, 1, thermal_from_start=True)
    (_, rec), = found
    assert rec.root_cause.value == "straggler_compute"


@pytest.mark.parametrize("late_s", [0.0, 3.0])
def test_a_thermal_throttle_that_begins_at_the_slowdown_explains_it_even_when_it_is_seen_late(late_s):
    c = Cluster(world=4)
    culprit = random.Random(int(late_s)).randrange(4)
    found, onset = _run(c, culprit, thermal_at=late_s)
    final = list(latest([r for _, r in found]).values())
    assert len(final) == 1
    rec = final[0]
    assert (rec.root_cause.value, rec.culprit.rank, rec.culprit.gpu) == ("gpu_thermal_throttle", culprit,
                                                                         c.uuid(culprit))
    assert found[0][0] - onset < 10
    if rec.version > 1:
        assert rec.previous_root_cause == "straggler_compute"
