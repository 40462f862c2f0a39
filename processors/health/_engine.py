"""The health engine: per-device counters, rates against each device's own baseline, and the scoring rules.

Plain data in, plain data out (no OTLP types), so the rules can be tested, replayed and benchmarked alone. Every rule
is a function of what one device showed; README.md states them in words with the sources of their thresholds.

Memory per device is fixed: one small ring of per-minute counts per signal (``short_window_s / 60`` floats; an hour
for link flaps), a baseline and a few flags. Devices beyond ``max_devices`` are forgotten least recently seen first.

Example:
    >>> from otel_gpu.processors.health.config import HealthConfig
    >>> from otel_gpu.schema.health import DeviceKind
    >>> eng = HealthEngine(HealthConfig(warmup_s=0))
    >>> gpu = eng.gpu("node1", "GPU-1", 0.0)
    >>> eng.flag(gpu, "remap_failure", 1, 5.0)
    >>> [(c.device.id, c.previous, c.state.value) for c in eng.evaluate(10.0)]
    [('gpu:GPU-1', None, 'drain'), ('node:node1', None, 'drain')]
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from otel_gpu.schema.health import STATE_RANK, DeviceKind, DeviceState, device_id

__all__ = ["Device", "HealthEngine", "RuleHit", "StateChange", "XID_DRAIN", "XID_WATCH", "XID_APP"]

_BUCKET_S = 60.0
_VOLATILE_ECC = frozenset({"ecc_corrected", "ecc_uncorrected"})
_HOUR_BUCKETS = 60

#: XID classes (NVIDIA's Xid catalog "Resolution Bucket (Immediate Action)", NVIDIA Health Validation's Xid checks,
#: Meta gcm's critical list). Drain: the GPU needs a reset or service before it runs a job again.
XID_DRAIN = frozenset({46, 48, 62, 64, 79, 95, 119, 120, 136, 140, 143, 154, 155, 156, 158})
#: Watch: hardware that the running job may survive (pending remap, NVLink error, high single-bit rate, contained ECC).
XID_WATCH = frozenset({63, 74, 92, 94})
#: Application-caused (the app restarts, the node stays): never counted against the device.
XID_APP = frozenset({13, 31, 43, 45})

_W, _D, _H = DeviceState.WATCH, DeviceState.DRAIN, DeviceState.HEALTHY

# Rule name -> weight in the score (0..100). The state is the most severe of the rules that hold.
WEIGHTS = {
    "row_remap_failure": 100, "ecc_uncorrected": 90, "xid_drain": 90, "nvlink_down": 70, "recurring_culprit": 80,
    "ecc_corrected_rate": 40, "pcie_replay_rate": 30, "nvlink_errors_rate": 30, "nic_errors_rate": 30,
    "nic_link_flaps": 40, "xid_watch": 30, "remap_pending": 25, "retired_pages": 20, "remapped_rows": 20,
    "hw_throttle": 15, "member_drain": 60, "member_watch": 20, "recurrence": 25,
}


@dataclass(frozen=True)
class RuleHit:
    rule: str
    state: DeviceState
    evidence: str


@dataclass
class StateChange:
    device: "Device"
    previous: DeviceState | None  # None: first seen
    state: DeviceState
    time: float


class Rate:
    """Increments of a cumulative counter per minute over a ring (the window), and the device's baseline per minute.

    An increment seen after a gap of several minutes (a counter read every few minutes) is spread over the minutes
    it covers. A minute is folded into the baseline when it leaves the window, so the window being judged is never
    part of its own baseline. A counter that goes down was reset (driver reload, receiver restart): the new value is
    the start again.
    """

    __slots__ = ("last", "last_t", "ring", "minute", "baseline", "learned", "total", "warm", "last_inc_t")

    def __init__(self, buckets: int, warm: int = 30):
        self.last: float | None = None
        self.last_t = 0.0
        self.ring = array("f", bytes(4 * buckets))
        self.minute = -1  # the minute the newest bucket counts
        self.baseline = 0.0  # expected increments per minute
        self.learned = 0  # minutes folded into the baseline
        self.total = 0.0  # increments seen since first sight
        self.warm = warm  # minutes learned as a plain mean; after them a minute counts at most 3x the baseline
        self.last_inc_t: float | None = None  # when it last rose

    def _fold(self, done: float, alpha: float) -> None:
        if self.learned >= self.warm:  # a burst or the start of a climb must not drag the baseline up
            done = min(done, max(3.0 * self.baseline, 3.0))
        self.learned += 1
        self.baseline += max(alpha, 1.0 / self.learned) * (done - self.baseline)

    def _roll(self, minute: int, alpha: float, learn: bool) -> None:
        if self.minute < 0:
            self.minute = minute
            return
        n = len(self.ring)
        steps = minute - self.minute
        if steps <= 0:
            return
        for k in range(1, min(steps, n) + 1):
            i = (self.minute + k) % n  # the bucket of the minute that leaves the window, reused for a new one
            if learn:
                self._fold(self.ring[i], alpha)
            self.ring[i] = 0.0
        if learn and steps > n:  # a long gap: its quiet minutes count as quiet
            for _ in range(min(steps - n, 24 * 60)):
                self._fold(0.0, alpha)
        self.minute = minute

    def _put(self, inc: float, t0: float, t: float) -> None:
        n = len(self.ring)
        m0, m1 = int(t0 // _BUCKET_S), int(t // _BUCKET_S)
        m0 = max(m0, m1 - n + 1, self.minute - n + 1)
        share = inc / (m1 - m0 + 1)
        for m in range(m0, m1 + 1):
            self.ring[m % n] += share
        self.total += inc

    def update(self, value: float, t: float, alpha: float, learn: bool, count_first: bool = False) -> float:
        """Takes a new cumulative ``value`` at ``t``; returns the increment."""
        self._roll(int(t // _BUCKET_S), alpha, learn)
        last, self.last = self.last, value
        last_t, self.last_t = self.last_t, t
        if last is None:
            inc = value if count_first and value > 0 else 0.0
            last_t = t
        elif value >= last:
            inc = value - last
        else:
            inc = value  # reset: counting again from 0
            self.last_inc_t = None
        if inc:
            self._put(inc, last_t, t)
            self.last_inc_t = t
        return inc

    def add(self, n: float, t: float, alpha: float, learn: bool) -> None:
        self._roll(int(t // _BUCKET_S), alpha, learn)
        self._put(n, t, t)

    def thirds(self) -> tuple[float, float, float]:
        """Counts in the oldest, middle and newest third of the window (as of the last roll)."""
        n = len(self.ring)
        ordered = [self.ring[(self.minute - n + 1 + k) % n] for k in range(n)]
        a, b = n // 3, 2 * n // 3
        return float(sum(ordered[:a])), float(sum(ordered[a:b])), float(sum(ordered[b:]))

    def window(self, t: float, alpha: float, learn: bool) -> float:
        """Increments in the ring's window ending now."""
        self._roll(int(t // _BUCKET_S), alpha, learn)
        return float(sum(self.ring))


@dataclass
class Device:
    """One device's identity, signals and verdict."""

    id: str
    kind: DeviceKind
    host: str
    first_seen: float
    last_seen: float
    uuid: str | None = None
    serial: str | None = None
    gpu_index: int | None = None
    pci_bus_id: str | None = None
    port: str | None = None
    guid: str | None = None
    rates: dict[str, Rate] = field(default_factory=dict)
    flags: dict[str, float] = field(default_factory=dict)  # gauges: remap_failure, remap_pending, ...
    flag_since: dict[str, float] = field(default_factory=dict)
    events: list[tuple[float, str, int]] = field(default_factory=list)  # (time, rule, code) of XIDs, newest last
    state: DeviceState = DeviceState.HEALTHY
    since: float = 0.0
    score: int = 0
    hits: list[RuleHit] = field(default_factory=list)
    last_hit: float = float("-inf")  # last time a watch or drain rule held
    last_drain: float = float("-inf")  # last time a drain rule held
    recurrence: dict[str, Any] | None = None  # {"failures", "jobs", "first", "last"} from the store
    members: set[str] = field(default_factory=set)  # a node: its GPUs and ports
    announced: bool = False  # its first state went out (a first-seen event tells the store its identity)

    def describe(self) -> dict[str, Any]:
        return {"device_id": self.id, "kind": self.kind.value, "host": self.host, "uuid": self.uuid,
                "serial": self.serial, "gpu_index": self.gpu_index, "pci_bus_id": self.pci_bus_id, "port": self.port,
                "guid": self.guid, "state": self.state.value, "since": round(self.since, 3), "score": self.score,
                "rules": [h.rule for h in self.hits], "evidence": [h.evidence for h in self.hits],
                "first_seen": round(self.first_seen, 3), "last_seen": round(self.last_seen, 3)}


def _fmt(x: float) -> str:
    return f"{x:.0f}" if x >= 10 or x == int(x) else f"{x:.2g}"


class HealthEngine:
    """Keeps devices, takes observations, and evaluates the rules.

    ``settings`` is a HealthConfig (any object with its attributes).
    """

    def __init__(self, settings: Any):
        self.s = settings
        self.devices: OrderedDict[str, Device] = OrderedDict()
        self.short_buckets = max(1, int(round(settings.short_window_s / _BUCKET_S)))
        self.alpha = 1.0 - 0.5 ** (_BUCKET_S / settings.baseline_half_life_s)
        self.forgotten = 0
        self.warm_buckets = max(1, int(settings.warmup_s // _BUCKET_S))

    # -- devices ---------------------------------------------------------------------------------------------------
    def device(self, kind: DeviceKind, host: str, t: float, *, uuid: str | None = None,
               port: str | None = None) -> Device:
        did = device_id(kind, host=host, uuid=uuid, port=port)
        dev = self.devices.get(did)
        if dev is None:
            dev = Device(did, kind, host, t, t, uuid=uuid, port=port, since=t)
            self.devices[did] = dev
            if kind is not DeviceKind.NODE:
                self.device(DeviceKind.NODE, host, t).members.add(did)
            while len(self.devices) > self.s.max_devices:
                self.devices.popitem(last=False)
                self.forgotten += 1
        else:
            if dev.last_seen < t:
                dev.last_seen = t
            self.devices.move_to_end(did)
        return dev

    def gpu(self, host: str, uuid: str, t: float, index: int | None = None, pci: str | None = None,
            serial: str | None = None) -> Device:
        dev = self.device(DeviceKind.GPU, host, t, uuid=uuid)
        if index is not None:
            dev.gpu_index = index
        if pci:
            dev.pci_bus_id = pci
        if serial:
            dev.serial = serial
        return dev

    def _rate(self, dev: Device, name: str, buckets: int | None = None) -> Rate:
        r = dev.rates.get(name)
        if r is None:
            r = dev.rates[name] = Rate(buckets or self.short_buckets, self.warm_buckets)
        return r

    def _learning(self, dev: Device, name: str) -> bool:
        return not any(h.rule == name for h in dev.hits)

    # -- observations ----------------------------------------------------------------------------------------------
    def counter(self, dev: Device, name: str, value: float, t: float, *, hour: bool = False,
                count_first: bool = False) -> float:
        """A cumulative counter reading of ``dev`` (e.g. ecc_corrected, pcie_replay, nic_errors, link_downed)."""
        r = self._rate(dev, name, _HOUR_BUCKETS if hour else None)
        if name in _VOLATILE_ECC and r.last is not None and value < r.last:
            # volatile ECC counters go back to 0 only when the driver reloads or the GPU is reset: the faults that
            # asked for that reset are dealt with
            dev.events = [e for e in dev.events if e[1] != "xid_drain"]
            unc = dev.rates.get("ecc_uncorrected")
            if unc is not None:
                unc.last_inc_t = None
        return r.update(value, t, self.alpha, self._learning(dev, name + "_rate"), count_first)

    def count(self, dev: Device, name: str, n: float, t: float, *, hour: bool = False) -> None:
        """Adds ``n`` events to a signal (e.g. a sample with a hardware clock event)."""
        self._rate(dev, name, _HOUR_BUCKETS if hour else None).add(n, t, self.alpha, True)

    def flag(self, dev: Device, name: str, value: float, t: float) -> None:
        """A gauge whose non-zero value is a condition (remap_failure, remap_pending, nvlink_down, ...)."""
        old = dev.flags.get(name, 0.0)
        dev.flags[name] = value
        if value and not old:
            dev.flag_since[name] = t
        elif not value:
            dev.flag_since.pop(name, None)

    def xid(self, dev: Device, code: int, t: float) -> None:
        if code in XID_DRAIN:
            rule = "xid_drain"
        elif code in XID_WATCH:
            rule = "xid_watch"
        else:
            return  # application-caused or unknown: not the device's fault
        dev.events.append((t, rule, code))
        del dev.events[:-32]

    def set_recurrence(self, did: str, info: dict[str, Any] | None) -> None:
        dev = self.devices.get(did)
        if dev is not None:
            dev.recurrence = info

    # -- rules -----------------------------------------------------------------------------------------------------
    def _rate_rule(self, dev: Device, name: str, rule: str, label: str, t: float, out: list[RuleHit]) -> None:
        """Watch / drain when the window's count reaches its threshold *and* the excess is spread over time: the
        count without its largest minute reaches the threshold, and at least two of the window's three thirds hold a
        sixth of it each, so that one burst (many errors in a minute, then quiet) is not a trend."""
        r = dev.rates.get(name)
        if r is None or t - dev.first_seen < self.s.warmup_s:
            return
        learn = self._learning(dev, rule)
        n = r.window(t, self.alpha, learn)
        if n < self.s.watch_min_count:
            return
        expected = r.baseline * len(r.ring)
        minutes = len(r.ring)
        thirds = r.thirds()
        trimmed = n - max(r.ring)
        base = f"baseline {_fmt(expected)}/{minutes} min"
        ratio = f", {n / expected:.0f}x" if expected > 0 else ""
        for state, factor, least in ((_D, self.s.drain_factor, self.s.drain_min_count),
                                     (_W, self.s.watch_factor, self.s.watch_min_count)):
            threshold = max(least, factor * expected)
            if trimmed >= threshold and sum(1 for c in thirds if c >= threshold / 6) >= 2:
                out.append(RuleHit(rule, state, f"{label}: {_fmt(n)} in {minutes} min ({base}{ratio}) >= "
                                                f"{state.value} {_fmt(threshold)}"))
                return

    def _new_since_warmup(self, dev: Device, name: str, rule: str, label: str, state: DeviceState, t: float,
                          out: list[RuleHit]) -> None:
        """Any increase within the window (counted from first sight, so old totals never count)."""
        r = dev.rates.get(name)
        if r is None:
            return
        n = r.window(t, self.alpha, True)
        if n > 0:
            out.append(RuleHit(rule, state, f"{label}: +{_fmt(n)} in {len(r.ring)} min"))

    def _gpu_rules(self, dev: Device, t: float, out: list[RuleHit]) -> None:
        f, since = dev.flags, dev.flag_since
        if f.get("remap_failure"):
            out.append(RuleHit("row_remap_failure", _D, f"row remap failure (XID 64 class; service required) since "
                                                        f"@{since.get('remap_failure', t):.0f}"))
        unc = dev.rates.get("ecc_uncorrected")
        if unc is not None and unc.last_inc_t is not None and t - unc.last_inc_t < self.s.fault_hold_s:
            out.append(RuleHit("ecc_uncorrected", _D, f"uncorrectable ECC errors: +{_fmt(unc.total)} since first "
                                                      f"seen, last @{unc.last_inc_t:.0f}"))
        if f.get("nvlink_down"):
            out.append(RuleHit("nvlink_down", _D, f"{int(f['nvlink_down'])} NVLink link(s) went down "
                                                  f"@{since.get('nvlink_down', t):.0f}"))
        for rule, state in (("xid_drain", _D), ("xid_watch", _W)):
            hold = self.s.fault_hold_s if state is _D else self.s.clear_after_s
            recent = [(et, code) for et, r, code in dev.events if r == rule and t - et <= hold]
            if recent:
                codes = ",".join(str(c) for c in sorted({c for _, c in recent}))
                out.append(RuleHit(rule, state, f"XID {codes} ({len(recent)}x, last @{recent[-1][0]:.0f})"))
        if f.get("remap_pending") or f.get("retired_pending"):
            which = "row remap" if f.get("remap_pending") else "page retirement"
            when = since.get("remap_pending", since.get("retired_pending", t))
            out.append(RuleHit("remap_pending", _W, f"{which} pending (GPU reset needed) since @{when:.0f}"))
        self._new_since_warmup(dev, "retired_pages", "retired_pages", "pages retired", _W, t, out)
        self._new_since_warmup(dev, "remapped_rows_uncorrectable", "remapped_rows", "rows remapped (uncorrectable)",
                               _W, t, out)
        self._rate_rule(dev, "ecc_corrected", "ecc_corrected_rate", "correctable ECC errors", t, out)
        self._rate_rule(dev, "pcie_replay", "pcie_replay_rate", "PCIe replays", t, out)
        self._rate_rule(dev, "nvlink_errors", "nvlink_errors_rate", "NVLink CRC/replay/recovery errors", t, out)
        samples, throttled = dev.rates.get("samples"), dev.rates.get("hw_throttle")
        if samples is not None and throttled is not None:
            n, k = samples.window(t, self.alpha, True), throttled.window(t, self.alpha, True)
            if n >= 3 and k / n >= self.s.throttle_watch_fraction:
                out.append(RuleHit("hw_throttle", _W, f"hardware clock slowdown (thermal/power brake) in "
                                                      f"{k / n:.0%} of samples over {len(samples.ring)} min"))

    def _nic_rules(self, dev: Device, t: float, out: list[RuleHit]) -> None:
        flaps = dev.rates.get("link_downed")
        if flaps is not None:
            n = flaps.window(t, self.alpha, True)
            if n >= self.s.flaps_drain:
                out.append(RuleHit("nic_link_flaps", _D, f"link went down {_fmt(n)} times in 60 min >= drain "
                                                         f"{self.s.flaps_drain}"))
            elif n >= self.s.flaps_watch:
                out.append(RuleHit("nic_link_flaps", _W, f"link went down {_fmt(n)} times in 60 min >= watch "
                                                         f"{self.s.flaps_watch}"))
        self._rate_rule(dev, "nic_errors", "nic_errors_rate", "symbol/link-recovery/receive errors", t, out)

    def _recurrence_rules(self, dev: Device, out: list[RuleHit]) -> None:
        info = dev.recurrence
        if not info:
            return
        n = int(info.get("failures") or 0)
        jobs = info.get("jobs") or []
        text = (f"culprit of {n} failure{'s' if n != 1 else ''} in {len(jobs)} job{'s' if len(jobs) != 1 else ''} "
                f"({', '.join(map(str, jobs[:5]))}{', ...' if len(jobs) > 5 else ''}) since "
                f"@{float(info.get('first') or 0):.0f}")
        if n >= self.s.recurrence_drain:
            out.append(RuleHit("recurring_culprit", _D, text))
        elif n >= self.s.recurrence_watch:
            out.append(RuleHit("recurrence", _W, text))

    def evaluate(self, t: float) -> list[StateChange]:
        """Applies the rules to every device; returns the state changes (nodes after their members)."""
        changes: list[StateChange] = []
        nodes = []
        for dev in self.devices.values():
            if dev.kind is DeviceKind.NODE:
                nodes.append(dev)
                continue
            hits: list[RuleHit] = []
            if dev.kind is DeviceKind.GPU:
                self._gpu_rules(dev, t, hits)
            else:
                self._nic_rules(dev, t, hits)
            self._recurrence_rules(dev, hits)
            self._verdict(dev, hits, t, changes)
        for node in nodes:
            hits = []
            for mid in sorted(node.members):
                member = self.devices.get(mid)
                if member is None or member.state is _H:
                    continue
                rule = "member_drain" if member.state is _D else "member_watch"
                why = member.hits[0].evidence if member.hits else "still within its clear_after_s"
                hits.append(RuleHit(rule, member.state, f"{mid} is {member.state.value}: {why}"))
            self._recurrence_rules(node, hits)
            self._verdict(node, hits, t, changes)
        return changes

    def _verdict(self, dev: Device, hits: list[RuleHit], t: float, changes: list[StateChange]) -> None:
        """The most severe rule decides; a device steps down only after ``clear_after_s`` without a rule of its
        current severity (the evidence that put it there stays shown meanwhile)."""
        worst = max((h.state for h in hits), key=STATE_RANK.__getitem__, default=_H)
        if worst is _D:
            dev.last_drain = dev.last_hit = t
        elif worst is _W:
            dev.last_hit = t
        if hits and STATE_RANK[worst] >= STATE_RANK[dev.state]:
            dev.hits = sorted(hits, key=lambda h: (-STATE_RANK[h.state], -WEIGHTS.get(h.rule, 0)))
            dev.score = min(100, sum(WEIGHTS.get(h.rule, 10) for h in hits))
        if STATE_RANK[worst] < STATE_RANK[dev.state]:
            held = dev.last_drain if dev.state is _D else dev.last_hit
            if t - held < self.s.clear_after_s:
                return
            if hits:
                dev.hits = sorted(hits, key=lambda h: (-STATE_RANK[h.state], -WEIGHTS.get(h.rule, 0)))
                dev.score = min(100, sum(WEIGHTS.get(h.rule, 10) for h in hits))
            else:
                dev.hits, dev.score = [], 0
        if not dev.announced:
            dev.announced = True
            changes.append(StateChange(dev, None, worst, t))
            dev.state, dev.since = worst, t
        elif worst is not dev.state:
            changes.append(StateChange(dev, dev.state, worst, t))
            dev.state, dev.since = worst, t

    # -- state from the store (collector restart) ------------------------------------------------------------------
    def restore(self, rows: list[dict[str, Any]], t: float) -> int:
        """Takes the last known state of devices from the store, so that a restart neither forgets a drain nor
        announces it again. Returns how many were restored."""
        n = 0
        for row in rows:
            try:
                kind = DeviceKind(row.get("kind"))
                state = DeviceState(row.get("state") or "healthy")
            except ValueError:
                continue
            host = str(row.get("host") or "")
            if not host:
                continue
            dev = self.device(kind, host, t, uuid=row.get("uuid"), port=row.get("port"))
            if dev.id != row.get("device_id"):
                continue
            dev.state, dev.since, dev.announced = state, float(row.get("since") or t), True
            dev.serial, dev.gpu_index = row.get("serial") or dev.serial, row.get("gpu_index", dev.gpu_index)
            dev.pci_bus_id = row.get("pci_bus_id") or dev.pci_bus_id
            dev.score = int(row.get("score") or 0)
            dev.hits = [RuleHit(str(r), state, str(e)) for r, e in zip(row.get("rules") or [],
                                                                       row.get("evidence") or [])]
            if state is not _H:
                dev.last_hit = t
            if state is _D:
                dev.last_drain = t  # held until quiet for clear_after_s from now
            rec = row.get("failures")
            if isinstance(rec, dict) and rec.get("failures"):
                dev.recurrence = rec
            n += 1
        return n
