"""Structured outputs through the whole mesh on sim engines (real processes,
real Envoy; the sim's contract: services/engine/sim/structured.py): a
json_schema stream ends in JSON valid against the schema, a 400 before any
token for what is invalid (the gateway's own checks and the engine's), the
native gRPC API, and an engine SIGKILLed mid-stream: the structured streams
migrate and still end in the same valid JSON."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from _streams import gateway_counter, scheduler_state, sim_unthrottled, wait_until
from jsonschema import Draft202012Validator

from services.bench.sse import SseEvents
from services.common.openai_api.structured_outputs import StructuredSpec, structured_to_proto
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.launcher.mesh import Mesh

MODEL = "tiny-llama"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "minLength": 2}, "age": {"type": "integer", "minimum": 18},
                         "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}}}
# Long enough (about 900 pieces) to be mid-answer when the engine dies.
LONG = {"type": "object", "required": ["values"],
        "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": 7}, "minItems": 300}}}


def _valid(text: str, schema: dict[str, Any]) -> bool:
    return not list(Draft202012Validator(schema).iter_errors(json.loads(text)))


class Chat:
    """What one streaming chat client saw."""

    def __init__(self) -> None:
        self.status = 0
        self.text = ""
        self.chunks = 0
        self.finish: str | None = None
        self.error: Any = None
        self.done = False


async def _chat(session: aiohttp.ClientSession, mesh: Mesh, extra: dict[str, Any], prompt: str = "hi",
                seen: Chat | None = None) -> Chat:
    seen = seen or Chat()
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": 1500, **extra}
    async with session.post(f"{mesh.endpoints.public_http}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {mesh.api_key}"}) as resp:
        seen.status = resp.status
        if resp.status != 200:
            seen.error = await resp.json()
            return seen
        async for event in SseEvents(resp.content):
            if "error" in event:
                seen.error = event["error"]
                continue
            for choice in event.get("choices", []):
                seen.text += choice.get("delta", {}).get("content") or ""
                seen.finish = choice.get("finish_reason") or seen.finish
            seen.chunks += 1
        seen.done = True
    return seen


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}}


async def test_json_schema_stream_is_valid_json(e2e_mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as session:
        seen = await _chat(session, e2e_mesh, _schema_format(PERSON))
        assert seen.status == 200 and seen.error is None and seen.finish == "stop", (seen.status, seen.error)
        assert _valid(seen.text, PERSON), seen.text
        for extra, check in (
            ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
            ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
            ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}, lambda t: len(t) == 6 and t[3] == "-"),
        ):
            seen = await _chat(session, e2e_mesh, extra)
            assert seen.status == 200 and seen.finish == "stop" and check(seen.text), (extra, seen.text)


@pytest.mark.parametrize(("extra", "param"), [
    (_schema_format({"type": "nonsense"}), "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
async def test_invalid_constraints_are_400_naming_the_param(e2e_mesh: Mesh, extra: dict[str, Any],
                                                            param: str) -> None:
    async with aiohttp.ClientSession() as session:
        seen = await _chat(session, e2e_mesh, extra)
    assert seen.status == 400, seen.text
    assert seen.error["error"]["param"] == param


async def test_a_constraint_the_engine_refuses_is_a_400_before_any_token(e2e_mesh: Mesh) -> None:
    """The sim does not generate from grammars (its contract): the engine
    refuses before any token and the client gets a 400, not a broken stream."""
    async with aiohttp.ClientSession() as session:
        seen = await _chat(session, e2e_mesh, {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert seen.status == 400 and seen.chunks == 0, (seen.status, seen.error)
    assert "grammar" in seen.error["error"]["message"]


def test_native_grpc_takes_sampling_structured(e2e_mesh: Mesh) -> None:
    meta = [("authorization", f"Bearer {e2e_mesh.api_key}")]
    spec = StructuredSpec("json_schema", json.dumps(PERSON))
    sampling = common_pb2.SamplingParams(max_tokens=200, structured=structured_to_proto(spec))
    with grpc.insecure_channel(e2e_mesh.endpoints.public_grpc) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.ChatRequest(model=MODEL, messages=[inference_pb2.ChatMessage(role="user",
                                                                                              content="hi")],
                                            sampling=sampling)
        events = list(stub.Chat(request, metadata=meta, timeout=60))
        text = "".join(e.delta.text for e in events if e.WhichOneof("event") == "delta")
        assert _valid(text, PERSON), text
        bad = common_pb2.SamplingParams(max_tokens=20, structured=common_pb2.StructuredOutput(
            kind=common_pb2.StructuredOutput.KIND_JSON_SCHEMA, value='{"type": 5}'))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Chat(inference_pb2.ChatRequest(model=MODEL, messages=request.messages, sampling=bad),
                           metadata=meta, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.structured.value" in (info.value.details() or "")


def test_readme_grpcurl_example_gives_valid_json(e2e_mesh: Mesh) -> None:
    """The README's structured-output grpcurl command, pasted as a user
    would (key, address and model swapped for this mesh's)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Structured outputs", 1)[1]
    command = re.search(r"```bash\n(.*?grpcurl.*?)```", section, re.S)
    assert command is not None
    text = (command.group(1).replace(".venv/bin/grpcurl", str(Path(sys.prefix) / "bin" / "grpcurl"))
            .replace("127.0.0.1:8080", e2e_mesh.endpoints.public_grpc).replace("SmolLM2-135M-Instruct", MODEL))
    out = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=120, check=False,
                         env={"KEY": e2e_mesh.api_key, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    events = [json.loads(doc) for doc in re.split(r"(?<=\})\n(?=\{)", out.stdout.strip())]
    answer = "".join(e.get("delta", {}).get("text", "") for e in events)
    assert isinstance(json.loads(answer).get("name"), str), answer


async def test_engine_sigkill_mid_stream_still_ends_in_valid_json(e2e_mesh: Mesh) -> None:
    mesh, streams = e2e_mesh, 8
    extra = _schema_format(LONG)
    async with aiohttp.ClientSession() as session:
        with sim_unthrottled(mesh):  # the reference: only its text counts
            whole = await _chat(session, mesh, extra, prompt="baseline")
        assert whole.finish == "stop" and _valid(whole.text, LONG)
        migrations = gateway_counter(mesh, "kvmesh_gateway_migrations_total")
        seen = [Chat() for _ in range(streams)]
        tasks = [asyncio.create_task(_chat(session, mesh, extra, prompt=f"stream {i}", seen=s))
                 for i, s in enumerate(seen)]
        await wait_until(lambda: all(s.chunks >= 3 for s in seen) or any(s.done for s in seen), 60,
                         "every stream to be mid-answer")
        assert not any(s.done for s in seen), "a stream finished before the kill: make LONG longer"
        state = scheduler_state(mesh)
        busiest = max(state.engines, key=lambda e: e.running).engine_id if state else "engine-0"
        mesh.kill(busiest)
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
    for s in seen:
        assert s.status == 200 and s.error is None and s.finish == "stop", (s.status, s.error, s.finish)
        assert _valid(s.text, LONG) and s.text == whole.text
    assert gateway_counter(mesh, "kvmesh_gateway_migrations_total") > migrations, "no stream migrated"
    mesh.restart(busiest)
