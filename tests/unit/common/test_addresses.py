"""`host:port` addresses in the config and on the command line: DNS names
(a pod's stable name), IPv4 and bracketed IPv6."""

from __future__ import annotations

import re

import pytest

from services.common.config.addresses import join_host_port, split_host_port


@pytest.mark.parametrize(("address", "parts"), [
    ("kvmesh-engine-0.kvmesh-engine.kvmesh.svc.cluster.local:50100",
     ("kvmesh-engine-0.kvmesh-engine.kvmesh.svc.cluster.local", 50100)),
    ("kvmesh-scheduler:50051", ("kvmesh-scheduler", 50051)),
    ("10.0.0.7:9", ("10.0.0.7", 9)),
    ("[::1]:50100", ("::1", 50100)),
    ("[fd00::7]:1", ("fd00::7", 1)),
    ("host.example.:443", ("host.example.", 443)),
])
def test_good_addresses_split(address: str, parts: tuple[str, int]) -> None:
    assert split_host_port(address) == parts


@pytest.mark.parametrize(("address", "problem"), [
    ("kvmesh-engine-0", "expected host:port"),
    (":50100", "expected host:port"),
    ("::1:50100", "needs brackets"),
    ("[::1]50100", "expected [IPv6]:port"),
    ("[nonsense]:1", "not an IPv6 address"),
    ("bad_name:1", "neither a DNS name"),
    ("-bad:1", "neither a DNS name"),
    ("engine:0", "not within 1 .. 65535"),
    ("engine:65536", "not within 1 .. 65535"),
    ("engine:http", "not within 1 .. 65535"),
])
def test_bad_addresses_say_why(address: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        split_host_port(address)


def test_join_brackets_ipv6_hosts() -> None:
    assert join_host_port("::", 50100) == "[::]:50100"
    assert join_host_port("0.0.0.0", 9200) == "0.0.0.0:9200"
    assert join_host_port("kvmesh-scheduler", 50051) == "kvmesh-scheduler:50051"
    assert join_host_port("[::1]", 1) == "[::1]:1"
