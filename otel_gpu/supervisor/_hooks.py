"""Operator hooks (``hooks.exclude``) as argv, never through a shell.

The template is split once at policy load (:func:`split_template`, ``shlex.split``); each placeholder is replaced
inside its own argument and never split again, so a culprit field stays one argument whatever it holds. Every
field is checked before anything runs (:func:`hook_fields`: root cause in the taxonomy, rank an integer, host an
RFC 1123 name, GPU an NVML UUID or a small index) and also passed as an environment variable
(``OTEL_GPU_CULPRIT_HOST``, ...), the way to use it from a script. A field that does not validate: nothing runs.

Example:
    >>> argv = split_template("scontrol update nodename={host} state=drain reason='otel-gpu {root_cause}'")
    >>> argv
    ['scontrol', 'update', 'nodename={host}', 'state=drain', 'reason=otel-gpu {root_cause}']
    >>> fields = hook_fields(root_cause="gpu_xid", host="node-7", rank=3, gpu="0", job_id="job-1")
    >>> expand(argv, fields)
    ['scontrol', 'update', 'nodename=node-7', 'state=drain', 'reason=otel-gpu gpu_xid']
    >>> hook_fields(root_cause="gpu_xid", host="node$(touch X)")
    Traceback (most recent call last):
    ...
    otel_gpu.supervisor._hooks.HookRefused: culprit.host: 'node$(touch X)' is not a host name (RFC 1123): the hook is not run
"""
from __future__ import annotations

import os
import shlex
import signal
import string
import subprocess
from typing import Any

from otel_gpu.failure import MAX_GPU_INDEX, RootCause, is_gpu_id, is_host_name, printable

__all__ = ["HOOK_FIELDS", "HOOK_ENV", "HookRefused", "expand", "hook_fields", "run_hook", "split_template"]

HOOK_FIELDS = ("host", "gpu_uuid", "gpu_index", "rank", "root_cause", "job_id")
#: Environment variable per field, set for every hook run (empty when the verdict does not name it).
HOOK_ENV = {"host": "OTEL_GPU_CULPRIT_HOST", "rank": "OTEL_GPU_CULPRIT_RANK", "gpu_uuid": "OTEL_GPU_CULPRIT_GPU_UUID",
            "gpu_index": "OTEL_GPU_CULPRIT_GPU_INDEX", "root_cause": "OTEL_GPU_ROOT_CAUSE", "job_id": "OTEL_GPU_JOB_ID"}
#: Root causes a hook may be run for: the taxonomy, and the drained-device exclusion (policy devices.exclude_drained).
HOOK_CAUSES = frozenset(c.value for c in RootCause) | {"device_drain"}
_SHELLS = frozenset(("sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox", "fish", "csh", "tcsh"))
_OUTPUT_BYTES = 4096


class HookRefused(ValueError):
    """A field of the verdict does not validate: the hook is not run."""


def split_template(template: str) -> list[str]:
    """``template`` split once into argv, each argument's placeholders checked. Raises ValueError (the caller names
    the key): a quote left open, an unknown placeholder, a conversion or format spec (``{host!r}``, ``{rank:>3}``),
    or a placeholder inside a shell's ``-c`` script, where the shell would parse the field."""
    try:
        argv = shlex.split(template)
    except ValueError as exc:
        raise ValueError(f"does not split into arguments ({exc}); quote as in a shell, e.g. "
                         "reason='otel-gpu {root_cause}'") from None
    if not argv:
        raise ValueError("is empty after splitting; give a command, e.g. scontrol update nodename={host} state=drain")
    script_next = False
    shell = os.path.basename(argv[0]) in _SHELLS
    for i, arg in enumerate(argv):
        try:
            parsed = list(string.Formatter().parse(arg))
        except ValueError as exc:
            raise ValueError(f"argument {i + 1} {arg!r}: not a valid template ({exc}); write literal braces as "
                             "{{ }}") from None
        names = []
        for _, name, spec, conversion in parsed:
            if name is None:
                continue
            if name not in HOOK_FIELDS:
                from otel_gpu.config import did_you_mean

                raise ValueError(f"unknown placeholder {{{name}}} ({did_you_mean(name, HOOK_FIELDS)}known: "
                                 f"{', '.join('{' + f + '}' for f in HOOK_FIELDS)})")
            if spec or conversion:
                raise ValueError(f"placeholder {{{name}}} takes no conversion or format (got {arg!r}); write {{{name}}}")
            names.append(name)
        if script_next and names:
            raise ValueError(f"{{{names[0]}}} inside a {os.path.basename(argv[0])} -c script would be parsed by the "
                             f"shell; write \"${HOOK_ENV[names[0]]}\" there (every field is also in the hook's "
                             "environment)")
        # sh -c SCRIPT, bash -ec SCRIPT: the shell parses SCRIPT; its later arguments ($0, $1, ...) it does not.
        script_next = (shell and not script_next and arg.startswith("-") and not arg.startswith("--")
                       and "c" in arg[1:])
    return argv


