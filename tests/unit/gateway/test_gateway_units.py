"""Pure pieces of the gateway: token buckets on a fake clock, keys, validation,
the error mapping table, tokenization, metrics, public surfaces."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from conftest import KEY_FULL, MODEL, FakeEngine, Mesh, sha

from services.common.clock import FakeClock
from services.common.config import ApiKeyConfig, GatewayConfig
from services.common.proto.kvmesh.v1 import scheduler_pb2
from services.gateway.errors import ErrorKind, GatewayError, from_rejection, grpc_status, http_error
from services.gateway.keys import ANONYMOUS, KeyStore, Principal, api_key_from_headers, effective_priority
from services.gateway.limits import RateLimiter, TokenBucket
from services.gateway.tokenization import ModelTokenizer
from services.gateway.validation import parse_priority_header

MODULES = [
    "driver", "engine_client", "errors", "event_stream", "events", "frontdoor", "grpc_api", "http_api", "jobs",
    "keys", "lease_link", "limits", "metrics", "openapi", "request_meter", "scheduler_client", "server",
    "spare_calls", "stop_seam", "tokenization", "validation", "batch_lines",
]


@pytest.mark.parametrize("name", MODULES)
def test_public_surface(name: str) -> None:
    module = importlib.import_module(f"services.gateway.{name}")
    assert module.__all__, name
    for symbol in module.__all__:
        assert hasattr(module, symbol), f"{name}.{symbol}"


def test_token_bucket_on_fake_clock() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate=2.0, capacity=4.0, clock=clock)
    assert all(bucket.take(1) for _ in range(4))
    assert not bucket.take(1)
    assert bucket.wait_for(1) == pytest.approx(0.5)
    assert math.isinf(bucket.wait_for(5))
    clock.advance(0.5)
    assert bucket.take(1)
    clock.advance(100)
    assert bucket.remaining == 4.0


def _principal(rps: float = 0, tpm: float = 0) -> Principal:
    return Principal("k1", "t", 0, frozenset(), rps, tpm, 0)


def test_rate_limiter_requests_and_tokens() -> None:
    clock = FakeClock()
    limiter = RateLimiter(clock)
    p = _principal(rps=1, tpm=600)  # 10 tokens/s, 600 burst
    grant = limiter.admit(p, 500)
    with pytest.raises(GatewayError) as err:
        limiter.admit(p, 10)
    assert err.value.kind is ErrorKind.RATE_LIMITED and err.value.retry_after == pytest.approx(1.0)
    clock.advance(1.0)
    with pytest.raises(GatewayError) as err:  # request ok, tokens short: 110 left, 200 asked
        limiter.admit(p, 200)
    assert "tokens/min" in err.value.message and err.value.headers["x-ratelimit-remaining-tokens"] == "110"
    limiter.settle(grant, 100)  # used 100 of the 500 charged: 400 come back
    assert limiter.admit(p, 200).headers["x-ratelimit-remaining-tokens"] == "310"
    clock.advance(1.0)
    with pytest.raises(GatewayError, match="lower max_tokens"):
        limiter.admit(p, 10_000)  # can never fit


def test_unlimited_key_is_never_limited() -> None:
    limiter = RateLimiter(FakeClock())
    for _ in range(1000):
        assert limiter.admit(ANONYMOUS, 10**6).headers == {}


def test_keys_and_priority_ceiling() -> None:
    store = KeyStore(GatewayConfig(api_keys=[ApiKeyConfig(sha256=sha("k"), tenant="t", priority_ceiling=1,
                                                          models=["m"])]))
    p = store.authenticate("k")
    assert p.tenant == "t" and effective_priority(0, p) == 1 and effective_priority(2, p) == 2
    with pytest.raises(GatewayError) as err:
        store.authenticate("other")
    assert err.value.kind is ErrorKind.UNAUTHENTICATED
    with pytest.raises(GatewayError) as err:
        store.check_model(p, "x")
    assert err.value.kind is ErrorKind.PERMISSION_DENIED
    assert KeyStore(GatewayConfig(auth_enabled=False)).authenticate(None).tenant == "anonymous"
    assert api_key_from_headers({"authorization": "Bearer abc"}) == "abc"
    assert api_key_from_headers({"x-api-key": "abc"}) == "abc"
    assert api_key_from_headers({"authorization": "Basic abc"}) is None


MSG = [{"role": "user", "content": "hi"}]


def test_priority_header() -> None:
    assert parse_priority_header(None) == 1 and parse_priority_header("P0") == 0


def test_error_mapping_table() -> None:
    for kind in ErrorKind:
        exc = GatewayError(kind, "msg")
        mapped = http_error(exc)
        assert 400 <= mapped.status < 600 and set(mapped.body["error"]) == {"message", "type", "param", "code"}
        code, _, _ = grpc_status(exc)
        assert code != grpc.StatusCode.OK
    statuses = {
        scheduler_pb2.REJECT_CODE_QUEUE_FULL: (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        scheduler_pb2.REJECT_CODE_TENANT_FULL: (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        scheduler_pb2.REJECT_CODE_EXPIRED: (503, grpc.StatusCode.UNAVAILABLE),
        scheduler_pb2.REJECT_CODE_NO_ENGINE: (503, grpc.StatusCode.UNAVAILABLE),
        scheduler_pb2.REJECT_CODE_DRAINING: (503, grpc.StatusCode.UNAVAILABLE),
        scheduler_pb2.REJECT_CODE_TOO_LARGE: (400, grpc.StatusCode.INVALID_ARGUMENT),
        scheduler_pb2.REJECT_CODE_INVALID: (400, grpc.StatusCode.INVALID_ARGUMENT),
    }
    for code, (http, rpc) in statuses.items():
        exc = from_rejection(scheduler_pb2.Rejected(code=code, retry_after_seconds=0.2))
        assert http_error(exc).status == http and grpc_status(exc)[0] == rpc
        if http == 429:
            assert http_error(exc).headers["Retry-After"] == "1"


async def test_tokenizer_chat_template_and_context(model_dir: Path) -> None:
    tok = ModelTokenizer(MODEL, model_dir)
    assert tok.has_chat_template and tok.max_model_len > 0
    prompt = await tok.tokenize_chat([{"role": "user", "content": "hello world " * 20}], 16)
    assert "hello" in (prompt.text or "")
    assert len(prompt.prefix_hashes) == len(prompt.token_ids) // 16
    big = await tok.tokenize_text("hello world " * 2000, 16)  # off the event loop
    assert len(big.token_ids) >= 2000
    with pytest.raises(GatewayError, match="vocabulary"):
        await tok.from_ids([10**9], 16)


async def test_metrics_count_requests_and_migrations(mesh: Mesh) -> None:
    mesh.engines["engine-a"].break_after = 2
    await mesh.add_engine(FakeEngine("engine-b"))
    async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0) as c:
        await c.chat.completions.create(model=MODEL, messages=MSG)
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="nope", messages=MSG)
    text = mesh.gateway.metrics.render().decode()  # type: ignore[attr-defined]
    assert 'kvmesh_gateway_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'kvmesh_gateway_requests_total{route="/v1/chat/completions",status="404"} 1.0' in text
    assert "kvmesh_gateway_migrations_total 1.0" in text
    assert 'kvmesh_gateway_time_to_first_token_seconds_count{model_name="tiny",priority="P1",route="chat"} 1.0' in text
    assert "kvmesh_gateway_active_streams 0.0" in text


async def test_metrics_endpoint(model_dir: Path) -> None:
    from conftest import make_config

    from services.gateway.server import GatewayService

    gateway = GatewayService(make_config(model_dir, "127.0.0.1:1", metrics_port=0))
    gateway.config.gateway.metrics_port = 0
    await gateway.start(http_port=0, grpc_port=0)
    try:
        assert gateway.metrics_port == 0  # 0 = off
    finally:
        await gateway.stop(grace=0.1)
    # With a port: bind a free one by asking the OS first.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gateway = GatewayService(make_config(model_dir, "127.0.0.1:1", metrics_port=port))
    await gateway.start(http_port=0, grpc_port=0)
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200 and "kvmesh_gateway_active_streams" in await r.text()
    finally:
        await gateway.stop(grace=0.1)


def test_a_retried_request_gets_an_id_of_its_own() -> None:
    from services.gateway.jobs import request_id_from

    assert request_id_from("abc-1") == "abc-1"
    assert request_id_from("abc-1", "1") == "abc-1"
    assert request_id_from("abc-1", "2") == "abc-1-try2"
    assert request_id_from("abc-1", "junk") == "abc-1"
    assert request_id_from("bad id with spaces", "3").endswith("-try3")


def test_an_engine_that_failed_a_request_is_excluded_for_it_only_for_a_while() -> None:
    """A stream that lost engine-1 (a partition) and later engine-0 (a hang)
    may go back to engine-1 once it serves again: only failures within the
    scheduler's detection bound are excluded; all count against max_migrations."""
    from types import SimpleNamespace

    from services.common.clock import FakeClock
    from services.gateway.driver import DriverSettings, _Generation

    clock = FakeClock()
    settings = DriverSettings(max_migrations=3, heartbeat_seconds=5.0, exclude_failed_seconds=12.0)
    job = SimpleNamespace(sampling=SimpleNamespace(stop=[], min_tokens=0), resume_from=None)
    generation = _Generation(SimpleNamespace(clock=clock, settings=settings), job)  # type: ignore[arg-type]
    generation._failures.append(("engine-1", clock.monotonic()))
    assert generation._excluded() == ["engine-1"]
    clock.advance(12.5)
    generation._failures.append(("engine-0", clock.monotonic()))
    assert generation._excluded() == ["engine-0"]
    assert len(generation._failures) == 2
