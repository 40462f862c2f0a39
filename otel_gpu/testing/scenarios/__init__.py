"""The fault-injection suite: real multi-process gloo jobs under ``otel-gpu run``, a real collector with the fake NVML
and a fake sysfs tree for hardware, and the attribution each fault must produce.

Adversarial by construction (issue 10): :func:`draw_cases` draws the culprit from every rank (0 included), a
:class:`Dirt` per run (a second IB port and ifb0/docker0 down since boot, ``sw_power_cap`` on before the job,
background error counts rising, an old application XID) and, for hardware faults, when the evidence lands relative to
the symptom (1.5 s before to 5 s after: a late fact must revise the verdict). Besides the single faults there are two
failures in one incarnation, a subgroup wait-for chain, uneven inputs, and healthy runs that must stay quiet: a 40 s
rank-0 checkpoint, a node-agent restart mid-job, a background-thread exception. Verdicts are read from the store (the
latest version of each failure, withdrawn ones left out), as ``otel-gpu report`` shows them.

Example:
    >>> from otel_gpu.testing.scenarios import SCENARIOS, run_scenario      # doctest: +SKIP
    >>> result = run_scenario(SCENARIOS["exception"], culprit_rank=2)       # doctest: +SKIP
    >>> result.ok, result.found.root_cause                                  # doctest: +SKIP
    (True, 'python_exception')
"""
from __future__ import annotations

from otel_gpu.testing.scenarios.runner import (SCENARIOS, Case, Dirt, Scenario, ScenarioResult, draw_cases, run_case,
                                               run_scenario)

__all__ = ["SCENARIOS", "Case", "Dirt", "Scenario", "ScenarioResult", "draw_cases", "run_case", "run_scenario"]
