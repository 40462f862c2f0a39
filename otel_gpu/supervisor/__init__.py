"""``otel-gpu run --restart {never,auto,always}``: act on the collector's verdict.

With ``auto``, when the job fails (or the collector attributes a hang while it runs), ``run`` asks the collector's
verdict API for the job's failure and acts on its ``action``:

- ``auto_restart``: stop what is left of the job (SIGTERM, grace, SIGKILL of the whole process tree, torchrun's
  per-rank sessions included) and start it again after a backoff;
- ``exclude_node_and_restart``: run the policy's exclude hook with the culprit, then restart;
- ``user_fix`` / ``investigate``: no restart; print the diagnosis (as ``otel-gpu report`` does) and exit with the
  job's status.

A budget (N restarts per window) stops loops; every decision is printed, sent as an ``otel_gpu.restart.decision``
OTLP event and kept in the store. With no collector answering, the job runs once and is never restarted on a guess.
``always`` restarts on any failure (within the budget), still excluding culprits. See docs/restart.md.

Example:
    otel-gpu run --restart auto --max-restarts 3 --restart-window 1h -- torchrun --nproc-per-node 8 train.py
"""
from __future__ import annotations

from otel_gpu.supervisor.policy import Policy, load_policy, load_policy_text
from otel_gpu.supervisor.supervisor import Decision, Supervisor

__all__ = ["Decision", "Policy", "Supervisor", "load_policy", "load_policy_text"]
