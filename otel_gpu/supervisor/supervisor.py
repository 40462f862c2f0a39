"""The restart loop of ``otel-gpu run --restart {auto,always}``: run the command, ask the collector why it failed,
and act on the verdict's action."""
from __future__ import annotations

import collections
import logging
import os
import sys
import time
from dataclasses import asdict
from typing import Any, TextIO

from otel_gpu.failure import FailureRecord, Kind, format_failure, printable
from otel_gpu.supervisor._decision import RDZV_JOIN_TIMEOUT_S, RESTARTING, DecidedElsewhere, Decision
from otel_gpu.supervisor._hooks import HookRefused, hook_fields, run_hook
from otel_gpu.supervisor._job import EXIT_EXCLUDED, JobLink, ManyNodes
from otel_gpu.supervisor._proctree import become_subreaper, stop_tree
from otel_gpu.supervisor._verdict import VerdictClient, VerdictUnavailable
from otel_gpu.supervisor.policy import Policy

__all__ = ["Decision", "Supervisor"]

_logger = logging.getLogger(__name__)
#: Exit status of ``run`` after an error of its own (EX_SOFTWARE); the job's process tree was stopped first.
INTERNAL_ERROR = 70


class Supervisor(ManyNodes):
    """Runs ``cmd`` (under :class:`otel_gpu.instrumentation.launcher.Launch`) until it succeeds, or the policy says stop."""

    def __init__(self, cmd: list[str], mode: str, policy: Policy, endpoint: str | None, job_id: str,
                 verdict_url: str, out: TextIO | None = None, verdict_token: str | None = None,
                 hosts: tuple[str, ...] | None = None, local_host: str | None = None):
        if mode not in ("auto", "always"):
            raise ValueError(f"mode must be auto or always (got {mode!r})")
        self.cmd, self.mode, self.policy, self.endpoint, self.job_id = list(cmd), mode, policy, endpoint, job_id
        self.out = out or sys.stderr
        token = verdict_token or os.environ.get("OTEL_GPU_VERDICT_TOKEN") or None
        token_file = policy.verdict.bearer_token_file or os.environ.get("OTEL_GPU_VERDICT_TOKEN_FILE", "")
        if not token and token_file:  # a mounted Secret (the Helm chart's aggregator.verdict.tokenSecret)
            try:
                with open(token_file, encoding="utf-8") as fh:
                    token = fh.read().strip()
            except OSError as exc:
                self.say(f"cannot read the verdict token file ({exc.strerror}); asking without a token")
        self.client = VerdictClient(verdict_url, token, policy.verdict.ca_file)
        #: Presented with the decisions this sends, so that a collector with trusted_forwarders keeps them (a
        #: restart decision is a record that acts: from an unauthenticated sender the collector drops it).
        self._forwarder_token = _forwarder_token(self.say)
        self.decisions: list[Decision] = []
        self.restart_times: collections.deque[float] = collections.deque()
        self.handled: set[str] = set()  # acted on
        self.reported: set[str] = set()  # printed while the job ran, not acted on (yet)
        self._warned = False
        self._reachable: bool | None = None
        self._excluded_gpus: list[str] = []
        #: The job's hosts, for the drained-device query: given, else this host (the launch's host.name) and the
        #: culprit hosts of its verdicts. Empty: all hosts.
        self.hosts: set[str] = set(hosts or ())
        self.local_host = local_host or _this_host()
        if hosts is None and self.local_host:
            self.hosts.add(self.local_host)
        self._drained_seen: set[tuple[str, Any]] = set()  # (device_id, since) already acted on
        self._unreadable_seen: set[str] = set()  # verdicts that do not read, said once each
        self._stop_requested: int | None = None
        self.t0 = time.time()
        #: Many nodes (a torchrun command of more than one node): this node's link to the job's board.
        self.job: JobLink | None = JobLink(self.client, job_id, self.local_host or "", self.cmd) if (
            JobLink.wanted(self.cmd) and self.local_host) else None
        self._alone = False  # many nodes but no board: never restart alone
        self._export_decision = True

    # -- output ----------------------------------------------------------------------------------------------------
    def say(self, msg: str, diagnosis: str = "") -> None:
        """Prints ``msg`` escaped (it may quote telemetry: job ids, hosts, hook output), then ``diagnosis`` (text of
        :func:`otel_gpu.failure.format_failure`, escaped field by field), if any."""
        self._emit(f"otel-gpu run: {printable(msg)}" + (f"\n{diagnosis.rstrip(chr(10))}" if diagnosis else "")
                   + "\n")

    def _emit(self, text: str) -> None:
        """Writes to our output; a terminal that went away (closed pipe) never stops the supervision of the job."""
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):
            pass

    def _warn_unreachable(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            self.say(f"WARNING: no verdict from the collector ({why}); the job runs, but it will not be restarted "
                     "on a guess. Start `otel-gpu collector` (its verdict exporter serves "
                     f"{self.client.url}/api/v1/failures) or pass --verdict-url")

    # -- verdicts --------------------------------------------------------------------------------------------------
    def _failures(self, since: float) -> list[FailureRecord] | None:
        """This incarnation's unhandled failures, newest first, read typed; None when the collector does not
        answer. A record that does not read is said once and never acted on."""
        try:
            records = self.client.failures(self.job_id, since=since)
        except VerdictUnavailable as exc:
            self._reachable = False if self._reachable is None else self._reachable
            self._warn_unreachable(str(exc))
            return None
        self._reachable = True
        for name, reason in records.unreadable:
            if name not in self._unreadable_seen and len(self._unreadable_seen) < 1000:
                self._unreadable_seen.add(name)
                self.say(f"unreadable record {name} from the verdict API ({reason}): not acted on; the job stays "
                         "supervised")
        # This incarnation's: begun after it started, or noticed after (a lost node's onset is its last sign of
        # life, which can be older than a restart); a revision of one already acted on keeps its failure_id.
        return [r for r in records if _key(r) not in self.handled and r.kind in (Kind.CRASH, Kind.HANG)
                and (r.onset_time >= since - 1.0 or r.detected_time >= since + 1.0)]

    def _wait_verdict(self, since: float) -> FailureRecord | None:
        """After the job failed: its verdict. A sure record (not one already printed as unsure while the job ran)
        is taken at once; otherwise the best record there is when ``verdict.wait_s`` is up."""
        deadline = time.monotonic() + self.policy.verdict.wait_s
        found: list[FailureRecord] | None = []
        next_board = 0.0
        while True:
            if self.job is not None and time.monotonic() >= next_board:
                next_board = time.monotonic() + self.policy.verdict.poll_interval_s
                made = self.job.made()
                if made is not None:
                    raise DecidedElsewhere(made)
            found = self._failures(since) or found
            sure = [r for r in found or [] if _key(r) not in self.reported
                    and r.confidence >= self.policy.hang.min_confidence]
            if sure:
                return _first_cause(sure)
            if not found and self._reachable is False:
                return None  # nobody to ask: do not wait for nothing
            if time.monotonic() >= deadline:
                return max(found, key=lambda r: r.confidence) if found else None
            time.sleep(0.25)

    # -- actions ---------------------------------------------------------------------------------------------------
    def _budget_left(self, now: float) -> int:
        while self.restart_times and self.restart_times[0] < now - self.policy.budget.window_s:
            self.restart_times.popleft()
        return self.policy.budget.max_restarts - len(self.restart_times)

    def _backoff(self) -> float:
        b = self.policy.budget
        return min(b.backoff_max_s, b.backoff_initial_s * (2 ** len(self.restart_times)))

    def _refusal(self, record: FailureRecord) -> str | None:
        """Why ``record`` must not be acted on, or None. A verdict whose action excludes its culprit (an exclude hook,
        or its GPU left out) is acted on only when every culprit field validates (otel_gpu.supervisor._hooks)."""
        hooks = self.policy.hooks
        if self.policy.action_for(record) != "exclude_node_and_restart" or not (hooks.exclude_argv
                                                                                 or hooks.exclude_gpu):
            return None
        try:
            self._hook_fields(record)
        except HookRefused as exc:
            return str(exc)
        return None

    def _hook_fields(self, record: FailureRecord) -> dict[str, str]:
        """The culprit's fields for the exclude hook and CUDA_VISIBLE_DEVICES, each validated. Raises HookRefused."""
        c = record.culprit
        return hook_fields(record.root_cause, c.host, c.rank, c.gpu, self.job_id)

    def _exclude(self, record: FailureRecord, decision: Decision, fields: dict[str, str] | None = None) -> None:
        """Runs the exclude hook and/or leaves the culprit's GPU out; ``fields`` already validated (else here:
        raises HookRefused before anything runs)."""
        fields = fields if fields is not None else self._hook_fields(record)
        hooks = self.policy.hooks
        excluded = []
        if hooks.exclude_argv:
            decision.hook = self._run_hook(fields)
            excluded.append(f"host {fields['host'] or '?'}")
        if hooks.exclude_gpu:
            gpu_id = fields["gpu_uuid"] or fields["gpu_index"]
            if gpu_id:
                self._excluded_gpus.append(gpu_id)
                excluded.append(f"GPU {gpu_id}")
            else:
                self.say("exclude_gpu: the verdict names no GPU; restarting with the same devices")
        decision.excluded = ", ".join(excluded) or None

    def _run_hook(self, fields: dict[str, str]) -> dict[str, Any]:
        """The exclude hook as argv (no shell), fields validated by the caller; see otel_gpu.supervisor._hooks."""
        hooks = self.policy.hooks
        result = run_hook(hooks.exclude_argv, fields, hooks.exclude_timeout_s)
        self.say(f"exclude hook: {result['command']}")
        if result["exit_code"] is None:
            self.say(f"exclude hook did not complete: {result['output'].strip()[-300:]}")
        elif result["exit_code"] != 0:
            self.say(f"exclude hook exited {result['exit_code']}: {result['output'].strip()[-300:]}")
        result["output"] = result["output"][-500:]
        return result

    def exclude_drained(self, run_hooks: bool = True) -> list[dict[str, Any]]:
        """Policy ``devices.exclude_drained``: asks the collector for drained devices on the job's hosts (all when
        unknown) and excludes each one not acted on yet: the exclude hook ({root_cause} device_drain), and with
        ``hooks.exclude_gpu`` a drained GPU of this host leaves CUDA_VISIBLE_DEVICES. Returns what was excluded
        (empty when the policy is off, nothing is drained, or the collector does not answer)."""
        if not self.policy.devices.exclude_drained:
            return []
        try:
            drained = self.client.devices("drain", tuple(sorted(self.hosts)))
        except VerdictUnavailable as exc:
            self.say(f"cannot ask for drained devices ({exc}); restarting with the same devices")
            return []
        done = []
        hooks = self.policy.hooks
        for device in drained:
            since = device.get("since")
            key = (device["device_id"], since if isinstance(since, (int, float, str)) else repr(since))
            if key in self._drained_seen:
                continue
            self._drained_seen.add(key)
            gpu = device.get("kind") == "gpu"
            try:
                fields = hook_fields("device_drain", device.get("host"), None, None, self.job_id,
                                     gpu_uuid=device.get("uuid") if gpu else None,
                                     gpu_index=device.get("gpu_index") if gpu else None)
            except HookRefused as exc:
                self.say(f"drained device {device['device_id']}: {exc}; not acted on")
                continue
            host, uuid, index = fields["host"], fields["gpu_uuid"], fields["gpu_index"]
            evidence = device.get("evidence")
            evidence = [printable(e) for e in evidence[:5]] if isinstance(evidence, list) else []
            entry: dict[str, Any] = {"device_id": device["device_id"], "host": host or None,
                                     "since": since, "evidence": evidence}
            self.say(f"device {device['device_id']} on {host or '?'} is drained"
                     + (f" ({'; '.join(evidence[:2])})" if evidence else "") + ": excluding it")
            if not run_hooks:  # a proposal for the job's board: the drained node leaves the job
                done.append(entry)
                continue
            if hooks.exclude_argv:
                entry["hook"] = self._run_hook(fields)
            local = self.local_host is not None and host == self.local_host
            if hooks.exclude_gpu and (uuid or index) and local:
                self._excluded_gpus.extend(g for g in (uuid, index) if g and g not in self._excluded_gpus)
                entry["gpu"] = uuid or index
            if "hook" in entry or "gpu" in entry:
                done.append(entry)
            else:
                self.say(f"device {device['device_id']}: no hooks.exclude and not a GPU of this host: nothing to "
                         "exclude it with")
        return done

    def _cuda_env(self) -> dict[str, str]:
        if not self._excluded_gpus:
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = [d.strip() for d in visible.split(",")] if visible else _all_gpus()
        keep = [d for d in devices if d not in self._excluded_gpus]
        return {"CUDA_VISIBLE_DEVICES": ",".join(keep)}

    def _record(self, decision: Decision, launch) -> None:
        """Prints and keeps the decision, and sends it to the collector; on many nodes only the node whose proposal
        won sends it (the job's decisions are recorded once, not once per node)."""
        self.decisions.append(decision)
        self._emit(decision.line() + "\n")
        export, self._export_decision = self._export_decision, True
        if not export:
            return
        try:
            from otel_gpu.instrumentation.launcher import send_event
            from otel_gpu.schema import identity as ids
            from otel_gpu.schema import training as tr

            body = {k: v for k, v in asdict(decision).items() if v is not None}
            if decision.job_decision is not None:  # the job's decision, as recorded once per job
                body.update(decision=decision.job_decision, node_decision=decision.decision)
            send_event(launch, tr.RESTART_EVENT.name, {ids.JOB_ID: self.job_id}, body,
                       warning=decision.decision != "done", token=self._forwarder_token)
        except Exception:  # the decision stands even if it cannot be exported
            _logger.debug("could not export the decision", exc_info=True)

    # -- the loop --------------------------------------------------------------------------------------------------
    def run(self) -> int:
        from otel_gpu.instrumentation.launcher import forward_signals, restore_signals

        become_subreaper()
        if not self.client.healthy():
            self._reachable = False
            self._warn_unreachable(f"{self.client.url} does not answer")
        restart_base = 0
        incarnation = 0
        current: dict[str, Any] = {}

        def _on_signal(signum):
            self._stop_requested = signum
            launch = current.get("launch")
            if launch is not None and launch.proc is not None:
                try:
                    launch.proc.send_signal(signum)
                except OSError:
                    pass

        previous = forward_signals(_on_signal)
        try:
            at_start = self.exclude_drained() if self.policy.devices.at_start else []
            return self._loop(current, at_start, restart_base, incarnation)
        except Exception as exc:  # said, and the job was stopped (_stop_on_error) before we exit
            _logger.debug("supervisor error", exc_info=True)
            self.say(f"internal error ({type(exc).__name__}: {exc}); the job was stopped, not left unsupervised; "
                     "please report this with the record that caused it")
            return INTERNAL_ERROR
        finally:
            restore_signals(previous)

    def _stop_on_error(self, launch, exc: BaseException) -> None:
        """An error of ours (or a KeyboardInterrupt) while the job runs: stop its whole process tree before we go,
        so that it never runs unsupervised."""
        proc = getattr(launch, "proc", None)
        if proc is None:
            return
        try:
            self.say(f"stopping the job's process tree after an error of the supervisor ({type(exc).__name__})")
            stop_tree(proc.pid, launch.pids(), self.policy.stop_grace_s)
        except BaseException:  # noqa: BLE001 - last resort: at least the command itself
            try:
                proc.kill()
            except OSError:
                pass

    def _loop(self, current: dict[str, Any], at_start: list[dict[str, Any]], restart_base: int,
              incarnation: int) -> int:
        from otel_gpu.instrumentation.launcher import Launch

        if self.job is not None:
            status = self._join()
            if status is not None:
                return status
        while True:
            if self.job is not None:  # every node runs the job's generation, whoever decided it
                incarnation = restart_base = self.job.generation
            cmd = self.job.command() if self.job is not None else self.cmd
            launch = Launch(cmd, self.endpoint, self.job_id, restart_count=restart_base,
                            extra_env=self._cuda_env())
            current["launch"] = launch
            if at_start:
                d = Decision(job_id=self.job_id, incarnation=0, restart_count=0, time=time.time(),
                             trigger="start", exit_status=None, decision="exclude", drained=at_start,
                             excluded=_drained_text(at_start),
                             reason=f"starting without drained {_drained_text(at_start)}")
                self._record(d, launch)
                at_start = []
            if self.job is not None and cmd != self.cmd:
                self.say(f"generation {self.job.generation} on {', '.join(self.job.members())}: "
                         + " ".join(cmd))
            started = time.time()
            try:
                launch.start()
            except OSError as exc:
                self.say(f"cannot start {self.cmd[0]!r}: {exc}")
                launch.close()
                return 127
            try:
                outcome = self._watch(launch, started)
                if self.job is not None:
                    decision = self._job_decide(launch, started, outcome)
                    self._record(decision, launch)
                else:
                    decision = self._decide(launch, incarnation, restart_base, started, outcome)
            except BaseException as exc:
                self._stop_on_error(launch, exc)
                raise
            finally:
                launch.close()
            if decision.decision == "leave":
                return EXIT_EXCLUDED
            if decision.decision not in RESTARTING:
                # done: the job completed (on many nodes a node whose own part failed still says so by its status)
                return (launch.status or 0) if decision.decision == "done" else (launch.status or 1)
            time.sleep(decision.backoff_s)
            if self._stop_requested is not None:
                self.say("stopped by a signal during the backoff; not restarting")
                return 128 + self._stop_requested
            restart_base += 1 + launch.torchelastic_restarts()
            incarnation += 1

    def _watch(self, launch, started: float) -> dict[str, Any]:
        """Runs one incarnation to its end. A hang verdict while it runs may stop it (policy.hang); a crash verdict
        while torchrun is still tearing down is taken at once (its diagnosis is printed within seconds)."""
        poll = self.policy.verdict.poll_interval_s
        next_check = time.monotonic() + poll
        record: FailureRecord | None = None
        trigger = "exit"
        printed = False
        stop_by: float | None = None
        made: dict[str, Any] | None = None
        next_board = time.monotonic() + poll
        while True:
            rc = launch.poll(0.2)
            if rc is not None:
                break
            now = time.monotonic()
            if self.job is not None and made is None and now >= next_board:
                next_board = now + poll
                made = self.job.made()
                if made is not None and made.get("decision") != "done":
                    # Another node's decision for this generation: this node's part starts with stopping its ranks.
                    self.say(f"the job's decision (made by {made.get('by')}): {made.get('decision')}; stopping "
                             "this node's part of the job")
                    stop_tree(launch.proc.pid, launch.pids(), self.policy.stop_grace_s)
                    continue
            if stop_by is not None and now >= stop_by:
                self.say("the job did not end by itself after its failure: stopping its process tree")
                stop_tree(launch.proc.pid, launch.pids(), self.policy.stop_grace_s)
                stop_by = None
                continue
            if record is not None or now < next_check or self._reachable is False or self._stop_requested:
                continue
            next_check = now + poll
            found = self._failures(started)
            if not found:
                continue
            found = [r for r in found if _key(r) not in self.reported]
            if not found:
                continue
            first = _first_cause(found)
            refused = self._refusal(first)
            if refused:
                self.reported.add(_key(first))
                self.say(f"{first.kind.value} verdict not acted on: {refused}; the job stays supervised",
                         _diagnosis(first))
                continue
            if first.kind is Kind.HANG:
                action = self.policy.action_for(first)
                unsure = first.confidence < self.policy.hang.min_confidence
                if self.policy.hang.decision == "report" or unsure:
                    self.reported.add(_key(first))
                    why = (f"confidence {first.confidence:.2f} < hang.min_confidence "
                           f"{self.policy.hang.min_confidence:.2f}" if unsure else "policy hang.decision: report")
                    self.say(f"hang verdict ({why}): the job keeps running", _diagnosis(first))
                    continue
                record, trigger = first, "hang"
                if self.mode == "auto" and self.policy.hang.decision == "by_action" and action in ("user_fix",
                                                                                                   "investigate"):
                    self.say("the job hangs and needs a person:", _diagnosis(first))
                    printed = True
                self.say(f"hang verdict: {first.root_cause.value} (culprit {_who(first)}): stopping the job "
                         f"(SIGTERM, {self.policy.stop_grace_s:.0f} s grace, SIGKILL)")
                stop_tree(launch.proc.pid, launch.pids(), self.policy.stop_grace_s)
            elif first.confidence < self.policy.hang.min_confidence:
                # A first, unsure verdict (peers' communication errors before the dead rank's exit is known) is
                # often revised within seconds: wait for the job to end and for the sure one (_wait_verdict).
                continue
            else:
                record, trigger = first, "crash_verdict"
                if self.mode == "auto" and self.policy.action_for(first) in ("user_fix", "investigate"):
                    self.say("the job failed and needs a person (not restarting):", _diagnosis(first))
                    printed = True
                stop_by = time.monotonic() + self.policy.stop_grace_s  # torchrun tears down by itself; else we do
        launch.finish()
        return {"rc": launch.rc, "record": record, "trigger": trigger, "printed": printed, "ended": time.time(),
                "job_decision": made}

    def _decide(self, launch, incarnation: int, restart_count: int, started: float, outcome: dict) -> Decision:
        """The decision after an incarnation ended (one node), acted on (hooks) and recorded."""
        decision = self._make_decision(launch, incarnation, restart_count, started, outcome)
        if self._alone and decision.decision in RESTARTING:
            decision.decision = "stop"
            decision.reason = "no job board to agree with the other nodes: a node never restarts a job of many alone"
        self._record(decision, launch)
        if decision.decision == "give_up" and outcome.get("record") is not None and not outcome["printed"]:
            self._emit(_diagnosis(outcome["record"]))
        return decision

    def _make_decision(self, launch, incarnation: int, restart_count: int, started: float, outcome: dict,
                       act: bool = True) -> Decision:
        """This node's decision after an incarnation ended (not yet recorded). ``act=False`` (many nodes): a
        proposal for the job's board: the culprit and drained hosts go into ``exclude_hosts`` and no hook runs."""
        status = launch.status
        record = outcome["record"]
        ended = outcome["ended"]
        base = dict(job_id=self.job_id, incarnation=incarnation, restart_count=restart_count, time=time.time(),
                    trigger=outcome["trigger"], exit_status=status, incarnation_start=round(started, 3),
                    incarnation_end=round(ended, 3))
        if record is None and status == 0:
            return Decision(decision="done", reason="the job completed", **base)
        if self._stop_requested is not None:
            return Decision(decision="stop", reason=f"stopped by {_signame(self._stop_requested)}; not restarting",
                            **base)
        if record is None and self._reachable is False and self.client.healthy():
            self._reachable = True  # the collector came up meanwhile
        if record is None and self._reachable is not False:
            record = self._wait_verdict(started)
        outcome["record"] = record
        if record is not None:
            self.handled.add(_key(record))
            culprit_host = record.culprit.host
            if culprit_host and self.hosts:
                self.hosts.add(culprit_host)
            base.update(failure_id=record.failure_id or None, kind=record.kind.value,
                        root_cause=record.root_cause.value, culprit=asdict(record.culprit))
            onset, detected = record.onset_time, record.detected_time
            base["detection_latency_s"] = round(detected - onset, 3)
            if record.kind is Kind.HANG:
                # Without us the job would sit until the backend's watchdog fired (and then be restarted).
                base["time_saved_s"] = round(max(0.0, onset + self.policy.backend_timeout_s - ended), 1)
            refused = self._refusal(record)
            if refused:
                if not outcome["printed"]:
                    self.say("the verdict:", _diagnosis(record))
                    outcome["printed"] = True
                return Decision(decision="stop", reason=f"verdict not acted on: {refused}", **base)
        if record is None and not (self.mode == "always" and status != 0):
            if status == 0:
                return Decision(decision="done", reason="the job completed", **base)
            if self._reachable is False:
                return Decision(decision="stop", reason="no collector to ask why it failed: never restarting on a "
                                "guess", **base)
            return Decision(decision="stop", reason=f"no verdict within {self.policy.verdict.wait_s:.0f} s: never "
                            "restarting on a guess", **base)
        action = self.policy.action_for(record) if record is not None else None
        base["action"] = action
        hang_restart = record is not None and record.kind is Kind.HANG and self.policy.hang.decision == "restart"
        wants_restart = self.mode == "always" or hang_restart or action in ("auto_restart",
                                                                            "exclude_node_and_restart")
        if not wants_restart:
            if not outcome["printed"] and record is not None:
                self._emit(_diagnosis(record))
                outcome["printed"] = True
            return Decision(decision="stop", reason=f"action {action}: a restart would not fix it; diagnosis above",
                            **base)
        now = time.time()
        left = self._budget_left(now)
        base["restarts_in_window"] = len(self.restart_times)
        if left <= 0:
            b = self.policy.budget
            return Decision(decision="give_up", reason=f"restart budget spent ({b.max_restarts} per "
                            f"{_duration(b.window_s)}); raise budget.max_restarts or --max-restarts", **base)
        backoff = self._backoff()
        d = Decision(decision="restart", reason="", backoff_s=round(backoff, 2), **base)
        if action == "exclude_node_and_restart" and record is not None:
            if act:
                self._exclude(record, d)  # fields validated above (_refusal)
            else:
                d.exclude_hosts = [record.culprit.host] if record.culprit.host else []
                d.excluded = f"host {record.culprit.host}" if record.culprit.host else None
                if self.job is not None and d.exclude_hosts:
                    # A blind restart lands on the broken node again: its rendezvous waits for it (after the
                    # backend's timeout, for a hang).
                    d.time_saved_s = round((d.time_saved_s or 0.0) + RDZV_JOIN_TIMEOUT_S, 1)
            d.decision = "exclude_and_restart"
        if not act and self.job is not None:  # the job's nodes, members and spares: a drained one stays out
            nodes = set(self.job.members()) | {h for h in self.job.state.get("spares") or [] if isinstance(h, str)}
            self.hosts |= nodes
        drained = self.exclude_drained(run_hooks=act)
        if drained and not act and self.job is not None:
            drained = [e for e in drained if e.get("host") in self.hosts]
        if drained:
            d.drained = drained
            d.decision = "exclude_and_restart"
            d.excluded = ", ".join(x for x in (d.excluded, "drained " + _drained_text(drained)) if x)
            if not act:
                hosts = [e["host"] for e in drained if e.get("host")]
                d.exclude_hosts = list(dict.fromkeys((d.exclude_hosts or []) + hosts))
        if act:
            self.restart_times.append(now)
        d.restarts_in_window = len(self.restart_times) + (0 if act else 1)
        d.reason = (f"restart {d.restarts_in_window} of {self.policy.budget.max_restarts} in "
                    f"{_duration(self.policy.budget.window_s)}, after {backoff:.1f} s"
                    + (f", without {d.excluded}" if d.excluded else "")
                    + (f"; saved ~{_duration(d.time_saved_s)} vs " + (
                        "a blind restart (" + (f"the {_duration(self.policy.backend_timeout_s)} backend timeout, then "
                                               if d.kind == Kind.HANG.value else "")
                        + f"{_duration(RDZV_JOIN_TIMEOUT_S)} of rendezvous waiting for the broken node)"
                        if d.exclude_hosts else f"the {_duration(self.policy.backend_timeout_s)} backend timeout")
                       if d.time_saved_s else ""))
        return d

def _key(record: FailureRecord) -> str:
    return record.failure_id or f"{record.kind.value}|{record.root_cause.value}|{record.onset_time}"


def _first_cause(records: list[FailureRecord]) -> FailureRecord:
    """The record to act on: the earliest onset (the engine names one cause per incarnation; revisions keep id)."""
    return min(records, key=lambda r: r.onset_time)


def _diagnosis(record: FailureRecord) -> str:
    return format_failure(record)


def _who(record: FailureRecord) -> str:
    c = record.culprit
    parts = [f"rank {c.rank}" if c.rank is not None else "", f"host {c.host}" if c.host else "",
             f"GPU {c.gpu}" if c.gpu else ""]
    return printable(", ".join(p for p in parts if p) or "unknown")


def _signame(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _duration(seconds: float | None) -> str:
    s = float(seconds or 0)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _drained_text(entries: list[dict[str, Any]]) -> str:
    return ", ".join(e["device_id"] for e in entries)


def _this_host() -> str | None:
    """This host's name as the instrumentation reports it (host.name from OTEL_RESOURCE_ATTRIBUTES, else ...)."""
    try:
        from otel_gpu.instrumentation.launcher import this_host

        return this_host()
    except Exception:  # noqa: BLE001 - unknown host: the drained-device query asks for all hosts
        return None


def _all_gpus() -> list[str]:
    """Indices of the GPUs of this host (NVML when there is one), for CUDA_VISIBLE_DEVICES without the bad one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver: nothing to exclude from
        return []


def _forwarder_token(say) -> str | None:
    """The trusted-forwarder token of ``otel-gpu run`` (receivers.otlp.trusted_forwarders on the collector):
    ``OTEL_GPU_FORWARDER_TOKEN_FILE`` (a file, re-read at start) else ``OTEL_GPU_FORWARDER_TOKEN``; never passed to
    the training command (otel_gpu.instrumentation.launcher.PRIVATE_ENV)."""
    path = os.environ.get("OTEL_GPU_FORWARDER_TOKEN_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.read().strip() or None
        except OSError as exc:
            say(f"cannot read OTEL_GPU_FORWARDER_TOKEN_FILE ({exc.strerror}); decisions are sent without it")
            return None
    return os.environ.get("OTEL_GPU_FORWARDER_TOKEN") or None
