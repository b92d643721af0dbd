"""The response cache's pure parts on a fake clock: the key (what makes two
requests share an entry), the request policy, the entry format, the
embedded store's bounds, TTL and LRU eviction, and the circuit breaker."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.common.clock import FakeClock
from services.common.config import ApiKeyConfig, ConfigError, MeshConfig, validate_config
from services.common.config.response_cache import ResponseCacheConfig
from services.common.model_revision import model_revision
from services.common.openai_api.requests import GenerationInput, SamplingOptions
from services.common.openai_api.structured_outputs import StructuredSpec
from services.common.proto.kvmesh.v1 import common_pb2
from services.gateway.events import Finished, FinishReason, TextDelta, Usage
from services.gateway.jobs import Job
from services.gateway.response_cache.breaker import Breaker
from services.gateway.response_cache.embedded import EmbeddedStore
from services.gateway.response_cache.key import cache_key, cache_scope
from services.gateway.response_cache.metrics import CacheMetrics
from services.gateway.response_cache.policy import CacheDirective, directive_for, uncacheable_reason
from services.gateway.response_cache.record import Recorder, decode_entry, encode_entry, replay

REV = "sha256:abc"


def _job(**changes: Any) -> Job:
    job = Job(request_id="r1", route="chat", model="m", tenant="acme", priority=0, prompt_ids=[1, 2, 3],
              prefix_hashes=[], sampling=SamplingOptions(temperature=0.0), max_tokens=16,
              max_generation_seconds=120.0, arrival_unix=0.0, arrival_monotonic=0.0, hash_block_tokens=16)
    return dataclasses.replace(job, **changes)


def _request(**changes: Any) -> GenerationInput:
    return dataclasses.replace(GenerationInput(route="chat", model="m", sampling=SamplingOptions(temperature=0.0)),
                               **changes)


def _key(job: Job | None = None, request: GenerationInput | None = None, scope: str = "tenant:acme",
         revision: str = REV) -> str:
    return cache_key(scope, revision, job or _job(), request or _request())


# ---------------------------------------------------------------- key


def test_the_same_request_gives_the_same_key_and_a_new_request_id_does_not_matter() -> None:
    assert _key() == _key(_job(request_id="other", arrival_unix=5.0, priority=2))
    assert len(_key()) == 64


@pytest.mark.parametrize("change", [
    {"temperature": 0.5, "seed": 1}, {"seed": 7}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1},
    {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"repetition_penalty": 1.1}, {"stop": ["x"]},
    {"stop_token_ids": [5]}, {"logprobs": 2}, {"min_tokens": 2}, {"ignore_eos": True}, {"logit_bias": {5: 1.0}},
    {"max_tokens": 99},
])
def test_any_sampling_change_gives_another_key(change: dict[str, Any]) -> None:
    sampling = dataclasses.replace(SamplingOptions(temperature=0.0), **change)
    assert _key(_job(sampling=sampling)) != _key()


@pytest.mark.parametrize("job_change", [
    {"prompt_ids": [1, 2, 4]}, {"model": "m2"}, {"route": "completion"}, {"max_tokens": 17}, {"n": 2},
    {"echo_text": "hi"}, {"structured": StructuredSpec("json_object")},
])
def test_any_prompt_or_output_change_gives_another_key(job_change: dict[str, object]) -> None:
    assert _key(_job(**job_change)) != _key()


def test_tools_are_part_of_the_key() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert _key(request=_request(tools=tools)) != _key()
    assert _key(request=_request(tools=tools, tool_choice="auto")) != _key(request=_request(tools=tools))


def test_other_tenant_other_revision_other_key_and_shared_keys_meet() -> None:
    assert _key(scope=cache_scope("other", shared=False)) != _key(scope=cache_scope("acme", shared=False))
    assert _key(revision="sha256:def") != _key()
    # Two tenants whose keys share meet in the shared scope, never a private one.
    assert cache_scope("acme", shared=True) == cache_scope("other", shared=True) == "shared"
    assert _key(scope=cache_scope("acme", True)) != _key(scope=cache_scope("acme", False))


def test_revision_follows_the_model_files_and_a_configured_one_wins(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 3_000_000)
    first = model_revision(tmp_path)
    assert first.startswith("sha256:") and model_revision(tmp_path) == first
    (tmp_path / "config.json").write_text('{"a": 2}')
    assert model_revision(tmp_path) != first
    assert model_revision(tmp_path, "v1.2") == "v1.2"
    assert model_revision(tmp_path / "missing").startswith("unreadable:")


# ---------------------------------------------------------------- policy


@pytest.mark.parametrize(("mode", "headers", "expected"), [
    ("off", {"x-kvmesh-cache": "on"}, None),
    ("request", {}, None),
    ("request", {"x-kvmesh-cache": "on"}, CacheDirective(read=True, write=True)),
    ("on", {}, CacheDirective(read=True, write=True)),
    ("on", {"cache-control": "no-cache"}, CacheDirective(read=False, write=True)),
    ("on", {"cache-control": "max-age=0, No-Store"}, CacheDirective(read=False, write=False)),
    ("on", {"x-kvmesh-cache": "off"}, CacheDirective(read=False, write=False)),
    ("request", {"x-kvmesh-cache": "ON", "cache-control": "no-cache"}, CacheDirective(read=False, write=True)),
])
def test_directive(mode: str, headers: dict[str, str], expected: CacheDirective | None) -> None:
    assert directive_for(mode, headers) == expected


def test_only_determined_answers_are_cacheable() -> None:
    assert uncacheable_reason(_request(), resumed=False) is None
    assert uncacheable_reason(_request(sampling=SamplingOptions(temperature=0.8, seed=3)), False) is None
    assert uncacheable_reason(_request(sampling=SamplingOptions()), False) == "sampled"   # engine default
    assert uncacheable_reason(_request(sampling=SamplingOptions(temperature=0.7)), False) == "sampled"
    assert uncacheable_reason(_request(), resumed=True) == "resume"


def test_config_bounds() -> None:
    config = MeshConfig()
    config.gateway.response_cache = ResponseCacheConfig(store="redis")
    with pytest.raises(ConfigError, match=r"response_cache\.redis_url"):
        validate_config(config)
    config.gateway.response_cache = ResponseCacheConfig(max_entry_bytes=10, max_bytes=5)
    with pytest.raises(ConfigError, match="max_entry_bytes"):
        validate_config(config)
    config.gateway.response_cache = ResponseCacheConfig(store="memcached")
    with pytest.raises(ConfigError, match=r"response_cache\.store"):
        validate_config(config)
    config.gateway.response_cache = ResponseCacheConfig()
    config.gateway.api_keys = [ApiKeyConfig(sha256="a" * 64, tenant="t", response_cache="yes")]
    with pytest.raises(ConfigError, match=r"api_keys\[0\]\.response_cache: must be one of off, on, request"):
        validate_config(config)
    config.gateway.api_keys[0].response_cache = "request"
    validate_config(config)


# ---------------------------------------------------------------- entries


def _events() -> list[TextDelta | Finished]:
    lp = common_pb2.TokenLogprob(token_id=5, logprob=-0.5)
    return [TextDelta("Hel", [5], [lp], 1), TextDelta("lo", [6], [], 2),
            Finished(FinishReason.STOP, Usage(3, 2, 1))]


def test_entry_round_trip_marks_the_prompt_cached() -> None:
    out = decode_entry(encode_entry(_events()))
    assert out[:2] == _events()[:2]
    assert out[2] == Finished(FinishReason.STOP, Usage(3, 2, 3))
    with pytest.raises(ValueError):
        decode_entry(b'{"v": 99, "events": []}')
    with pytest.raises(ValueError):
        decode_entry(b"garbage")


async def _record(events: list[TextDelta | Finished], max_bytes: int = 1 << 20) -> list[bytes]:
    stored: list[bytes] = []
    seen: list[object] = []

    async def run(emit: object) -> None:
        for e in events:
            await emit(e)

    async def sink(event: object) -> None:
        seen.append(event)

    await Recorder(stored.append, max_bytes).wrap(run)(sink)
    assert seen == events   # the client sees every event, stored or not
    return stored


async def test_recorder_stores_only_complete_answers() -> None:
    assert [decode_entry(raw)[:2] for raw in await _record(_events())] == [_events()[:2]]
    length = [*_events()[:2], Finished(FinishReason.LENGTH, Usage(3, 2, 0))]
    assert len(await _record(length)) == 1
    for bad in (FinishReason.ERROR, FinishReason.TIMEOUT, FinishReason.ABORT):
        assert await _record([*_events()[:2], Finished(bad, Usage(3, 2, 0))]) == []
    assert await _record(_events()[:2]) == []                 # no final event: partial
    assert await _record(_events(), max_bytes=20) == []        # over max_entry_bytes
    # n = 2: one choice failing spoils the whole answer.
    two: list[TextDelta | Finished] = [
        TextDelta("a", [1], choice=0), Finished(FinishReason.ERROR, Usage(3, 1, 0), choice=0, final=False),
        TextDelta("b", [2], choice=1), Finished(FinishReason.STOP, Usage(3, 2, 0), choice=1)]
    assert await _record(two) == []


async def test_replay_emits_the_entry() -> None:
    seen: list[object] = []

    async def sink(event: object) -> None:
        seen.append(event)

    events = decode_entry(encode_entry(_events()))
    await replay(events)(sink)
    assert seen == events


# ---------------------------------------------------------------- embedded store


def _store(max_bytes: int = 100, ttl: float = 10.0) -> tuple[EmbeddedStore, FakeClock, CacheMetrics]:
    clock = FakeClock()
    metrics = CacheMetrics(CollectorRegistry(), "embedded")
    return EmbeddedStore(max_bytes, ttl, clock, metrics), clock, metrics


def _value(metric: object) -> float:
    return metric._value.get()  # type: ignore[attr-defined]  # prometheus_client's private value holder


async def test_embedded_store_evicts_least_recently_used_within_max_bytes() -> None:
    store, _, metrics = _store(max_bytes=100)
    await store.put("a", b"x" * 40)
    await store.put("b", b"y" * 40)
    assert await store.get("a") == b"x" * 40          # a is now the most recent
    await store.put("c", b"z" * 40)                   # 120 > 100: b goes
    assert await store.get("b") is None
    assert await store.get("a") is not None and await store.get("c") is not None
    assert store.size_bytes == 80 and _value(metrics.bytes) == 80 and _value(metrics.evictions) == 1
    await store.put("big", b"q" * 101)                # larger than the whole store: not kept
    assert await store.get("big") is None and store.size_bytes == 80
    await store.put("a", b"w" * 10)                   # replacing counts the new size only
    assert store.size_bytes == 50


async def test_embedded_store_entries_expire_after_ttl() -> None:
    store, clock, metrics = _store(ttl=10.0)
    await store.put("a", b"x" * 10)
    clock.advance(9.9)
    assert await store.get("a") == b"x" * 10
    clock.advance(0.2)
    assert await store.get("a") is None
    assert store.size_bytes == 0 and len(store) == 0
    await store.put("b", b"y")
    clock.advance(11)
    await store.put("c", b"z")                        # a put drops expired entries too
    assert len(store) == 1 and _value(metrics.evictions) == 0   # expiry is not eviction


# ---------------------------------------------------------------- breaker


def test_breaker_opens_after_failures_in_a_row_and_probes_once_after_reset() -> None:
    clock = FakeClock()
    breaker = Breaker(failures=3, reset_seconds=5.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    breaker.success()                                  # a success resets the count
    for _ in range(3):
        assert breaker.allow()
        breaker.failure()
    assert breaker.open and not breaker.allow()
    clock.advance(4.9)
    assert not breaker.allow()
    clock.advance(0.2)
    assert breaker.allow()                             # half-open: one probe
    assert not breaker.allow()
    breaker.failure()                                  # the probe failed: open again
    assert not breaker.allow()
    clock.advance(5.1)
    assert breaker.allow()
    breaker.success()
    assert not breaker.open and breaker.allow() and breaker.allow()


# ---------------------------------------------------------------- revisions the engines report


async def test_the_key_follows_the_revision_the_serving_engines_report(tmp_path: Path) -> None:
    from services.gateway.keys import Principal
    from services.gateway.response_cache.cache import ResponseCache
    from services.gateway.response_cache.policy import CacheStatus
    from services.gateway.served_models import ServedModel

    (tmp_path / "config.json").write_text("{}")
    clock = FakeClock()
    metrics = CacheMetrics(CollectorRegistry(), "embedded")
    cache = ResponseCache(ResponseCacheConfig(), EmbeddedStore(1 << 20, 60, clock, metrics), metrics,
                          {"m": (tmp_path, "")}, clock)
    principal = Principal("k", "acme", 0, frozenset(), 0.0, 0.0, 0.0, response_cache="on")
    fleet: dict[str, ServedModel] = {}

    async def current() -> dict[str, ServedModel]:
        return fleet

    async def ticket() -> tuple[CacheStatus, str]:
        out = await cache.lookup(_job(), _request(), principal, {})
        return out.status, out.key

    # No engine reports one: this gateway's fingerprint of the same files.
    assert await cache.revision("m") == model_revision(tmp_path)
    cache.attach_fleet(current)
    fleet["m"] = ServedModel(2, 0, frozenset({"rev-1"}))
    assert await cache.revision("m") == "rev-1"
    status, key_1 = await ticket()
    await cache._put(key_1, encode_entry(_events()))
    assert await ticket() == (CacheStatus.HIT, key_1)
    # The engines now serve another revision: another key, the old entry is never read.
    fleet["m"] = ServedModel(2, 0, frozenset({"rev-2"}))
    status, key_2 = await ticket()
    assert status == CacheStatus.MISS and key_2 != key_1
    # Mid-rollout (two revisions serving): neither read nor written.
    fleet["m"] = ServedModel(2, 0, frozenset({"rev-1", "rev-2"}))
    assert await ticket() == (CacheStatus.BYPASS, "")
