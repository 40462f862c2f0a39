"""Several real hosts on one machine: Linux network namespaces joined by veth links, for multi-node jobs and faults.

Each host is a network namespace with its own addresses, its own ``/sys/class/net`` (real counters, real operstate
and carrier), its own host name (a UTS namespace: ``unshare --uts`` inside ``ip netns exec``), its own ``/etc/hosts``
(``/etc/netns/<ns>/hosts``) and its own working directory. A "switch" namespace holds two bridges:

```
            switch namespace:  br-mgmt (10.77.0.0/24)        br-data (10.77.1.0/24)
                                 |   |   |                     |   |
       node0  eth0 10.77.0.10 ---+   |   |    data0 10.77.1.10 -+   |      (torchrun rendezvous, gloo)
       node1  eth0 10.77.0.11 -------+   |    data0 10.77.1.11 -----+
       agg    eth0 10.77.0.2  -----------+                              (the job's aggregator collector)
```

The management link (``eth0``) carries telemetry (sidecars to the aggregator); the data link (``data0``) carries the
job's traffic, like the separate management and data networks of a GPU cluster. Cutting or rate-limiting a data link
leaves the host's sidecar able to report it. The addresses exist only inside these namespaces: nothing is routed to
or from the machine's own network.

Everything is torn down on :meth:`Cluster.close`, at interpreter exit, on SIGTERM/SIGINT and (in tests) by a fixture
finalizer: every process in every namespace is killed, the namespaces (and with them the veths) are deleted, and the
``/etc/netns`` folders removed. Names carry a per-run prefix (``ogmh-<pid>-<random>``) so that parallel runs never
collide; a run that died without cleaning up (SIGKILL) is swept by the next one (its pid is gone).

Requires root and iproute2 (``ip``, ``tc``) and util-linux ``unshare``; :func:`check_requirements` says what is
missing and how to get it.

Example (root)::

    with Cluster(hosts=2) as bed:
        print(bed.hosts[1].run(["hostname"]).stdout)          # node1
        bed.hosts[1].set_link("data0", up=False)              # a cut cable

Command line: ``python -m otel_gpu.testing.cluster --hosts 2`` (or ``otel-gpu demo --hosts 2``) builds the bed,
runs a 2-rank-per-host job under sidecars and an aggregator, and prints the aggregator's report
(:mod:`otel_gpu.testing.multinode`).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cluster", "Host", "ClusterUnavailable", "check_requirements", "leftovers", "sweep_stale", "PREFIX"]

_logger = logging.getLogger(__name__)

#: Every namespace this module creates starts with this (then ``<pid>-<random>-``).
PREFIX = "ogmh-"
MGMT_NET, DATA_NET = "10.77.0", "10.77.1"
MGMT_IF, DATA_IF = "eth0", "data0"
_NETNS_ETC = Path("/etc/netns")


class ClusterUnavailable(RuntimeError):
    """The machine cannot build the bed (not root, iproute2 or unshare missing, no netns support)."""


def unavailable_reason() -> str | None:
    """Why network-namespace hosts cannot be built here (None: they can); for tests that skip without them."""
    try:
        check_requirements()
    except ClusterUnavailable as exc:
        return str(exc)
    return None


def check_requirements() -> None:
    """Raises :class:`ClusterUnavailable` with what is missing and how to fix it."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("network-namespace hosts need root (ip netns add): run as root, or in CI as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterUnavailable(f"{', '.join(missing)} not found: install iproute2 "
                                 "(apt-get install -y iproute2)")
    if shutil.which("unshare") is None:
        raise ClusterUnavailable("unshare not found: install util-linux (apt-get install -y util-linux)")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise ClusterUnavailable(f"ip netns does not work here: {probe.stderr.strip()}")


