"""The fault-injection suite: real multi-process gloo jobs under ``otel-gpu run``, a real collector with the fake NVML
and a fake sysfs tree for hardware, and the attribution each fault must produce.

Example:
    >>> from otel_gpu.testing.scenarios import SCENARIOS, run_scenario      # doctest: +SKIP
    >>> result = run_scenario(SCENARIOS["exception"], culprit_rank=2)       # doctest: +SKIP
    >>> result.ok, result.found.root_cause                                  # doctest: +SKIP
    (True, 'python_exception')
"""
from __future__ import annotations

from otel_gpu.testing.scenarios.runner import SCENARIOS, Scenario, ScenarioResult, run_scenario

__all__ = ["SCENARIOS", "Scenario", "ScenarioResult", "run_scenario"]
