"""Free TCP ports on 127.0.0.1, chosen at run time so concurrent meshes and
test runs never collide.

There is an unavoidable window between probing a port and the child binding
it; the launcher reports a child that dies on a taken port clearly, and tests
probe fresh ports per mesh.
"""

from __future__ import annotations

import random
import socket

__all__ = ["PortAllocator", "free_port", "free_port_block", "port_is_free"]

# Above the common fixed ports (8000, 8080, 9901, 50051...) and below the
# Linux ephemeral range (32768+) that port-0 binds and outgoing connections use.
_BLOCK_RANGE = (20000, 32000)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel says is free now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port_block(
    count: int, host: str = "127.0.0.1", attempts: int = 200, taken: set[int] | None = None
) -> int:
    """First port of `count` consecutive free ports (engine i listens on
    base_port + i), none of them in `taken`. Random bases make two
    concurrent callers unlikely to pick the same block."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    rng = random.Random()
    low, high = _BLOCK_RANGE
    taken = taken or set()
    for _ in range(attempts):
        base = rng.randrange(low, high - count)
        ports = range(base, base + count)
        if not taken.intersection(ports) and all(port_is_free(p, host) for p in ports):
            return base
    raise OSError(f"no block of {count} free ports found in {low}-{high} on {host}")


class PortAllocator:
    """Free ports for one mesh, each handed out once. Probing only says a
    port is free *now*: until the children bind them, two probes can find
    the same port free, so the mesh remembers what it gave away."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._host = host
        self._taken: set[int] = set()

    def one(self) -> int:
        # From the block range, not a port-0 bind: those come from the
        # ephemeral range, where a process's outgoing connections (vLLM's
        # start-up) can take the port before its child binds it (Envoy found
        # its port taken after two vLLM engines' 65 s start).
        return self.block(1)

    def block(self, count: int) -> int:
        base = free_port_block(count, self._host, taken=self._taken)
        self._taken.update(range(base, base + count))
        return base