def hook_fields(root_cause: Any, host: Any = None, rank: Any = None, gpu: Any = None, job_id: Any = "",
                gpu_uuid: Any = None, gpu_index: Any = None) -> dict[str, str]:
    """The placeholders' values, each checked; ``gpu`` (index or UUID) fills whichever it is. Raises HookRefused
    naming the field."""
    def refuse(key: str, value: Any, what: str) -> HookRefused:
        return HookRefused(f"{key}: {printable(repr(value))} is not {what}: the hook is not run")

    cause = root_cause.value if hasattr(root_cause, "value") else root_cause
    if not isinstance(cause, str) or cause not in HOOK_CAUSES:
        raise refuse("root_cause", root_cause, "a root cause of the taxonomy")
    if host in (None, ""):
        host = ""
    elif not is_host_name(host, strict=True):
        raise refuse("culprit.host", host, "a host name (RFC 1123)")
    if rank in (None, ""):
        rank_text = ""
    elif isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0:
        rank_text = str(rank)
    else:
        raise refuse("culprit.rank", rank, "a rank (an integer >= 0)")
    uuid, index = "", ""
    for key, value in (("culprit.gpu", gpu), ("gpu_uuid", gpu_uuid), ("gpu_index", gpu_index)):
        if value in (None, ""):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not is_gpu_id(value, strict=True):
            raise refuse(key, value, f"a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx) or index "
                                     f"(0..{MAX_GPU_INDEX})")
        if value.isdigit():
            index = index or value
        else:
            uuid = uuid or value
    if not isinstance(job_id, str) or printable(job_id) != job_id or len(job_id) > 512:
        raise refuse("job_id", job_id, "a job id without control characters")
    return {"host": host, "gpu_uuid": uuid, "gpu_index": index, "rank": rank_text, "root_cause": cause,
            "job_id": job_id}


def expand(argv: list[str], fields: dict[str, str]) -> list[str]:
    """Each argument with its placeholders replaced: one argument in, one argument out."""
    return [arg.format_map(fields) for arg in argv]


def run_hook(argv: list[str], fields: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Runs the hook (no shell; fields in its argv and environment; its own session, killed whole after
    ``timeout_s``). Returns ``{"command", "argv", "exit_code", "output"}`` (exit_code None: did not start or timed
    out)."""
    command = expand(argv, fields)
    shown = " ".join(shlex.quote(a) for a in command)
    env = dict(os.environ)
    env.update({HOOK_ENV[k]: v for k, v in fields.items()})
    env["OTEL_GPU_CULPRIT_GPU"] = fields["gpu_uuid"] or fields["gpu_index"]
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,  # argv, no shell
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    except OSError as exc:
        return {"command": shown, "argv": command, "exit_code": None, "output": f"cannot start: {exc.strerror}"}
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, _ = proc.communicate()
        return {"command": shown, "argv": command, "exit_code": None,
                "output": f"timed out after {timeout_s:g} s; killed. " + _tail(out)}
    return {"command": shown, "argv": command, "exit_code": proc.returncode, "output": _tail(out)}


def _tail(out: bytes | None) -> str:
    return (out or b"")[-_OUTPUT_BYTES:].decode("utf-8", "replace")
