"""One job id on every node of a job, without the user's help (docs/design.md section 3, "Job identity").

Every record carries ``training.job.id``; the job's aggregator joins the ranks of all nodes by it, so every node must
find the *same* id on its own. :func:`resolve` looks, in this order, at:

1. ``OTEL_GPU_JOB_ID``: the user's (or an outer ``otel-gpu run``'s) explicit id;
2. torchrun's ``--rdzv-id`` / ``--rdzv_id`` on the command line (the launcher sees it), or ``TORCHELASTIC_RUN_ID``
   in the ranks torchrun starts (torchrun's default run id ``none`` is no id: it is the same for every job);
3. Slurm: ``SLURM_JOB_ID`` (an array task: ``SLURM_ARRAY_JOB_ID`` and ``SLURM_ARRAY_TASK_ID``) and ``SLURM_STEP_ID``
   when inside a step, e.g. ``slurm-81234.0``;
4. Kubernetes: the name of the owning Job, JobSet or PyTorchJob, which the pod spec exposes through the Downward API
   as ``OTEL_GPU_K8S_JOBSET_NAME``, ``OTEL_GPU_K8S_PYTORCHJOB_NAME`` or ``OTEL_GPU_K8S_JOB_NAME`` (with
   ``OTEL_GPU_K8S_NAMESPACE``), e.g. ``k8s-team-a/llama-70b`` (docs/scale.md has the pod-spec snippet).

When none of these exists, there is no id yet: the ranks agree on one through the rendezvous. When the default
process group is created, rank 0 publishes its generated id in the group's c10d store and the others adopt it
(``otel_gpu.instrumentation._runtime``), and each rank notes the agreed id in ``otel-gpu run``'s registry, where the
launcher of each node adopts it for its own (exit) records.

Example:
    >>> resolve({"SLURM_JOB_ID": "81234", "SLURM_STEP_ID": "0"}, [])
    JobId(value='slurm-81234.0', source='Slurm (SLURM_JOB_ID, SLURM_STEP_ID)')
    >>> resolve({}, ["torchrun", "--nnodes", "2", "--rdzv-id=myjob", "train.py"]).value
    'myjob'
    >>> resolve({"TORCHELASTIC_RUN_ID": "none"}, []) is None
    True
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["JobId", "LaunchJobId", "resolve", "generated", "K8S_ENV", "RENDEZVOUS_SOURCE", "PROVISIONAL_ENV"]

#: Downward API variables a training pod may set (Kubernetes), most specific first: (variable, what it names).
K8S_ENV = (("OTEL_GPU_K8S_JOBSET_NAME", "JobSet"), ("OTEL_GPU_K8S_PYTORCHJOB_NAME", "PyTorchJob"),
           ("OTEL_GPU_K8S_JOB_NAME", "Job"))
#: The source named when the ranks agreed on the id at their rendezvous.
RENDEZVOUS_SOURCE = "agreed at the rendezvous (rank 0's id through the c10d store)"
#: A process with no job id yet shares its generated one with its children through this variable (not
#: OTEL_GPU_JOB_ID, which would make them skip the rendezvous agreement).
PROVISIONAL_ENV = "OTEL_GPU_JOB_ID_PROVISIONAL"
# torchrun's default --rdzv-id: the same for every job, so it tells nothing.
_NO_RUN_ID = {"", "none"}
# Options of torchrun (torch.distributed.run) that take a value: skipped when looking for the script's position.
_RDZV_ID_FLAGS = ("--rdzv-id", "--rdzv_id")


@dataclass(frozen=True)
class JobId:
    """A job id and where it came from (printed by ``otel-gpu run``)."""

    value: str
    source: str


def _torchrun_rdzv_id(argv: Sequence[str]) -> str | None:
    """``--rdzv-id X`` / ``--rdzv-id=X`` of a torchrun command line (``torchrun``, ``python -m torch.distributed.run``),
    looking only at the launcher's own options (before the training script)."""
    args = list(argv)
    if not args:
        return None
    name = os.path.basename(args[0])
    if name == "torchrun" or "torch.distributed.run" in args[:3] or "torch.distributed.launch" in args[:3]:
        for i, arg in enumerate(args):
            if arg.endswith(".py") and i > 0:
                break  # the training script's own arguments follow
            for flag in _RDZV_ID_FLAGS:
                if arg == flag and i + 1 < len(args):
                    return args[i + 1]
                if arg.startswith(flag + "="):
                    return arg.split("=", 1)[1]
    return None


