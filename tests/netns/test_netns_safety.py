"""The harness's safety rules, each shown on real namespaces (no services):
(a) the root namespace blackholes the run's range before any host exists;
(b) no namespace has a default route, and a host reaches nothing but the
other hosts; (c) configs naming an address that is not a harness host are
refused; (d) teardown removes everything, also when the test fails or is
interrupted, and a crashed run's leftovers are cleaned by the next run.
Also: a partition is silent (no RST, no FIN reaches a peer) and heals."""

from __future__ import annotations

import errno
import os
import socket
import subprocess

import pytest

from .harness import (
    PREFIX,
    ROUTE_PROTO,
    TEST_RANGE,
    HarnessError,
    NetnsHarness,
    check_addresses,
    clean_stale,
    ip,
)

IP_RECVERR = 11  # <linux/in.h>; not exported by Python's socket module

pytestmark = [pytest.mark.usefixtures("netns_ok"), pytest.mark.timeout(120)]


def _root_connect_error(address: str) -> int:
    """errno of a TCP connect from the root namespace (0 = connected)."""
    with socket.socket() as s:
        s.settimeout(3)
        return s.connect_ex((address, 9))


class _Recording(NetnsHarness):
    """Records, as each host is built, whether the run's blackhole route
    was already in the root namespace and what a root connect got."""

    seen: list[tuple[str, bool, int]]

    def _build_host(self, name: str, index: int) -> None:
        assert self.subnet is not None
        routes = ip("-4", "route", "show", "type", "blackhole")
        address = str(self.subnet[index])
        self.seen = [*getattr(self, "seen", []),
                     (name, self.route in routes.replace("  ", " "), _root_connect_error(address))]
        super()._build_host(name, index)


def test_blackhole_route_exists_before_any_host() -> None:
    with _Recording(["a", "b"]) as net:
        assert net.subnet is not None and net.subnet.subnet_of(TEST_RANGE)
        assert [(n, present) for n, present, _ in net.seen] == [("a", True), ("b", True)]
        # The root namespace refuses the range at once (blackhole: EINVAL), before and after.
        assert {err for _, _, err in net.seen} == {errno.EINVAL}
        assert _root_connect_error(net.addresses["a"]) == errno.EINVAL


def test_hosts_have_no_default_route_and_reach_only_each_other() -> None:
    with NetnsHarness(["a", "b"]) as net:
        assert net.default_routes() == {}
        for host in net.hosts.values():
            # One route: the bridge's /24, on eth0.
            v4 = ip("-4", "route", "show", ns=host.ns).splitlines()
            assert [r.split()[:3] for r in v4] == [[str(net.subnet), "dev", "eth0"]], v4
        a, b = net.hosts["a"], net.hosts["b"]
        server = a.call(lambda: _listener(a.address))
        try:
            b.call(lambda: socket.create_connection((a.address, server.getsockname()[1]), timeout=3).close())

            def outside(address: str) -> int:
                with socket.socket() as s:
                    s.settimeout(3)
                    return s.connect_ex((address, 80))
            # Off the bridge there is nowhere to go: refused at once, never sent.
            assert b.call(lambda: outside("1.1.1.1")) == errno.ENETUNREACH
            elsewhere = next(n for n in TEST_RANGE.subnets(new_prefix=24) if n != net.subnet)
            assert b.call(lambda: outside(str(elsewhere[1]))) == errno.ENETUNREACH
        finally:
            server.close()


def test_configs_may_name_only_the_harness_hosts() -> None:
    allowed = {"198.18.7.2", "198.18.7.3"}
    check_addresses({"scheduler": {"host": "198.18.7.2", "port": 1}, "gateway": {
        "scheduler_address": "198.18.7.2:50051", "host": "198.18.7.3"}, "admin": {"host": "127.0.0.1"},
        "engine": {"scheduler_address": ""}, "note": "not an address"}, allowed, "ok")
    bad = [
        {"host": "10.0.0.1"},                        # another machine
        {"scheduler_address": "8.8.8.8:53"},         # with a port
        {"host": "example.com"},                     # a name could resolve anywhere
        {"listen_host": "localhost"},
        {"host": "0.0.0.0"},                         # wildcard bind
        {"host": ""},
        {"upstreams": ["198.18.7.9:80"]},            # any IP-looking string, whatever its key
        {"endpoint": {"address": "198.18.7.4"}},
    ]
    for config in bad:
        with pytest.raises(HarnessError, match="not one of the harness's hosts"):
            check_addresses(config, allowed, "bad")


