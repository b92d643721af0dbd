"""The probes and drain every service serves on its metrics port
(services/common/health_http.py): status codes and JSON bodies, /drain only
from loopback peers, one drain however often it is asked for, and the
`kvmesh drain` client's verdicts."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from services.common.health_http import (
    Check,
    DrainReport,
    HttpEndpoint,
    OnceDrain,
    Probes,
    add_health_routes,
    add_metrics_route,
    is_loopback,
    request_drain,
)


class Service:
    """A service whose probe answers and drain the tests set."""

    def __init__(self) -> None:
        self.live = Check(True, "ok", "alive")
        self.ready = Check(False, "loading", "warming up")
        self.started = Check(False, "loading", "warming up")
        self.drains = 0
        self.release = asyncio.Event()
        self.report = DrainReport(True, "nothing runs here", {"handed_over": 2})

    async def drain(self) -> DrainReport:
        self.drains += 1
        await self.release.wait()
        return self.report

    def app(self, drain: OnceDrain | None) -> web.Application:
        app = web.Application()
        add_metrics_route(app, lambda: b"kvmesh_up 1\n")
        add_health_routes(app, Probes(lambda: self.live, lambda: self.ready, lambda: self.started), drain)
        return app


@pytest.fixture
async def served() -> AsyncIterator[tuple[Service, OnceDrain, str]]:
    service = Service()
    drain = OnceDrain(service.drain)
    endpoint = HttpEndpoint(service.app(drain))
    port = await endpoint.start("127.0.0.1", 0)
    try:
        yield service, drain, f"http://127.0.0.1:{port}"
    finally:
        service.release.set()
        await endpoint.stop()


async def _get(url: str) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def test_probes_answer_200_or_503_with_status_and_reason(served: tuple[Service, OnceDrain, str]) -> None:
    service, _, base = served
    assert await _get(f"{base}/health/live") == (200, {"status": "ok", "reason": "alive"})
    assert await _get(f"{base}/health/ready") == (503, {"status": "loading", "reason": "warming up"})
    assert await _get(f"{base}/health/started") == (503, {"status": "loading", "reason": "warming up"})
    service.ready = service.started = Check(True, "ok", "serving")
    assert (await _get(f"{base}/health/ready"))[0] == 200
    assert (await _get(f"{base}/health/started"))[0] == 200
    service.live = Check(False, "failed", "backend dead: core exited")
    assert await _get(f"{base}/health/live") == (503, {"status": "failed", "reason": "backend dead: core exited"})
    async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as response:
        assert response.status == 200
        assert await response.text() == "kvmesh_up 1\n"


async def test_drain_waits_for_one_drain_however_often_asked(served: tuple[Service, OnceDrain, str]) -> None:
    service, drain, base = served
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(session.post(f"{base}/drain"))
        second = asyncio.create_task(session.post(f"{base}/drain"))
        async with asyncio.timeout(30):
            while not drain.started:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()  # answered only when drained
        service.release.set()
        for task in (first, second):
            async with await task as response:
                assert response.status == 200
                assert await response.json() == {"status": "drained", "reason": "nothing runs here",
                                                 "handed_over": 2}
    assert service.drains == 1
    assert await drain() == service.report  # SIGTERM after the preStop drain: at once, same drain
    assert service.drains == 1


async def test_a_cancelled_caller_does_not_cancel_the_drain() -> None:
    service = Service()
    drain = OnceDrain(service.drain)
    caller = asyncio.create_task(drain())
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    service.release.set()
    assert (await asyncio.wait_for(drain(), 10)).drained
    assert service.drains == 1


@pytest.mark.parametrize(("peer", "allowed"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("10.0.0.5", False), ("192.168.1.7", False), ("::ffff:10.0.0.5", False), ("fe80::1%eth0", False),
    ("", False), (None, False), ("not-an-ip", False),
])
def test_loopback_peers(peer: str | None, allowed: bool) -> None:
    assert is_loopback(peer) is allowed


async def _drain_from(app: web.Application, peer: str) -> web.StreamResponse:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (peer, 43210) if name == "peername" else default)
    request = make_mocked_request("POST", "/drain", app=app, transport=transport)
    match = await app.router.resolve(request)
    return await match.handler(request)


async def test_drain_is_refused_to_a_peer_off_loopback() -> None:
    service = Service()
    drain = OnceDrain(service.drain)
    app = service.app(drain)
    response = await _drain_from(app, "10.244.1.7")
    assert response.status == 403
    assert isinstance(response, web.Response) and response.text is not None
    assert '"status": "forbidden"' in response.text
    assert not drain.started and service.drains == 0
    service.release.set()
    assert (await _drain_from(app, "127.0.0.1")).status == 200


async def test_nothing_to_drain_answers_drained_at_once() -> None:
    service = Service()
    endpoint = HttpEndpoint(service.app(None))
    port = await endpoint.start("127.0.0.1", 0)
    try:
        drained, message = await asyncio.to_thread(request_drain, "127.0.0.1", port, 30.0)
    finally:
        await endpoint.stop()
    assert drained, message
    assert '"status": "drained"' in message


async def test_the_client_fails_on_a_timed_out_drain_and_on_nothing_listening(
    served: tuple[Service, OnceDrain, str],
) -> None:
    service, _, base = served
    port = int(base.rsplit(":", 1)[1])
    service.report = DrainReport(False, "2 request(s) still in flight at the bound", {"in_flight": 2})
    service.release.set()
    drained, message = await asyncio.to_thread(request_drain, "127.0.0.1", port, 30.0)
    assert not drained
    assert '"in_flight": 2' in message and '"status": "timeout"' in message
    await asyncio.sleep(0)
    with_nothing = HttpEndpoint(web.Application())
    free = await with_nothing.start("127.0.0.1", 0)
    await with_nothing.stop()
    drained, message = await asyncio.to_thread(request_drain, "127.0.0.1", free, 5.0)
    assert not drained and "127.0.0.1" in message


def _non_loopback_address() -> str | None:
    """This machine's address on a real interface, None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing address
            address: str = sock.getsockname()[0]
        except OSError:
            return None
    return None if is_loopback(address) else address


async def test_a_real_peer_off_loopback_is_refused() -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no address off loopback")
    service = Service()
    drain = OnceDrain(service.drain)
    endpoint = HttpEndpoint(service.app(drain))
    port = await endpoint.start("0.0.0.0", 0)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{address}:{port}/drain") as response:
                assert response.status == 403
                assert (await response.json())["status"] == "forbidden"
            async with session.get(f"http://{address}:{port}/health/live") as response:
                assert response.status == 200  # probes answer anyone (the kubelet dials the pod IP)
        assert not drain.started
    finally:
        service.release.set()
        await endpoint.stop()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
async def test_a_wildcard_bind_answers_on_ipv4_loopback(host: str) -> None:
    if host == "::" and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    service = Service()
    drain = OnceDrain(service.drain)
    endpoint = HttpEndpoint(service.app(drain))
    try:
        port = await endpoint.start(host, 0)
    except OSError as exc:
        pytest.skip(f"cannot bind {host}: {exc}")
    try:
        assert await _get(f"http://127.0.0.1:{port}/health/live") == (200, {"status": "ok", "reason": "alive"})
        service.release.set()
        drained, message = await asyncio.to_thread(request_drain, "127.0.0.1", port, 30.0)
        assert drained, message
    finally:
        service.release.set()
        await endpoint.stop()
