"""The soak's Redis: a real `redis-server` for the gateways' response cache
and Responses store, on a free loopback port, without persistence, ended by
its own PID. (tests/_redis_server.py does the same for tests; it is
imported there by its bare name, which a script cannot share with mypy's
view of tests/, and it skips a test where this must fail.)"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from services.launcher.ports import free_port

__all__ = ["RedisProcess", "redis_server"]

_READY_SECONDS = 10.0


@dataclass(frozen=True)
class RedisProcess:
    process: subprocess.Popen[bytes]
    url: str


@contextmanager
def redis_server(directory: Path) -> Iterator[RedisProcess]:
    """A started redis-server, SIGKILLed by its PID on the way out."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("soak: redis-server is not installed (scripts/install/system-packages.sh, test profile)")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with (directory / "redis.log").open("wb") as log:
        process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", str(directory)], stdout=log, stderr=log)
    try:
        client = redis.Redis(port=port, socket_timeout=0.5)
        deadline = time.monotonic() + _READY_SECONDS
        while not _pong(client):
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"soak: redis-server did not start; see {directory / 'redis.log'}")
            time.sleep(0.05)
        client.close()
        yield RedisProcess(process, f"redis://127.0.0.1:{port}/0")
    finally:
        process.kill()   # nothing to save: no persistence
        process.wait(10)


def _pong(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
