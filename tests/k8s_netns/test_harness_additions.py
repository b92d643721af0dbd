"""What the Kubernetes run adds to the namespace harness: a host added to a
running network (a pod rescheduled to a new address) reaches the others and
is reached; a host's /etc/netns files are what its processes see as /etc;
teardown removes both."""

from __future__ import annotations

import pytest

from tests.netns.harness import ETC_NETNS, NetnsHarness, netns_unavailable

from .cluster import connect

pytestmark = pytest.mark.timeout(120)


def test_an_added_host_and_its_etc_files_come_and_go_with_the_network() -> None:
    if reason := netns_unavailable():
        pytest.skip(reason)
    with NetnsHarness(["a", "b"]) as net:
        net.cut("b")
        c = net.add_host("c")
        assert c.address not in {net.hosts["a"].address, net.hosts["b"].address}
        # Reached and reaching (nothing listens on port 9: refused, i.e. the SYN arrived).
        assert net.hosts["a"].call(lambda: connect(c.address, 9, 3)) == "refused"
        assert c.call(lambda: connect(net.hosts["a"].address, 9, 3)) == "refused"
        c.write_etc("hosts", f"{c.address}\tpod-c\n")
        assert c.run("getent", "hosts", "pod-c").stdout.split() == [c.address, "pod-c"]
        assert net.hosts["a"].run("getent", "hosts", "pod-c").returncode != 0  # only c's view
        net.assert_safe()
    assert net.leftovers() == []
    assert not (ETC_NETNS / c.ns).exists()
