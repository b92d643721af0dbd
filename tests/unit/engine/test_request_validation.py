"""Request validation: the rules every backend shares are the runtime's, so
each rule gets one gRPC status whichever backend runs underneath.

The table runs over the sim and over a bare backend that checks nothing
itself (and fails the test if it ever sees an id twice): the same answers
from both show the rules live in the runtime, not in a backend. vLLM's
adapter runs the same runtime (its own checks are tests/vllm's)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from engine_helpers import engine_config, engine_stub, mesh_config, prompt_of, request, started

from services.common.finish_reason import FinishReason
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.engine.backend import (
    BackendActivity,
    BackendInfo,
    EngineBackend,
    GenerationOutput,
    GenerationRequest,
    InvalidRequest,
    KvListener,
    LoadSnapshot,
)
from services.engine.errors import DuplicateRequest
from services.engine.metrics import EngineMetrics
from services.engine.runtime import EngineRuntime, validate_request
from services.engine.server import EngineService

# The sim's limits in these tests: 256 blocks x 16 tokens, a 32000-token vocabulary.
INFO = BackendInfo(model="sim", block_size=16, total_blocks=256, max_running=8,
                   max_model_len=4096, vocab_size=32000)


@dataclass
class BareBackend:
    """An EngineBackend with no checks of its own: one token per millisecond."""

    info: BackendInfo = INFO
    held: set[str] = field(default_factory=set)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        rid = request.request_id
        assert rid not in self.held, f"the runtime let {rid!r} reach the backend twice"
        self.held.add(rid)
        try:
            for _ in range(request.sampling.max_tokens):
                await asyncio.sleep(0.001)
                yield GenerationOutput(token_ids=[7], text="x")
            yield GenerationOutput(token_ids=[], text="", finish_reason=FinishReason.LENGTH,
                                   completion_tokens=request.sampling.max_tokens)
        finally:
            self.held.discard(rid)

    async def abort(self, request_id: str) -> bool:
        return False

    def load(self) -> LoadSnapshot:
        return LoadSnapshot(len(self.held), 0, 0, self.info.total_blocks, 0, 0, sorted(self.held))

    def kv_snapshot(self) -> list[int]:
        return []

    def set_kv_listener(self, listener: KvListener | None) -> None:
        pass

    def on_change(self, callback: Callable[[], None] | None) -> None:
        pass

    def set_step_observer(self, observer: object) -> None:
        pass

    def dead_reason(self) -> str | None:
        return None

    def activity(self) -> BackendActivity | None:
        return None

    async def probe(self) -> None:
        pass


BACKENDS: dict[str, Callable[[], EngineBackend | None]] = {
    "sim": lambda: None,  # EngineService builds the configured sim
    "bare": BareBackend,  # type: ignore[dict-item]  # a backend without the optional hooks
}


def message(rid: str = "x", prompt: list[int] | None = None, max_tokens: int = 5,
            priority: int = 1, resumed: int = 0, **sampling: Any) -> engine_pb2.EngineGenerateMessage:
    return engine_pb2.EngineGenerateMessage(request=engine_pb2.EngineRequest(
        request_id=rid, prompt_token_ids=[1, 2] if prompt is None else prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **sampling),
        priority=priority, resumed_tokens=resumed))


# One row per shared rule: the request, the status every backend answers, a
# word the message must contain.
INVALID = grpc.StatusCode.INVALID_ARGUMENT
RULES = {
    "empty request id": (message(rid=""), INVALID, "request_id"),
    "empty prompt": (message(prompt=[]), INVALID, "empty"),
    "max_tokens 0": (message(max_tokens=0), INVALID, "max_tokens"),
    "priority out of range": (message(priority=7), INVALID, "priority"),
    "resumed beyond the prompt": (message(resumed=3), INVALID, "resumed_tokens"),
    "token outside the vocabulary": (message(prompt=[10**6]), INVALID, "vocabulary"),
    "longer than max_model_len": (message(prompt=[1] * 4000, max_tokens=200), INVALID, "max_model_len"),
    "temperature below 0": (message(temperature=-1.0), INVALID, "sampling.temperature"),
    "temperature above 2": (message(temperature=2.5), INVALID, "sampling.temperature"),
    "top_p 0": (message(top_p=0.0), INVALID, "sampling.top_p"),
    "top_k below -1": (message(top_k=-2), INVALID, "sampling.top_k"),
    "min_p above 1": (message(min_p=1.5), INVALID, "sampling.min_p"),
    "presence_penalty above 2": (message(presence_penalty=3.0), INVALID, "sampling.presence_penalty"),
    "frequency_penalty below -2": (message(frequency_penalty=-3.0), INVALID, "sampling.frequency_penalty"),
    "repetition_penalty 0": (message(repetition_penalty=0.0), INVALID, "sampling.repetition_penalty"),
    "min_tokens above max_tokens": (message(min_tokens=9, max_tokens=5), INVALID, "sampling.min_tokens"),
}


@pytest.fixture(params=sorted(BACKENDS))
async def service(request: pytest.FixtureRequest) -> AsyncIterator[EngineService]:
    async with started(EngineService(mesh_config(), engine_config(), backend=BACKENDS[request.param]())) as svc:
        yield svc


@pytest.fixture
async def stub(service: EngineService) -> AsyncIterator[engine_pb2_grpc.EngineStub]:
    async with engine_stub(service) as client:
        yield client


async def refusal(stub: engine_pb2_grpc.EngineStub,
                  msg: engine_pb2.EngineGenerateMessage) -> grpc.aio.AioRpcError:
    call = stub.Generate()
    await call.write(msg)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        while (await call.read()) is not grpc.aio.EOF:
            pass
    return err.value


@pytest.mark.parametrize("rule", list(RULES))
async def test_every_backend_answers_a_shared_rule_alike(stub: engine_pb2_grpc.EngineStub, rule: str) -> None:
    msg, code, word = RULES[rule]
    err = await refusal(stub, msg)
    assert err.code() == code, err.details()
    assert word in err.details()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
async def test_every_backend_answers_a_duplicate_id_already_exists(backend: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # The live owner's grace (services/engine/detached.py) shortened, and the
    # sim at real speed (3,000 tokens take seconds): the fixture's instant sim
    # finished the first request in ~0.2 s, sometimes inside the grace, and
    # then the second was no duplicate any more.
    monkeypatch.setattr("services.engine.detached._RELEASE_GRACE_SECONDS", 0.1)
    config = engine_config()
    config.sim.speed_factor = 1.0
    async with started(EngineService(mesh_config(), config, backend=BACKENDS[backend]())) as service, \
            engine_stub(service) as stub:
        first = stub.Generate()
        await first.write(message("dup", prompt_of(10), max_tokens=3000))
        assert (await first.read()).HasField("delta")
        err = await refusal(stub, message("dup"))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in err.details()
        first.cancel()


async def test_every_backend_answers_a_draining_engine_unavailable(service: EngineService,
                                                                   stub: engine_pb2_grpc.EngineStub) -> None:
    service.runtime.drain()
    err = await refusal(stub, message())
    assert err.code() == grpc.StatusCode.UNAVAILABLE


async def test_an_id_reused_right_after_a_cancel_is_a_duplicate_until_the_backend_let_go() -> None:
    """The id stays live until the backend closed its stream: a request
    reusing it meanwhile is the runtime's duplicate (ALREADY_EXISTS), never a
    backend's refusal, and it runs once the backend let go."""
    backend = BareBackend()
    runtime = EngineRuntime(backend, EngineMetrics("sim", "engine-0", backend.load))  # type: ignore[arg-type]  # a backend without the optional hooks
    await runtime.start()
    generation = runtime.open(request("r", [1, 2], max_tokens=1000))
    outputs = generation.outputs()
    await anext(outputs)
    generation.cancel()
    await outputs.aclose()  # the transport is done: close()
    assert "r" in backend.held
    with pytest.raises(DuplicateRequest):
        runtime.open(request("r", [1, 2], max_tokens=2))
    async with asyncio.timeout(5):
        while runtime.live_count:
            await asyncio.sleep(0.001)
    assert backend.held == set()
    again = runtime.open(request("r", [1, 2], max_tokens=2))
    assert [out.finish_reason async for out in again.outputs()][-1] == FinishReason.LENGTH
    await runtime.stop(0.0)


