"""A real `redis-server` for tests: on a free loopback port, no persistence,
its files in a temp dir, stopped (or SIGKILLed) by its own PID.

    with RedisServer.start(tmp_path) as redis:
        redis.url   # redis://127.0.0.1:<port>/0
        redis.kill()

Skips the test with the reason when the binary is missing (setup installs
it: scripts/install/system-packages.sh, test profile)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import pytest

from services.launcher.ports import free_port

__all__ = ["RedisServer"]


class RedisServer:
    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.process = process
        self.port = port
        self.log = log

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @classmethod
    def start(cls, directory: Path, attempts: int = 3) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed: run scripts/install/system-packages.sh (test profile)")
        directory.mkdir(parents=True, exist_ok=True)
        for attempt in range(attempts):
            port = free_port()
            log = directory / f"redis-{port}.log"
            with log.open("wb") as out:
                process = subprocess.Popen(
                    [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                     "--daemonize", "no", "--dir", str(directory)],
                    stdout=out, stderr=subprocess.STDOUT)
            server = cls(process, port, log)
            if server._wait_ready(10.0):
                return server
            server.kill()
            if attempt == attempts - 1:
                raise RuntimeError(f"redis-server did not start: {log.read_text()[-2000:]}")
        raise AssertionError("unreachable")

    def _wait_ready(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        """SIGKILL by PID (a crash, not a shutdown)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
