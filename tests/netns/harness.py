"""Hosts on one machine: each a Linux network namespace with its own address,
joined by a bridge in a namespace of its own (the "switch"), for faults that
loopback never shows -- a host dropping off the network without a TCP reset.

    with NetnsHarness(["sched", "gw0", "eng0", "client"]) as net:
        net.hosts["sched"].spawn([...], log)     # a process on that host
        net.cut("eng0")                          # silent partition: no RST, no FIN
        net.heal("eng0")
        net.add_host("eng0b")                    # one more host, a new address
        net.hosts["eng0b"].write_etc("resolv.conf", "nameserver ...\n")  # its /etc/resolv.conf

Layout: the switch namespace holds bridge `br0`; each host namespace holds
`eth0` (its address, a /24) whose veth peer `p-<host>` is a port of `br0`,
and a permanent neighbour entry for every other host (no ARP, see
`_add_neighbours`).
Nothing of the test network is in the root namespace: the switch has no
uplink, so a packet of the test range can only reach another test host.

Safety rules, each enforced here and tested (tests/netns/test_netns_safety.py):
  (a) before any host exists, the root namespace gets a blackhole route for
      this run's range (one /24 of 198.18.0.0/15, RFC 2544's benchmarking
      block, picked under a lock so parallel runs never share one): anything
      the root namespace sends there is refused at once, never routed out;
  (b) host namespaces have no default route (IPv4 or IPv6): asserted after
      the hosts are built and again by `assert_safe`;
  (c) every address a config uses is one of the harness's hosts (loopback
      stays inside its namespace): `check_addresses`, run on every config
      before anything starts;
  (d) everything is torn down when the `with` block ends, also on failure
      or KeyboardInterrupt: processes (SIGTERM, then SIGKILL, each bounded),
      anything left running in the namespaces, the namespaces (their veths,
      the bridge and any nftables tables go with them), their /etc/netns
      files (`Host.write_etc`), the route. A crashed earlier run's
      leftovers (namespaces and routes named for a process that no longer
      exists) are removed before a new run starts.

Names: namespaces `kvm14-<pid>-<seq>-<host>`; routes are tagged with
protocol 214 and carry the owner's pid as their metric. Every wait and every
`ip` call is bounded. A partition sets the host's switch port down: the host
keeps its address and its processes run on, but no frame crosses the bridge
either way, and neither side's kernel reports anything (no RST, no FIN, no
"host unreachable"): both sides see silence until their keepalives expire.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar, cast

__all__ = [
    "PREFIX",
    "TEST_RANGE",
    "HarnessError",
    "Host",
    "NetnsHarness",
    "check_addresses",
    "clean_stale",
    "netns_unavailable",
]

T = TypeVar("T")

PREFIX = "kvm14-"
# RFC 2544: reserved for benchmarking network devices, never routed on the internet.
TEST_RANGE = ipaddress.ip_network("198.18.0.0/15")
# Marks the harness's blackhole routes (an unassigned routing protocol number).
ROUTE_PROTO = "214"
SWITCH = "sw"
LOCK_PATH = Path("/run/lock/kvm14-netns.lock") if Path("/run/lock").is_dir() else Path("/tmp/kvm14-netns.lock")
IP_TIMEOUT = 10.0
STOP_GRACE = 10.0
# Per-namespace files `ip netns exec` bind-mounts over /etc/<name> for the
# process it starts (resolv.conf, hosts): a host's own DNS view.
ETC_NETNS = Path("/etc/netns")

_NS_RE = re.compile(rf"^{re.escape(PREFIX)}(\d+)-(\d+)-([a-z0-9]+)$")
_SEQ = itertools.count()
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class HarnessError(RuntimeError):
    """The harness could not build, check or tear down its network."""


def ip(*args: str, ns: str | None = None, check: bool = True) -> str:
    """Run `ip [-n ns] args...` (bounded); its stdout."""
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT, check=False)
    if check and proc.returncode != 0:
        raise HarnessError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def netns_unavailable() -> str | None:
    """Why this machine cannot run the harness, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    try:
        ip("netns", "list")
        ip("link", "help", check=False)
    except (HarnessError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` is unavailable: {exc}"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def _our_routes() -> list[tuple[str, int]]:
    """(prefix, owner pid) of every harness blackhole route in the root namespace."""
    routes = []
    for line in ip("-4", "route", "show", "type", "blackhole", "proto", ROUTE_PROTO).splitlines():
        m = re.search(r"(\d+\.\d+\.\d+\.\d+/\d+).*metric (\d+)", line)
        if m:
            routes.append((m.group(1), int(m.group(2))))
    return routes


_ROUTE_TYPES = {"unicast", "local", "broadcast", "multicast", "anycast", "blackhole", "unreachable",
                "prohibit", "throw", "nat"}


def _route_prefix(line: str) -> ipaddress.IPv4Network:
    """The destination of one `ip route` line ("[type] PREFIX ...")."""
    words = line.split()
    dest = words[1] if words[0] in _ROUTE_TYPES else words[0]
    return ipaddress.IPv4Network(dest, strict=False)


def _kill_pids_in(ns: str) -> None:
    """SIGKILL whatever still runs in one of the harness's namespaces."""
    for pid in ip("netns", "pids", ns, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def clean_stale() -> list[str]:
    """Remove namespaces and routes of harness runs whose process is gone;
    what was removed. A live run's (this process included) are kept."""
    removed = []
    for ns in _namespaces():
        m = _NS_RE.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_pids_in(ns)
            ip("netns", "del", ns, check=False)
            removed.append(ns)
    for folder in ETC_NETNS.glob(f"{PREFIX}*") if ETC_NETNS.is_dir() else ():
        m = _NS_RE.match(folder.name)
        if m and not _alive(int(m.group(1))):
            _remove_etc(folder.name)
            removed.append(str(folder))
    for prefix, pid in _our_routes():
        if not _alive(pid):
            ip("route", "del", "blackhole", prefix, "proto", ROUTE_PROTO, "metric", str(pid), check=False)
            removed.append(f"route {prefix}")
    return removed


def _remove_etc(ns: str) -> None:
    """Remove /etc/netns/<ns> (and /etc/netns once empty: made for the harness)."""
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()


def _setns(ns: str) -> None:
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def call_in_netns(ns: str, fn: Callable[[], T], timeout: float) -> T:
    """fn() on a fresh thread that has joined namespace `ns` (setns is per
    thread on Linux, so nothing else of this process moves). Sockets fn
    opens live on that host; threads fn starts inherit its namespace; gRPC's
    own C threads do not, so fn must not use grpc. Bounded by `timeout`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            _setns(ns)
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"netns-{ns}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"call in {ns} still running after {timeout} s")
    if "error" in box:
        raise box["error"]
    return cast(T, box["value"])


@dataclass
class Host:
    """One host: a namespace with `address` on eth0, a port on the switch."""

    name: str
    ns: str
    address: str
    port: str  # its veth peer in the switch namespace
    mac: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, argv: Sequence[str], log: IO[bytes], env: Mapping[str, str] | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen[bytes]:
        """Start argv on this host (`ip netns exec`), in a session of its own
        so the harness can stop it and its children by its id."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=dict(env) if env is not None else None,
                                cwd=cwd, start_new_session=True)
        self.procs.append(proc)
        return proc

    def write_etc(self, name: str, text: str) -> Path:
        """/etc/netns/<ns>/<name>: what a process started on this host (by
        `spawn` or `run`: `ip netns exec`) sees as /etc/<name>, e.g. its own
        resolv.conf or hosts. Removed with the namespace on teardown."""
        folder = ETC_NETNS / self.ns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
        return folder / name

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """fn() with this host's network (see `call_in_netns`)."""
        return call_in_netns(self.ns, fn, timeout)

    def run(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A short command on this host, bounded."""
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True,
                              timeout=timeout, check=False)


def _stop(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM each process group (ours: started with a session of their own), then SIGKILL after `grace`."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


class NetnsHarness:
    """Hosts named `names` (lowercase letters and digits) on one bridge; a
    context manager: enter builds the network, exit tears it all down."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not all(re.fullmatch(r"[a-z0-9]{1,10}", n) for n in names):
            raise HarnessError(f"host names must be unique, 1-10 lowercase letters/digits: {names}")
        if SWITCH in names:
            raise HarnessError(f"{SWITCH!r} is the switch's name")
        self.names = list(names)
        self.run_prefix = f"{PREFIX}{os.getpid()}-{next(_SEQ)}-"
        self.switch = self.run_prefix + SWITCH
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: dict[str, Host] = {}
        self.removed_stale: list[str] = []
        self._route_added = False
        self._closed = False

    # ------------------------------------------------------------ build

    def __enter__(self) -> NetnsHarness:
        try:
            self.removed_stale = clean_stale()
            self._add_blackhole_route()  # rule (a): before any host exists
            self._build_switch()
            for i, name in enumerate(self.names):
                self._build_host(name, i + 2)
            self._add_neighbours()
            self.assert_safe()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def route(self) -> str:
        """This run's blackhole route, as `ip route` shows it."""
        return f"blackhole {self.subnet} proto {ROUTE_PROTO} metric {os.getpid()}"

    def _add_blackhole_route(self) -> None:
        """Pick a /24 of the test range no route of the root namespace
        overlaps (under a lock: parallel runs pick different ones), and
        blackhole it."""
        LOCK_PATH.touch(exist_ok=True)
        with LOCK_PATH.open("r+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            routes = ip("-4", "route", "show", "table", "all", "root", str(TEST_RANGE))
            taken = [_route_prefix(line) for line in routes.splitlines() if line.strip()]
            for candidate in itertools.islice(TEST_RANGE.subnets(new_prefix=24), 1, None):
                if not any(candidate.overlaps(t) for t in taken):
                    self.subnet = candidate
                    break
            else:
                raise HarnessError(f"no free /24 left in {TEST_RANGE}")
            ip("route", "add", "blackhole", str(self.subnet), "proto", ROUTE_PROTO, "metric", str(os.getpid()))
            self._route_added = True

    def _build_switch(self) -> None:
        ip("netns", "add", self.switch)
        ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        ip("link", "set", "br0", "up", ns=self.switch)

    def _build_host(self, name: str, index: int) -> None:
        assert self.subnet is not None
        ns, port = self.run_prefix + name, f"p-{name}"
        address = str(self.subnet[index])
        ip("netns", "add", ns)
        self.hosts[name] = Host(name, ns, address, port, mac=f"02:14:00:00:00:{index:02x}")
        ip("link", "add", "eth0", "address", self.hosts[name].mac, "type", "veth", "peer", "name", port,
           "netns", self.switch, ns=ns)
        ip("link", "set", port, "master", "br0", ns=self.switch)
        ip("link", "set", port, "up", ns=self.switch)
        ip("addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0", ns=ns)
        ip("link", "set", "lo", "up", ns=ns)
        ip("link", "set", "eth0", "up", ns=ns)

    def add_host(self, name: str) -> Host:
        """One more host on the running network (a new address: e.g. a
        service "rescheduled" elsewhere); its neighbour entries both ways.
        Torn down with the others."""
        if name in self.hosts or name == SWITCH or not re.fullmatch(r"[a-z0-9]{1,10}", name):
            raise HarnessError(f"host name taken or invalid: {name!r}")
        index = max(int(h.mac.rsplit(":", 1)[1], 16) for h in self.hosts.values()) + 1
        if index > 250:
            raise HarnessError("no address left in the run's /24")
        self.names.append(name)
        self._build_host(name, index)
        new = self.hosts[name]
        for peer in self.hosts.values():
            if peer is not new:
                ip("neigh", "replace", peer.address, "lladdr", peer.mac, "nud", "permanent", "dev", "eth0", ns=new.ns)
                ip("neigh", "replace", new.address, "lladdr", new.mac, "nud", "permanent", "dev", "eth0", ns=peer.ns)
        self.assert_safe()
        return new

    def _add_neighbours(self) -> None:
        """Every host knows every other's MAC (permanent entries: no ARP).
        Else a cut host's ARP for a peer fails within seconds and its kernel
        reports "No route to host" on its sockets (gRPC asks for such errors,
        IP_RECVERR): the cut host would learn of the cut at once. With them
        the cut is silent on both sides, as behind a failed router; only
        keepalives tell."""
        for host in self.hosts.values():
            for peer in self.hosts.values():
                if peer is not host:
                    ip("neigh", "replace", peer.address, "lladdr", peer.mac, "nud", "permanent", "dev", "eth0",
                       ns=host.ns)

    # ------------------------------------------------------------ checks

    @property
    def addresses(self) -> dict[str, str]:
        return {name: h.address for name, h in self.hosts.items()}

    def default_routes(self) -> dict[str, str]:
        """Default routes found in any of the run's namespaces (should be none)."""
        found = {}
        for ns in [self.switch, *(h.ns for h in self.hosts.values())]:
            routes = (ip("-4", "route", "show", "default", ns=ns) + ip("-6", "route", "show", "default", ns=ns)).strip()
            if routes:
                found[ns] = routes
        return found

    def assert_safe(self) -> None:
        """Rules (a) and (b) hold now: the route is in place, no namespace
        has a default route, every host's address is in the blackholed range."""
        assert self.subnet is not None
        if self.route not in ip("-4", "route", "show", "type", "blackhole").replace("  ", " "):
            raise HarnessError(f"the blackhole route for {self.subnet} is missing")
        if defaults := self.default_routes():
            raise HarnessError(f"namespaces with a default route: {defaults}")
        for h in self.hosts.values():
            if ipaddress.ip_address(h.address) not in self.subnet:
                raise HarnessError(f"{h.name}: {h.address} is outside {self.subnet}")

    def check_addresses(self, data: object, where: str) -> None:
        """Rule (c) for one config (see `check_addresses`)."""
        check_addresses(data, set(self.addresses.values()), where)

    def leftovers(self) -> list[str]:
        """What of this run still exists (after close: should be nothing):
        namespaces, links in the root namespace with its names (none are
        ever made there: veths are created inside the namespaces), the route."""
        left = [ns for ns in _namespaces() if ns.startswith(self.run_prefix)]
        left += [str(f) for f in (ETC_NETNS.glob(f"{self.run_prefix}*") if ETC_NETNS.is_dir() else ())]
        ports = {h.port for h in self.hosts.values()}
        left += [f"link {name}" for name in re.findall(r"^\d+: ([^:@]+)", ip("-o", "link", "show"), re.M)
                 if name in ports or name.startswith(PREFIX)]
        if self.subnet is not None and any(p == str(self.subnet) and pid == os.getpid()
                                           for p, pid in _our_routes()):
            left.append(f"route {self.subnet}")
        return left

    # ------------------------------------------------------------ faults

    def cut(self, name: str) -> None:
        """Partition host `name`: its switch port goes down. No frame
        crosses in either direction, nothing answers for it (no RST/FIN)."""
        ip("link", "set", self.hosts[name].port, "down", ns=self.switch)

    def heal(self, name: str) -> None:
        ip("link", "set", self.hosts[name].port, "up", ns=self.switch)

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        """Tear everything down, each step bounded and attempted even if an
        earlier one failed; idempotent. Raises after the last step if
        something could not be removed."""
        if self._closed:
            return
        self._closed = True
        errors: list[str] = []
        # Every host's processes at once: one host after another, each
        # gateway's drain (3 s not ready, for a load balancer) came after
        # the previous host's had ended -- ~9 s of a k8s cluster's teardown.
        try:
            _stop([p for host in self.hosts.values() for p in host.procs], STOP_GRACE)
        except Exception as exc:  # noqa: BLE001 - keep tearing down, report at the end
            errors.append(f"stop: {exc}")
        for ns in [*(h.ns for h in self.hosts.values()), self.switch]:
            try:
                if ns in _namespaces():
                    _kill_pids_in(ns)
                    ip("netns", "del", ns)
            except Exception as exc:  # noqa: BLE001 - keep tearing down, report at the end
                errors.append(f"delete {ns}: {exc}")
            _remove_etc(ns)
        if self._route_added:
            try:
                ip("route", "del", "blackhole", str(self.subnet), "proto", ROUTE_PROTO, "metric", str(os.getpid()))
            except Exception as exc:  # noqa: BLE001 - report at the end
                errors.append(f"route {self.subnet}: {exc}")
        if errors:
            raise HarnessError("teardown incomplete: " + "; ".join(errors))


_ADDRESS_KEY = re.compile(r"(^|_)(host|address)$")
_HOST_PORT = re.compile(r"^\[?([0-9a-fA-F.:]+?)\]?(:\d+)?$")


def _host_part(value: str) -> str | None:
    """The IP of "ip" or "ip:port", None if value is neither."""
    m = _HOST_PORT.match(value.strip())
    if not m:
        return None
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(m.group(1)))
    return None


def check_addresses(data: object, allowed: set[str], where: str) -> None:
    """Rule (c): walk a config (dicts, lists, strings). Every field named
    like an address (`host`, `*_host`, `address`, `*_address`) must be an
    IP of `allowed` or loopback (it never leaves its namespace), optionally
    with a port -- no hostname, no wildcard; and every other string that is
    an IP (or IP:port) must be one of those too. An empty `*_address` is
    allowed (it means "none": e.g. an engine that registers nowhere)."""
    def fail(path: str, value: str) -> None:
        raise HarnessError(f"{where}: {path} = {value!r} is not one of the harness's hosts {sorted(allowed)}")

    def ok(addr: str | None) -> bool:
        return addr is not None and (addr in allowed or ipaddress.ip_address(addr).is_loopback)

    def walk(node: object, path: str, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k), str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]", key)
        elif isinstance(node, str):
            addr = _host_part(node)
            if _ADDRESS_KEY.search(key):
                if not node and key.endswith("address"):
                    return
                if not ok(addr):
                    fail(path, node)
            elif addr is not None and not ok(addr):
                fail(path, node)

    walk(data, "", "")