@pytest.mark.parametrize(("sampling", "match"), [
    ({"temperature": "hot"}, "sampling.temperature must be a number"),
    ({"top_k": 2.5}, "sampling.top_k must be an integer"),
    ({"logprobs": True}, "sampling.logprobs must be an integer"),
    ({"top_p": float("nan")}, "sampling.top_p must be in"),
    ({"repetition_penalty": float("inf")}, "sampling.repetition_penalty must be in"),
])
def test_sampling_values_of_the_wrong_kind_are_invalid(sampling: dict[str, Any], match: str) -> None:
    """The engine's HTTP endpoint passes JSON values through unchecked."""
    with pytest.raises(InvalidRequest, match=match):
        validate_request(request("x", [1, 2], **sampling), INFO)


# Moved from the sim core's tests: these rules are the runtime's now.
@pytest.mark.parametrize(("prompt", "max_tokens", "match"), [
    ([], 4, "empty"),
    ([1] * 10, 0, "max_tokens"),
    ([1] * 4000, 200, "max_model_len"),
    ([40000], 4, "vocabulary"),
])
def test_invalid_requests(prompt: list[int], max_tokens: int, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        validate_request(request("x", prompt, max_tokens=max_tokens), INFO)


@pytest.mark.parametrize(("bias", "match"), [
    ({32000: 1.0}, "out of the vocabulary"), ({5: 100.5}, r"\[-100, 100\]"),
    (dict.fromkeys(range(301), 1.0), "at most 300"),
])
def test_logit_bias_is_checked_by_the_runtime(bias: dict[int, float], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        validate_request(request("x", [1, 2], logit_bias=bias), INFO)
    validate_request(request("x", [1, 2], logit_bias={31999: -100.0, 0: 100.0}), INFO)


def test_logit_bias_reaches_vllm_sampling_params() -> None:
    from services.engine.backend import Sampling
    from services.engine.vllm_backend.convert import sampling_kwargs

    assert sampling_kwargs(Sampling(max_tokens=3, logit_bias={7: -100.0}))["logit_bias"] == {7: -100.0}
    assert "logit_bias" not in sampling_kwargs(Sampling(max_tokens=3))