def test_partition_is_silent_then_heals() -> None:
    """A cut host's peers get no RST and no FIN: an open connection stays
    open (the peer's data is retransmitted into the void), a new connect
    times out (never refused). The cut host hears nothing either, even
    with IP_RECVERR (as gRPC sets it): no "host unreachable". Healed, the
    same connection delivers both ways."""
    with NetnsHarness(["a", "b"]) as net:
        a, b = net.hosts["a"], net.hosts["b"]
        server = a.call(lambda: _listener(a.address))
        port = server.getsockname()[1]
        conn = b.call(lambda: socket.create_connection((a.address, port), timeout=3))
        accepted, _ = a.call(server.accept)
        try:
            net.cut("a")
            conn.settimeout(2)
            conn.sendall(b"hello")
            accepted.setsockopt(socket.IPPROTO_IP, IP_RECVERR, 1)
            accepted.settimeout(0.5)
            for _ in range(12):  # 6 s of the cut host sending into the void (ARP would fail in ~3 s)
                accepted.sendall(b".")
                with pytest.raises(TimeoutError):
                    accepted.recv(1)  # no error reported on the cut side
            with pytest.raises(TimeoutError):
                conn.recv(1)  # no RST (ConnectionResetError), no FIN (b"")
            with pytest.raises(TimeoutError):
                b.call(lambda: socket.create_connection((a.address, port), timeout=2))
            assert "NO-CARRIER" in ip("link", "show", "eth0", ns=a.ns)
            net.heal("a")
            accepted.settimeout(15)  # TCP retransmits the bytes sent during the cut
            assert _recv_exactly(accepted, 5) == b"hello"
            conn.settimeout(15)
            assert _recv_exactly(conn, 12) == b"." * 12
        finally:
            for s in (conn, accepted, server):
                s.close()


def test_teardown_leaves_nothing_on_success_failure_and_interrupt() -> None:
    for ending in (None, RuntimeError, KeyboardInterrupt):
        net = NetnsHarness(["a", "b"])
        with open(os.devnull, "wb") as devnull:
            try:
                with net:
                    proc = net.hosts["a"].spawn(["sleep", "600"], devnull)
                    assert net.leftovers() != []
                    if ending is not None:
                        raise ending("the test fails here")
            except (RuntimeError, KeyboardInterrupt):
                pass
        assert net.leftovers() == [], ending
        assert proc.poll() is not None, f"{ending}: a host's process outlived the harness"
        assert not [ns for ns in ip("netns", "list").split() if ns.startswith(net.run_prefix)]


def test_a_crashed_runs_leftovers_are_cleaned() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: a run that crashed
    stale_ns, live_ns = f"{PREFIX}{dead.pid}-0-x", f"{PREFIX}{os.getpid()}-999-x"
    stale_route = "198.19.255.0/24"
    assert stale_route not in ip("-4", "route", "show", "table", "all"), "test range in use"
    ip("netns", "add", stale_ns)
    ip("netns", "add", live_ns)
    ip("route", "add", "blackhole", stale_route, "proto", ROUTE_PROTO, "metric", str(dead.pid))
    try:
        removed = clean_stale()
        assert stale_ns in removed and f"route {stale_route}" in removed
        names = ip("netns", "list").split()
        assert stale_ns not in names and live_ns in names  # a live run's namespaces stay
        assert stale_route not in ip("-4", "route", "show")
    finally:
        ip("netns", "del", live_ns, check=False)
        ip("netns", "del", stale_ns, check=False)
        ip("route", "del", "blackhole", stale_route, "proto", ROUTE_PROTO, "metric", str(dead.pid), check=False)


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def _listener(address: str) -> socket.socket:
    s = socket.socket()
    s.bind((address, 0))
    s.listen()
    return s
