"""n > 1, echo, logit_bias, /tokenize + /detokenize and /v1/models on real
vLLM engines (SmolLM2-135M-Instruct, two engines behind Envoy), with the
official `openai` SDK.

"One prefill": the n copies run on one engine and vLLM's own prefix cache
serves them the prompt's full blocks -- asserted on the engines'
vllm:prefix_cache_hits / request_success counters, with a prompt no other
test sent (cold before this request)."""

from __future__ import annotations

import uuid

import pytest
import requests
from _streams import engine_counters, engine_infos

from services.launcher.mesh import Mesh

from .conftest import AGENT_MODEL

pytestmark = pytest.mark.vllm

PROMPT = "Here is a list of the planets of the solar system and one fact about each of them. " * 25


def post(mesh: Mesh, path: str, body: dict) -> dict:
    r = requests.post(f"{mesh.endpoints.public_http}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {mesh.api_key}"})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_n3_three_choices_one_prefill(agents_mesh: Mesh, openai_client) -> None:
    block = max(info.block_size for info in engine_infos(agents_mesh))
    hits0 = engine_counters(agents_mesh, "vllm:prefix_cache_hits_total")
    done0 = engine_counters(agents_mesh, "vllm:request_success_total")
    out = openai_client.completions.create(model=AGENT_MODEL, prompt=f"[{uuid.uuid4().hex}] {PROMPT}", n=3,
                                           max_tokens=16, temperature=1.0, seed=3)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.text for c in out.choices)
    assert len({c.text for c in out.choices}) > 1          # seeds 3, 4, 5: the choices differ
    prompt = out.usage.prompt_tokens
    assert prompt > 3 * block and 3 <= out.usage.completion_tokens <= 48
    done = [a - b for a, b in zip(engine_counters(agents_mesh, "vllm:request_success_total"), done0, strict=True)]
    hits = [a - b for a, b in zip(engine_counters(agents_mesh, "vllm:prefix_cache_hits_total"), hits0, strict=True)]
    assert sorted(done) == [0, 3], done
    # Choices 1 and 2 found the prompt's full blocks in vLLM's prefix cache.
    assert sum(hits) >= 2 * (prompt - block), (hits, prompt, block)


def test_n2_chat_stream_indexes(openai_client) -> None:
    stream = openai_client.chat.completions.create(
        model=AGENT_MODEL, messages=[{"role": "user", "content": "Name a colour."}], n=2, max_tokens=8,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    for i in (0, 1):
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == i)
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason) == [0, 1]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 16


def test_echo_and_logit_bias(agents_mesh: Mesh, openai_client) -> None:
    prompt = "The capital of France is"
    echoed = openai_client.completions.create(model=AGENT_MODEL, prompt=prompt, echo=True, max_tokens=4,
                                              temperature=0)
    assert echoed.choices[0].text.startswith(prompt) and len(echoed.choices[0].text) > len(prompt)
    plain = openai_client.completions.create(model=AGENT_MODEL, prompt=prompt, max_tokens=4, temperature=0)
    first = post(agents_mesh, "/tokenize", {"model": AGENT_MODEL, "prompt": plain.choices[0].text,
                                            "add_special_tokens": False})["tokens"][0]
    banned = openai_client.completions.create(model=AGENT_MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                              logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text
    (word,) = post(agents_mesh, "/tokenize", {"model": AGENT_MODEL, "prompt": " banana",
                                              "add_special_tokens": False})["tokens"]
    forced = openai_client.completions.create(model=AGENT_MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                              logit_bias={str(word): 100})
    assert forced.choices[0].text == post(agents_mesh, "/detokenize", {"model": AGENT_MODEL,
                                                                       "tokens": [word] * 3})["prompt"]


def test_tokenize_round_trip_matches_the_engine(agents_mesh: Mesh, openai_client) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    tok = post(agents_mesh, "/tokenize", {"model": AGENT_MODEL, "messages": messages})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    out = openai_client.chat.completions.create(model=AGENT_MODEL, messages=messages, max_tokens=1)
    assert out.usage.prompt_tokens == tok["count"]      # the ids the request ran as
    text = "kvmesh tokenizes 12 words, émojis 🙂 and spaces  too."
    ids = post(agents_mesh, "/tokenize", {"model": AGENT_MODEL, "prompt": text, "add_special_tokens": False})
    assert post(agents_mesh, "/detokenize", {"model": AGENT_MODEL, "tokens": ids["tokens"]})["prompt"] == text


def test_models_lists_only_the_served_model(agents_mesh: Mesh, openai_client) -> None:
    models = {m.id: m.model_extra for m in openai_client.models.list().data}
    assert AGENT_MODEL in models and "tiny-llama" not in models      # tiny-llama: configured, served by none
    assert models[AGENT_MODEL]["engines"] == 2 and models[AGENT_MODEL]["max_model_len"] > 0
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("tiny-llama")
