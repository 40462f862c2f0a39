"""The restart policy of ``otel-gpu run --restart``: YAML, validated like the collector config (every problem with
its key and a fix; :class:`otel_gpu.config.ConfigError`).

Example:
    >>> policy = load_policy_text('''
    ... budget: {max_restarts: 2, window: 30m}
    ... hang: {decision: restart}
    ... actions: {rank_not_in_collective: auto_restart}
    ... ''')
    >>> policy.budget.max_restarts, policy.budget.window_s, policy.hang.decision
    (2, 1800.0, 'restart')
    >>> policy.action_for({"root_cause": "rank_not_in_collective", "category": "user", "action": "user_fix"})
    'auto_restart'
    >>> load_policy_text("budget: {max_restarts: -1}\\nhooks: {exclde: x}")
    Traceback (most recent call last):
    ...
    otel_gpu.config.ConfigError: budget.max_restarts must be >= 0 (got -1): set 0 to never restart, e.g. 3
    hooks.exclde: unknown setting (did you mean 'exclude'? known: exclude, exclude_timeout, exclude_gpu)
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from otel_gpu.config import ConfigError, build, did_you_mean
from otel_gpu.supervisor._hooks import HOOK_FIELDS, split_template

__all__ = ["ACTIONS", "HOOK_FIELDS", "Policy", "load_policy", "load_policy_text", "parse_duration"]

ACTIONS = ("auto_restart", "exclude_node_and_restart", "user_fix", "investigate")
CATEGORIES = ("hardware", "infrastructure", "software", "user")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any, key: str) -> float:
    """Seconds from ``90``, ``"90s"``, ``"30m"``, ``"1h"``, ``"500ms"``; ValueError naming ``key``."""
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a duration like 30s, 10m or 1h (got {value!r})")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ValueError(f"{key} must be a duration like 30s, 10m or 1h (got {value!r})")
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{key} must be a finite duration >= 0 (got {value!r})")
    return seconds


@dataclass
class BudgetPolicy:
    max_restarts: int = 3  # restarts allowed per window; 0 never restarts
    window: Any = "1h"  # sliding window of the budget (30m, 1h, 1d, or seconds)
    backoff_initial: Any = "1s"  # wait before the first restart; doubles per restart inside the window
    backoff_max: Any = "60s"
    window_s: float = field(default=0.0, init=False)
    backoff_initial_s: float = field(default=0.0, init=False)
    backoff_max_s: float = field(default=0.0, init=False)

    def validate(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0 (got {self.max_restarts}): set 0 to never restart, e.g. 3")
        self.window_s = parse_duration(self.window, "window")
        if self.window_s <= 0:
            raise ValueError(f"window must be > 0 (got {self.window!r}), e.g. 1h")
        self.backoff_initial_s = parse_duration(self.backoff_initial, "backoff_initial")
        self.backoff_max_s = parse_duration(self.backoff_max, "backoff_max")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_max must be >= backoff_initial (got {self.backoff_max!r} < "
                             f"{self.backoff_initial!r})")


@dataclass
class HangPolicy:
    #: by_action: stop the hung job and act on the verdict's action (restart, exclude, or stop with the diagnosis);
    #: restart: stop and restart any hung job (within the budget; hangs are often transient);
    #: report: print the diagnosis and leave the job running.
    decision: str = "by_action"
    #: A hang verdict less sure than this is only reported while the job runs (never stop a job on a guess).
    min_confidence: float = 0.5

    def validate(self) -> None:
        if self.decision not in ("by_action", "restart", "report"):
            raise ValueError(f"decision must be by_action, restart or report (got {self.decision!r})")
        if not 0 <= self.min_confidence <= 1:
            raise ValueError(f"min_confidence must be within 0..1 (got {self.min_confidence})")


@dataclass
class HooksPolicy:
    #: Command run before restarting with action exclude_node_and_restart, never through a shell: split once like
    #: a shell would (shlex), then {host} {gpu_uuid} {gpu_index} {rank} {root_cause} {job_id} are replaced inside
    #: their own argument (never split again) and also set as OTEL_GPU_CULPRIT_HOST, ... in its environment.
    #: Every field is validated first; one that is not: the hook does not run. Empty: exclude nothing.
    exclude: str = ""
    exclude_timeout_s: float = 60.0  # YAML: exclude_timeout (a duration, as every *_s field: otel_gpu.config)
    #: One host: restart with CUDA_VISIBLE_DEVICES without the culprit's GPU.
    exclude_gpu: bool = False
    exclude_argv: list = field(default_factory=list, init=False)  # ``exclude`` split (otel_gpu.supervisor._hooks)

    def validate(self) -> None:
        if not isinstance(self.exclude, str):
            raise ValueError(f"exclude must be a command line as one string (got {type(self.exclude).__name__}), "
                             "e.g. exclude: scontrol update nodename={host} state=drain")
        self.exclude_argv = []
        if self.exclude.strip():
            try:
                self.exclude_argv = split_template(self.exclude)
            except ValueError as exc:
                raise ValueError(f"exclude: {exc}") from None
        if not self.exclude_timeout_s > 0:
            raise ValueError(f"exclude_timeout_s must be > 0 (got {self.exclude_timeout_s})")


@dataclass
class VerdictPolicy:
    url: str = ""  # the collector's verdict API; default: the OTLP endpoint's host, port 4319
    wait_s: float = 15.0  # after the job failed, how long to wait for the collector's verdict
    poll_interval_s: float = 1.0  # how often a running job's verdicts are checked (hangs)
    bearer_token_file: str = ""  # the verdict API's token (also OTEL_GPU_VERDICT_TOKEN)
    ca_file: str = ""  # CA for an https:// url (default: the system's)

    def validate(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https:// (got {self.url!r}), "
                             "e.g. http://127.0.0.1:4319")
        if not 0 < self.wait_s <= 600:
            raise ValueError(f"wait_s must be within (0, 600] (got {self.wait_s})")
        if not 0 < self.poll_interval_s <= 60:
            raise ValueError(f"poll_interval_s must be within (0, 60] (got {self.poll_interval_s})")


@dataclass
class DevicesPolicy:
    #: Before each restart, ask the collector (GET /api/v1/devices?state=drain) for drained devices on the job's
    #: hosts and exclude them: the exclude hook per device ({root_cause} is device_drain), and with
    #: hooks.exclude_gpu a drained GPU of this host leaves CUDA_VISIBLE_DEVICES. Off: drained devices are ignored.
    exclude_drained: bool = False
    #: Also before the first start (needs exclude_drained).
    at_start: bool = False

    def validate(self) -> None:
        for key in ("exclude_drained", "at_start"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be true or false (got {getattr(self, key)!r})")
        if self.at_start and not self.exclude_drained:
            raise ValueError("at_start: needs exclude_drained: true (set both, or drop at_start)")


@dataclass
class NodesPolicy:
    #: Many nodes: with no spare to take an excluded node's place and torchrun's --nnodes a range (MIN:MAX), go on
    #: with fewer nodes (never fewer than MIN). Off: stop with the diagnosis.
    allow_shrink: bool = False

    def validate(self) -> None:
        if not isinstance(self.allow_shrink, bool):
            raise ValueError(f"allow_shrink must be true or false (got {self.allow_shrink!r})")


@dataclass
class Policy:
    budget: BudgetPolicy = field(default_factory=BudgetPolicy)
    hang: HangPolicy = field(default_factory=HangPolicy)
    hooks: HooksPolicy = field(default_factory=HooksPolicy)
    verdict: VerdictPolicy = field(default_factory=VerdictPolicy)
    devices: DevicesPolicy = field(default_factory=DevicesPolicy)
    nodes: NodesPolicy = field(default_factory=NodesPolicy)
    #: Overrides of the verdict's action, by root cause (first) or category: {gpu_xid: investigate, user: user_fix}.
    actions: dict = field(default_factory=dict)
    stop_grace_s: float = 10.0  # SIGTERM, then SIGKILL of the whole process tree after this
    #: What a hang costs without us (PyTorch's watchdog: 30 min for gloo, 10 min for NCCL); for "time saved".
    backend_timeout: Any = "30m"
    backend_timeout_s: float = field(default=0.0, init=False)
    source: str = field(default="<defaults>", init=False)

    def validate(self) -> None:
        problems = []
        for name in ("budget", "hang", "hooks", "verdict", "devices", "nodes"):  # defaults too: derived fields (window_s) are set here
            try:
                getattr(self, name).validate()
            except ValueError as exc:
                problems.append(f"{name}.{exc}")
        if not isinstance(self.actions, dict):
            raise ValueError("actions must be a mapping of root_cause or category to an action, e.g. "
                             "{gpu_xid: exclude_node_and_restart}")
        from otel_gpu.schema.failure import RootCause

        causes = [c.value for c in RootCause]
        for key, action in self.actions.items():
            if key not in causes and key not in CATEGORIES:
                hint = did_you_mean(str(key), causes + list(CATEGORIES))
                problems.append(f"actions.{key}: not a root cause or category ({hint}known categories: "
                                f"{', '.join(CATEGORIES)}; root causes: failure.root_cause in docs/schema.md)")
            if action not in ACTIONS:
                problems.append(f"actions.{key}: unknown action {action!r} ({did_you_mean(str(action), ACTIONS)}"
                                f"known: {', '.join(ACTIONS)})")
        if not self.stop_grace_s > 0:
            problems.append(f"stop_grace must be > 0 (got {self.stop_grace_s})")
        try:
            self.backend_timeout_s = parse_duration(self.backend_timeout, "backend_timeout")
        except ValueError as exc:
            problems.append(str(exc))
        if problems:
            raise ConfigError(problems)

    def action_for(self, record: Any) -> str:
        """The action to take on ``record`` (a :class:`otel_gpu.failure.FailureRecord`, or its JSON as a mapping):
        an override by root cause, else by category, else its own."""
        if isinstance(record, dict):
            cause, category, action = record.get("root_cause"), record.get("category"), record.get("action")
        else:
            cause, category, action = (getattr(getattr(record, k, None), "value", None)
                                       for k in ("root_cause", "category", "action"))
        for key in (cause, category):
            if isinstance(key, str) and key in self.actions:
                return self.actions[key]
        return action if action in ACTIONS else "investigate"


def load_policy_text(text: str, source: str = "<text>") -> Policy:
    """Raises ConfigError listing every problem, each with its key."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{source}: not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping (budget:, hang:, hooks:, verdict:, devices:, nodes:, actions:), "
                          f"got {type(data).__name__}")
    problems: list[str] = []
    sections = {"budget": BudgetPolicy, "hang": HangPolicy, "hooks": HooksPolicy, "verdict": VerdictPolicy,
                "devices": DevicesPolicy, "nodes": NodesPolicy}
    built: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        if key in sections:
            try:
                built[key] = build(sections[key], value, key)
            except ConfigError as exc:
                problems.extend(exc.problems)
        elif key in ("actions", "backend_timeout"):
            built[key] = value
        elif key == "stop_grace":
            try:
                built["stop_grace_s"] = parse_duration(value, "stop_grace")
            except ValueError as exc:
                problems.append(str(exc))
        else:
            known = list(sections) + ["actions", "stop_grace", "backend_timeout"]
            problems.append(f"{key}: unknown setting ({did_you_mean(key, known)}known: {', '.join(known)})")
    if "actions" in built and built["actions"] is None:
        built["actions"] = {}
    policy = Policy(**built)
    try:
        policy.validate()
    except ConfigError as exc:
        problems.extend(exc.problems)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError(problems)
    policy.source = source
    return policy


def load_policy(path: str | None) -> Policy:
    """The policy in ``path`` (None: the defaults). Raises ConfigError."""
    if not path:
        policy = Policy()
        policy.validate()
        return policy
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"--policy: cannot read {path!r} ({exc.strerror}); check the path") from None
    return load_policy_text(text, path)
