"""Structured outputs on a real vLLM-CPU engine (SmolLM2-135M-Instruct):
vLLM's own path for fresh requests, kvmesh's resumed-grammar logits
processor (services/engine/vllm_backend/resume_grammar.py) after a
migration, and constraints xgrammar refuses as InvalidRequest before any
token. One engine for the module; asserts behaviour, never speed."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from _vllm_compile_cache import share_compile_cache

from services.common.config import EngineConfig, MeshConfig, ModelConfig
from services.common.openai_api.structured_outputs import StructuredSpec
from services.engine.backend import GenerationOutput, GenerationRequest, InvalidRequest, Sampling

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / ".models" / "SmolLM2-135M-Instruct"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    from jsonschema import Draft202012Validator
    return not list(Draft202012Validator(schema).iter_errors(value))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smol() -> AsyncIterator[tuple[Any, Any]]:
    if not (MODEL / "config.json").is_file():
        pytest.skip(f"{MODEL} missing: run `make setup`")
    from transformers import AutoTokenizer

    from services.engine.vllm_backend import VllmBackend
    config = MeshConfig(models=[ModelConfig(name="smol", path=str(MODEL))],
                        run_dir=f"/tmp/kvs-{os.getpid()}")  # short: vLLM ipc paths are limited to 107 bytes
    engine = EngineConfig(engine_id="vllm-structured", backend="vllm", model="smol")
    engine.vllm.max_num_seqs = 4
    engine.vllm.kv_cache_gib = 0.5  # the 8192-token context needs 0.35 GiB
    share_compile_cache(Path(config.run_dir) / "vllm" / engine.engine_id)
    b = VllmBackend(config, engine)
    try:
        await b.start()
        yield b, AutoTokenizer.from_pretrained(str(MODEL))
    finally:
        await b.stop()
        shutil.rmtree(config.run_dir, ignore_errors=True)


def _prompt(tokenizer: Any, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


async def _run(backend: Any, request: GenerationRequest) -> list[GenerationOutput]:
    return [out async for out in backend.generate(request)]


def _sampling(spec: StructuredSpec, **kw: Any) -> Sampling:
    return Sampling(max_tokens=kw.pop("max_tokens", 120), structured=spec, **kw)


async def test_fresh_json_schema_is_valid(smol: tuple[Any, Any]) -> None:
    backend, tok = smol
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    for i, temperature in enumerate((0.0, 1.0, 1.0)):
        outs = await _run(backend, GenerationRequest(f"fresh-{i}", _prompt(tok, "Describe a person as JSON."),
                                                     _sampling(spec, temperature=temperature, seed=i)))
        text = "".join(o.text for o in outs)
        assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "stop", text
        assert _valid(json.loads(text), SCHEMA), text


async def test_resumed_json_schema_continues_the_grammar(smol: tuple[Any, Any]) -> None:
    """The first K tokens of a constrained generation, then a resumed request
    (prompt + those K tokens, resumed_tokens=K) on the same engine: the whole
    text is valid JSON of the schema, for several cut points and samples."""
    backend, tok = smol
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    prompt = _prompt(tok, "Describe a person as JSON.")
    for i, (cut, temperature) in enumerate(((3, 0.0), (7, 1.0), (12, 1.0))):
        first = await _run(backend, GenerationRequest(f"cut-{i}", prompt, _sampling(spec, temperature=temperature,
                                                                                    seed=10 + i, max_tokens=cut)))
        head = [t for o in first for t in o.token_ids]
        assert len(head) == cut
        rest = await _run(backend, GenerationRequest(f"resumed-{i}", prompt + head, _sampling(
            spec, temperature=temperature, seed=20 + i, max_tokens=120), resumed_tokens=cut))
        tail = [t for o in rest for t in o.token_ids]
        text = tok.decode(head + tail, skip_special_tokens=True)
        assert rest[-1].finish_reason is not None and rest[-1].finish_reason.value == "stop", text
        assert _valid(json.loads(text), SCHEMA), text


async def test_resumed_regex_and_choice(smol: tuple[Any, Any]) -> None:
    backend, tok = smol
    prompt = _prompt(tok, "Give a code.")
    for spec, check in (
        (StructuredSpec("regex", r"[A-Z]{3}-[0-9]{4}"), lambda s: re.fullmatch(r"[A-Z]{3}-[0-9]{4}", s)),
        (StructuredSpec("choice", json.dumps(["alpha centauri", "beta pictoris"])),
         lambda s: s in ("alpha centauri", "beta pictoris")),
    ):
        first = await _run(backend, GenerationRequest(f"h-{spec.kind}", prompt,
                                                      _sampling(spec, temperature=1.0, seed=3, max_tokens=2)))
        head = [t for o in first for t in o.token_ids]
        rest = await _run(backend, GenerationRequest(f"r-{spec.kind}", prompt + head,
                                                     _sampling(spec, temperature=1.0, seed=4), resumed_tokens=2))
        text = tok.decode(head + [t for o in rest for t in o.token_ids], skip_special_tokens=True)
        assert check(text), text


@pytest.mark.parametrize("resumed", [0, 2])
@pytest.mark.parametrize("spec", [
    StructuredSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})),
    StructuredSpec("regex", "(?=lookahead)x"),
    StructuredSpec("grammar", 'root ::= "a" | undefined_rule'),
])
async def test_constraints_xgrammar_refuses_are_invalid_requests(smol: tuple[Any, Any], spec: StructuredSpec,
                                                                 resumed: int) -> None:
    backend, tok = smol
    prompt = _prompt(tok, "x") + ([tok.encode("a")[0]] * resumed)
    with pytest.raises(InvalidRequest):
        await _run(backend, GenerationRequest(f"bad-{spec.kind}-{resumed}", prompt, _sampling(spec),
                                              resumed_tokens=resumed))
