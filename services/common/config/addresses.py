"""`host:port` addresses as the config writes them: a DNS name, an IPv4
address or a bracketed IPv6 address, then a port.

    split_host_port("kvmesh-engine-0.kvmesh-engine.kvmesh.svc.cluster.local:50100")
    join_host_port("::", 50100) == "[::]:50100"     # gRPC's bind syntax
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["join_host_port", "scheduler_addresses", "split_host_port"]

# RFC 1123 host names (Kubernetes' DNS names are such): labels of letters,
# digits and hyphens, not starting or ending with a hyphen.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_MAX_PORT = 65535


def split_host_port(address: str) -> tuple[str, int]:
    """(host, port) of `address`; ValueError saying what is wrong. An IPv6
    host comes back without its brackets. The port must be 1 .. 65535."""
    if "/" in address or any(c.isspace() for c in address):
        raise ValueError(f"{address!r}: expected host:port (no scheme, path or spaces)")
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            raise ValueError(f"{address!r}: expected [IPv6]:port")
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ValueError(f"{address!r}: {host!r} is not an IPv6 address") from exc
    else:
        host, sep, port = address.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{address!r}: expected host:port")
        if ":" in host:
            raise ValueError(f"{address!r}: an IPv6 host needs brackets: [{host}]:{port}")
        if not _is_hostname(host):
            raise ValueError(f"{address!r}: {host!r} is neither a DNS name nor an IPv4 address")
    if not port.isdigit() or not 1 <= int(port) <= _MAX_PORT:
        raise ValueError(f"{address!r}: port {port!r} is not within 1 .. {_MAX_PORT}")
    return host, int(port)


def join_host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets ("::" -> "[::]:port")."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def scheduler_addresses(single: str, many: list[str]) -> list[str]:
    """The scheduler replicas a gateway or engine dials: `scheduler_addresses`
    when set, else the one `scheduler_address` (empty: none, a standalone
    engine). The one place both settings are read together."""
    if many:
        return list(many)
    return [single] if single else []


def _is_hostname(host: str) -> bool:
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))
