"""Probes and drain over plain HTTP on a service's metrics port, shared by the
scheduler, the gateways and the engines (Kubernetes' kubelet cannot speak
gRPC health over mesh TLS; the metrics port is plain HTTP on every service).

    GET  /health/started  200 once started (engine: model loaded, warm-up done)
    GET  /health/ready    200 while the service takes new work
    GET  /health/live     200 while the process is worth keeping (503: restart it)
    POST /drain           the drain SIGTERM starts, without exiting; answers
                          when drained or its bound passed. Loopback peers only.
    GET  /metrics         Prometheus exposition

Every probe answers JSON `{"status": "...", "reason": "..."}` with 200 or 503;
/drain answers 200 with what happened (`DrainReport`), 403 to a peer that
is not on loopback (only a process in the pod -- a preStop hook, `kvmesh
drain` -- may drain it). A probe's answer comes from the event loop that
serves the service: an event loop that no longer runs answers nothing,
which the kubelet counts as a failure too.

Each service states its probes as three `Check`-returning callables
(`Probes`) and its drain as one coroutine, wrapped in `OnceDrain` so that a
second /drain (or SIGTERM after a preStop drain) waits for the same drain
instead of starting another.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

__all__ = [
    "DRAIN_PATH",
    "PROBE_PATHS",
    "Check",
    "DrainReport",
    "HttpEndpoint",
    "OnceDrain",
    "Probes",
    "add_health_routes",
    "add_metrics_route",
    "is_loopback",
    "listening_socket",
    "request_drain",
]

log = logging.getLogger(__name__)

PROBE_PATHS = ("/health/live", "/health/ready", "/health/started")
DRAIN_PATH = "/drain"


@dataclass(frozen=True)
class Check:
    """One probe's answer: `ok` -> 200, else 503; `status` a short word
    ("ok", "loading", "draining", "failed", ...), `reason` for people."""

    ok: bool
    status: str
    reason: str = ""

    def body(self) -> dict[str, str]:
        return {"status": self.status, "reason": self.reason}


OK = Check(True, "ok")


@dataclass(frozen=True)
class Probes:
    """A service's three probes; each runs on its event loop, synchronously."""

    live: Callable[[], Check] = lambda: OK
    ready: Callable[[], Check] = lambda: OK
    started: Callable[[], Check] = lambda: OK


@dataclass(frozen=True)
class DrainReport:
    """What a drain did. `drained`: nothing of the service's work is left
    running here (finished or handed over); False = its bound passed with
    work still open (the gateway's streams, cut at SIGTERM). `details`: the
    service's own counts (JSON numbers or strings)."""

    drained: bool
    reason: str
    details: dict[str, float | int | str] = field(default_factory=dict)

    def body(self) -> dict[str, object]:
        return {"status": "drained" if self.drained else "timeout", "reason": self.reason, **self.details}


class OnceDrain:
    """A drain that runs once: every call (POST /drain, SIGTERM, another
    /drain) waits for the same run and gets the same report. A caller that
    is cancelled (a client that hung up) does not cancel the drain."""

    def __init__(self, run: Callable[[], Awaitable[DrainReport]]) -> None:
        self._run = run
        self._task: asyncio.Future[DrainReport] | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

    async def __call__(self) -> DrainReport:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._task)


def is_loopback(host: str | None) -> bool:
    """Whether a peer address is this host's loopback (127/8, ::1, and
    IPv4-mapped ::ffff:127.x)."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _json(status: int, body: Mapping[str, object]) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


def add_health_routes(app: web.Application, probes: Probes, drain: OnceDrain | None) -> None:
    """GET /health/{live,ready,started} and POST /drain on `app`. `drain`
    None = nothing to drain: /drain answers `drained` at once."""

    def probe(check: Callable[[], Check]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(_: web.Request) -> web.Response:
            answer = check()
            return _json(200 if answer.ok else 503, answer.body())

        return handle

    async def handle_drain(request: web.Request) -> web.Response:
        if not is_loopback(request.remote):
            log.warning("refused POST %s from %s: loopback peers only", DRAIN_PATH, request.remote)
            return _json(403, {"status": "forbidden",
                               "reason": f"{DRAIN_PATH} is accepted from loopback peers only"})
        if drain is None:
            report = DrainReport(True, "nothing to drain")
        else:
            log.info("drain asked for over HTTP by %s", request.remote)
            report = await drain()
        return _json(200, report.body())

    for path, check in zip(PROBE_PATHS, (probes.live, probes.ready, probes.started), strict=True):
        app.router.add_get(path, probe(check))
    app.router.add_post(DRAIN_PATH, handle_drain)


def add_metrics_route(app: web.Application, render: Callable[[], bytes]) -> None:
    """GET /metrics: `render()`'s Prometheus exposition."""

    async def handle(_: web.Request) -> web.Response:
        return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", handle)


def listening_socket(host: str, port: int, backlog: int = 128, send_buffer: int = 0) -> socket.socket:
    """A TCP socket listening on host:port (`send_buffer` > 0: SO_SNDBUF,
    which accepted connections inherit). An IPv6 host ("::") also takes
    IPv4 peers (dual stack, IPV6_V6ONLY off; asyncio's own servers turn it
    on): a pod binding "::" answers the kubelet and `kvmesh drain` on
    127.0.0.1 too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        if send_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class HttpEndpoint:
    """One aiohttp app on host:port in the running event loop."""

    def __init__(self, app: web.Application) -> None:
        self._app = app
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Bind (port 0 = any free port); returns the bound port."""
        sock = listening_socket(host, port)
        runner = web.AppRunner(self._app, access_log=None)
        await runner.setup()
        self._runner = runner
        await web.SockSite(runner, sock).start()
        self.port = sock.getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def request_drain(host: str, port: int, timeout: float) -> tuple[bool, str]:
    """The client `kvmesh drain` runs (a preStop hook): POST /drain and wait
    for its answer. (True, summary) once drained; (False, why) otherwise --
    the bound passed with work open, refused, nothing listening, timed out."""
    url = f"http://{_url_host(host)}:{port}{DRAIN_PATH}"
    request = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace').strip()}"
    except (OSError, ValueError) as exc:
        return False, f"{url}: {exc}"
    summary = json.dumps(body, sort_keys=True)
    return body.get("status") == "drained", summary


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