def _slurm(env: Mapping[str, str]) -> JobId | None:
    job = env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID") and \
        f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    names = "SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID" if job else "SLURM_JOB_ID"
    job = job or env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        return None
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if step:
        return JobId(f"slurm-{job}.{step}", f"Slurm ({names}, SLURM_STEP_ID)")
    return JobId(f"slurm-{job}", f"Slurm ({names})")


def _kubernetes(env: Mapping[str, str]) -> JobId | None:
    for var, kind in K8S_ENV:
        name = env.get(var, "").strip()
        if name:
            ns = env.get("OTEL_GPU_K8S_NAMESPACE", "").strip()
            return JobId(f"k8s-{ns}/{name}" if ns else f"k8s-{name}", f"Kubernetes {kind} ({var})")
    return None


def resolve(env: Mapping[str, str] | None = None, argv: Sequence[str] = ()) -> JobId | None:
    """The job id every node finds on its own, or None when only the rendezvous can agree on one.

    Args:
        env: the environment to read (default: ``os.environ``).
        argv: the command ``otel-gpu run`` launches (to read torchrun's ``--rdzv-id``); empty inside a rank.
    """
    env = os.environ if env is None else env
    explicit = env.get("OTEL_GPU_JOB_ID", "").strip()
    if explicit:
        return JobId(explicit, env.get("OTEL_GPU_JOB_ID_SOURCE") or "OTEL_GPU_JOB_ID")
    rdzv = _torchrun_rdzv_id(argv)
    if rdzv is not None and rdzv.strip() not in _NO_RUN_ID:
        return JobId(rdzv.strip(), "torchrun --rdzv-id")
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id not in _NO_RUN_ID:
        return JobId(run_id, "torchrun's run id (TORCHELASTIC_RUN_ID)")
    return _slurm(env) or _kubernetes(env)


def generated() -> str:
    """A fresh id, for a process that has no job id (yet)."""
    return "job-" + uuid.uuid4().hex[:12]


class LaunchJobId:
    """The job id of ``otel-gpu run``: resolved from its environment and command, else provisional until the ranks
    agree on one at their rendezvous and note it in the registry (then adopted: :meth:`adopt`)."""

    def __init__(self, cmd: Sequence[str], explicit: str | None = None, env: Mapping[str, str] | None = None,
                 out=None):
        import sys

        self._out = out if out is not None else sys.stderr
        found = JobId(explicit, "--job-id") if explicit else resolve(env, cmd)
        self.provisional = found is None
        if found is None:
            found = JobId((env if env is not None else os.environ).get(PROVISIONAL_ENV) or generated(),
                          "provisional")
        self.value, self.source = found.value, found.source

    def apply(self, env: dict[str, str]) -> dict[str, str]:
        """Sets the job id variables of the launched command's environment."""
        if self.provisional:
            env.pop("OTEL_GPU_JOB_ID", None)
            env[PROVISIONAL_ENV] = self.value
        else:
            env["OTEL_GPU_JOB_ID"] = self.value
            env["OTEL_GPU_JOB_ID_SOURCE"] = self.source
        return env

    def announce(self) -> None:
        if self.provisional:
            print("otel-gpu run: no job id from OTEL_GPU_JOB_ID, torchrun --rdzv-id, Slurm or Kubernetes: the ranks "
                  f"agree on one at their rendezvous (until then, or without a process group: {self.value})",
                  file=self._out, flush=True)
        else:
            print(f"otel-gpu run: job id {self.value} (from {self.source})", file=self._out, flush=True)

    def adopt(self, agreed: str | None, identity=None) -> None:
        """Takes the id the ranks agreed on (from the registry) for the launcher's own records."""
        if not agreed or not self.provisional:
            return
        self.value, self.source, self.provisional = agreed, RENDEZVOUS_SOURCE, False
        if identity is not None:
            identity.job_id = agreed
        print(f"otel-gpu run: job id {agreed} ({RENDEZVOUS_SOURCE})", file=self._out, flush=True)