def _sh(args: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _namespaces() -> list[str]:
    out = _sh(["ip", "-j", "netns", "list"], check=False)
    try:
        return [n["name"] for n in json.loads(out.stdout or "[]")]
    except ValueError:
        return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces and /etc/netns folders whose name starts with ``prefix`` (a test asserts none survive a run)."""
    found = [n for n in _namespaces() if n.startswith(prefix)]
    if _NETNS_ETC.is_dir():
        found += [f"/etc/netns/{p.name}" for p in _NETNS_ETC.iterdir() if p.name.startswith(prefix)]
    return found


def _ns_pids(netns: str) -> list[int]:
    out = _sh(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.stdout.split() if p.strip().isdigit()]


def _delete_namespace(netns: str) -> None:
    for _ in range(3):
        pids = _ns_pids(netns)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not pids:
            break
        time.sleep(0.1)
    _sh(["ip", "netns", "del", netns], check=False)
    shutil.rmtree(_NETNS_ETC / netns, ignore_errors=True)


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Deletes what runs that died without cleaning up left behind (their creating pid is gone)."""
    swept = []
    names = {n for n in _namespaces() if n.startswith(prefix)}
    if _NETNS_ETC.is_dir():
        names |= {p.name for p in _NETNS_ETC.iterdir() if p.name.startswith(prefix)}
    for name in sorted(names):
        try:
            pid = int(name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            _delete_namespace(name)
            swept.append(name)
    return swept


@dataclass
class Host:
    """One namespace host. ``name`` is its host name (UTS namespace) and its name in every host's /etc/hosts."""

    name: str
    netns: str
    mgmt_addr: str
    data_addr: str | None
    workdir: Path
    cluster: Cluster = field(repr=False)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this host: in its network namespace, with its own host name."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name, *argv]

    def spawn(self, argv: list[str], *, env: dict[str, str] | None = None, log: str | Path | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen:
        """Starts ``argv`` on this host (its own session; output to ``log`` in the host's workdir)."""
        log_path = Path(log) if log is not None else None
        if log_path is not None and not log_path.is_absolute():
            log_path = self.workdir / log_path
        out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115 - closed below
        try:
            proc = subprocess.Popen(self.command(argv), env={**os.environ, **(env or {})}, cwd=cwd or self.workdir,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            if log_path is not None:
                out.close()
        self.cluster._procs.append(proc)
        return proc

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return _sh(self.command(argv), check=check, timeout=timeout)

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _sh(["ip", "-n", self.netns, *args], check=check)

    def set_link(self, iface: str, up: bool) -> float:
        """``ip link set IF down|up`` on this host; returns the time it was done."""
        t = time.time()
        self.ip("link", "set", iface, "up" if up else "down")
        return t

    def degrade(self, iface: str = DATA_IF, rate: str = "20mbit", burst: str = "32kbit",
                latency: str = "400ms") -> float:
        """Rate-limits the host's egress on ``iface`` with a token bucket (``tc qdisc ... tbf``)."""
        t = time.time()
        _sh(["ip", "netns", "exec", self.netns, "tc", "qdisc", "replace", "dev", iface, "root", "tbf", "rate", rate,
             "burst", burst, "latency", latency])
        return t

    def restore(self, iface: str = DATA_IF) -> None:
        _sh(["ip", "netns", "exec", self.netns, "tc", "qdisc", "del", "dev", iface, "root"], check=False)

    def counters(self, iface: str) -> dict[str, int]:
        """The interface's byte and packet counters (the kernel's, as ``/sys/class/net/IF/statistics`` has them)."""
        out = json.loads(self.ip("-s", "-j", "link", "show", "dev", iface).stdout)[0]
        stats = out.get("stats64") or out.get("stats") or {}
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}

    def operstate(self, iface: str) -> str:
        return json.loads(self.ip("-j", "link", "show", "dev", iface).stdout)[0].get("operstate", "UNKNOWN")

    def pids(self) -> list[int]:
        """Every process running in this host's network namespace."""
        return _ns_pids(self.netns)

    def kill_all(self, sig: int = signal.SIGKILL) -> tuple[float, list[int]]:
        """Kills every process of this host at once, as a power-off would; returns (when, pids)."""
        pids = self.pids()
        t = time.time()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return t, pids


class Cluster:
    """``hosts`` namespace hosts (2..8) ``node0..`` with a management and a data link each, and, with
    ``aggregator_host``, a host ``agg`` on the management network only (where the job's aggregator runs)."""

    def __init__(self, hosts: int = 2, *, aggregator_host: bool = True, root: str | Path | None = None):
        if not 1 <= hosts <= 8:
            raise ValueError(f"hosts must be 1..8 (got {hosts})")
        self.n_hosts = hosts
        self.aggregator_host = aggregator_host
        self.prefix = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}-"
        self._own_root = root is None
        self.root = Path(root) if root is not None else Path(f"/tmp/{self.prefix.rstrip('-')}")
        self.hosts: list[Host] = []
        self.agg: Host | None = None
        self.switch = self.prefix + "switch"
        self._procs: list[subprocess.Popen] = []
        self._created: list[str] = []
        self._closed = False
        self._lock = threading.Lock()
        self._previous_handlers: dict[int, object] = {}

    # -- lifecycle ----------------------------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> Cluster:
        check_requirements()
        sweep_stale()
        self.root.mkdir(parents=True, exist_ok=True)
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _ns(self, name: str) -> str:
        netns = self.prefix + name
        _sh(["ip", "netns", "add", netns])
        self._created.append(netns)
        _sh(["ip", "-n", netns, "link", "set", "lo", "up"])
        return netns

    def _build(self) -> None:
        sw = self._ns("switch")
        for br in ("br-mgmt", "br-data"):
            _sh(["ip", "-n", sw, "link", "add", br, "type", "bridge"])
            _sh(["ip", "-n", sw, "link", "set", br, "up"])
        specs = [(f"node{i}", f"{MGMT_NET}.{10 + i}", f"{DATA_NET}.{10 + i}") for i in range(self.n_hosts)]
        if self.aggregator_host:
            specs.append(("agg", f"{MGMT_NET}.2", None))
        for idx, (name, mgmt, data) in enumerate(specs):
            netns = self._ns(name)
            links = [(MGMT_IF, mgmt, "br-mgmt", f"m{idx}")]
            if data is not None:
                links.append((DATA_IF, data, "br-data", f"d{idx}"))
            for ifname, addr, bridge, peer in links:
                # Both ends are created inside their namespaces: no name ever exists in the machine's own namespace.
                _sh(["ip", "link", "add", ifname, "netns", netns, "type", "veth", "peer", "name", peer, "netns", sw])
                _sh(["ip", "-n", netns, "addr", "add", f"{addr}/24", "dev", ifname])
                _sh(["ip", "-n", netns, "link", "set", ifname, "up"])
                _sh(["ip", "-n", sw, "link", "set", peer, "master", bridge])
                _sh(["ip", "-n", sw, "link", "set", peer, "up"])
            workdir = self.root / name
            workdir.mkdir(parents=True, exist_ok=True)
            host = Host(name, netns, mgmt, data, workdir, self)
            if name == "agg":
                self.agg = host
            else:
                self.hosts.append(host)
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        for h in self.all_hosts:
            lines.append(f"{h.data_addr or h.mgmt_addr} {h.name}")
            lines.append(f"{h.mgmt_addr} {h.name}-mgmt")
        for h in self.all_hosts:
            etc = _NETNS_ETC / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")
            (etc / "hostname").write_text(h.name + "\n")

    @property
    def all_hosts(self) -> list[Host]:
        return self.hosts + ([self.agg] if self.agg is not None else [])

    def host(self, name: str) -> Host:
        return next(h for h in self.all_hosts if h.name == name)

    def close(self) -> None:
        """Kills every process, deletes every namespace (and so every veth) and /etc/netns folder. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self._procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for netns in reversed(self._created):
            _delete_namespace(netns)
        for netns in leftovers(self.prefix):  # anything half-made by a failed _build
            _delete_namespace(netns.rsplit("/", 1)[-1])
        if self._own_root and not os.environ.get("OTEL_GPU_BED_KEEP"):
            shutil.rmtree(self.root, ignore_errors=True)  # logs and stores; OTEL_GPU_BED_KEEP=1 keeps them
        self._restore_signal_handlers()
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001
            pass

    # -- signals: tear down on Ctrl-C and SIGTERM, then behave as before ---------------------------------------------
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous_handlers.items():
            try:
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                pass
        self._previous_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        previous = self._previous_handlers.get(signum)
        self.close()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from otel_gpu.testing import multinode

    return multinode.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
