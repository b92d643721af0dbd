"""n > 1, echo, logit_bias, /tokenize and the served-models listing through
the whole sim mesh (scheduler, two sim engines, gateway, Envoy).

"One prefill": the copies of an n > 1 request run on choice 0's engine and
find the prompt's full blocks in its prefix cache -- asserted on the sim
engines' own vllm:prefix_cache_* counters. The last test kills the engines
(the module's mesh is done after it)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest
from _streams import engine_counters

from services.launcher.mesh import Mesh

MODEL = "tiny-llama"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run"]
GRPCURL = str(Path(sys.prefix) / "bin" / "grpcurl")
LONG = "the quick brown fox jumps over the lazy dog " * 30


def client(mesh: Mesh) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh.endpoints.public_http}/v1", api_key=mesh.api_key, max_retries=0,
                              timeout=60)


async def test_n3_one_prefill_on_one_engine(e2e_mesh: Mesh) -> None:
    block = e2e_mesh.config.engines.template.block_size
    hits0 = engine_counters(e2e_mesh, "vllm:prefix_cache_hits_total")
    done0 = engine_counters(e2e_mesh, "vllm:request_success_total")
    async with client(e2e_mesh) as c:
        out = await c.completions.create(model=MODEL, prompt=LONG, n=3, max_tokens=12, temperature=0.8, seed=1)
    prompt = out.usage.prompt_tokens
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert 3 <= out.usage.completion_tokens <= 36 and all(ch.text for ch in out.choices)
    hits = [a - b for a, b in zip(engine_counters(e2e_mesh, "vllm:prefix_cache_hits_total"), hits0, strict=True)]
    done = [a - b for a, b in zip(engine_counters(e2e_mesh, "vllm:request_success_total"), done0, strict=True)]
    assert sorted(done) == [0, 3], done                    # placed together
    # Copies 1 and 2 found every full block of the prompt cached: it was prefilled once.
    assert sum(hits) >= 2 * (prompt - block), (hits, prompt)
    assert out.usage.prompt_tokens_details.cached_tokens >= prompt - block


async def _tokens(mesh: Mesh, text: str) -> list[int]:
    async with aiohttp.ClientSession() as s, s.post(
        f"{mesh.endpoints.public_http}/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False},
        headers={"Authorization": f"Bearer {mesh.api_key}"},
    ) as r:
        assert r.status == 200
        return list((await r.json())["tokens"])


async def test_n3_stream_through_envoy(e2e_mesh: Mesh) -> None:
    async with client(e2e_mesh) as c:
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=8, stream=True,
            stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
    texts = {i: "".join(ch.choices[0].delta.content or "" for ch in chunks
                        if ch.choices and ch.choices[0].index == i) for i in range(3)}
    assert all(texts.values())
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason) == [0, 1, 2]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens <= 24 and usage.prompt_tokens > 0


async def test_echo_logit_bias_and_tokenize_round_trip(e2e_mesh: Mesh) -> None:
    ids = await _tokens(e2e_mesh, " fox")
    async with client(e2e_mesh) as c:
        echoed = await c.completions.create(model=MODEL, prompt="Once upon", echo=True, max_tokens=4)
        forced = await c.completions.create(model=MODEL, prompt="Once upon", max_tokens=4,
                                            logit_bias={str(ids[-1]): 100}, extra_body={"ignore_eos": True})
        plain = await c.completions.create(model=MODEL, prompt="Once upon", max_tokens=4)
        banned = {str(t): -100 for t in await _tokens(e2e_mesh, plain.choices[0].text)}
        other = await c.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, logit_bias=banned)
    assert echoed.choices[0].text.startswith("Once upon")
    assert forced.usage.completion_tokens == 4 and forced.choices[0].text.count("fox") == 4
    assert other.choices[0].text != plain.choices[0].text   # the sim is greedy: only the ban changed it
    async with aiohttp.ClientSession() as s, s.post(
        f"{e2e_mesh.endpoints.public_http}/detokenize", json={"model": MODEL, "tokens": ids},
        headers={"Authorization": f"Bearer {e2e_mesh.api_key}"},
    ) as r:
        assert (await r.json())["prompt"].endswith("fox")


def test_grpcurl_n_logit_bias_and_tokenize_through_envoy(e2e_mesh: Mesh) -> None:
    """The README's grpcurl lines (reflection through Envoy), and the same
    RPCs as JSON through Envoy's transcoder (the browser bridge)."""
    auth = f"authorization: Bearer {e2e_mesh.api_key}"
    chat = {"model": MODEL, "n": 2, "messages": [{"role": "user", "content": "hi"}],
            "sampling": {"max_tokens": 4, "logit_bias": {"7": -100}}}
    out = subprocess.run([GRPCURL, "-plaintext", "-H", auth, "-d", json.dumps(chat), e2e_mesh.endpoints.public_grpc,
                          "kvmesh.v1.Inference/Chat"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count('"finished"') == 2 and '"choice_index": 1' in out.stdout
    out = subprocess.run([GRPCURL, "-plaintext", "-H", auth, "-d", json.dumps({"model": MODEL, "prompt": "hi"}),
                          e2e_mesh.endpoints.public_grpc, "kvmesh.v1.Inference/Tokenize"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and '"tokens"' in out.stdout, out.stderr
    headers = {"Authorization": f"Bearer {e2e_mesh.api_key}", "Content-Type": "application/json"}
    request = urllib.request.Request(f"{e2e_mesh.endpoints.public_http}/v1/grpc/tokenize", headers=headers,
                                     data=json.dumps({"model": MODEL, "prompt": "hi"}).encode())
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert json.loads(resp.read())["count"] > 0
    request = urllib.request.Request(f"{e2e_mesh.endpoints.public_http}/v1/grpc/models", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert [m["id"] for m in json.loads(resp.read())["models"]] == [MODEL]


@pytest.mark.browser
async def test_chat_page_offers_only_served_models(e2e_mesh: Mesh) -> None:
    """SmolLM2 is configured but no engine of this mesh serves it: the
    page's model picker offers tiny-llama alone."""
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (scripts/setup.sh installs Debian's chromium as root)")
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            await page.goto(f"{e2e_mesh.endpoints.public_http}/")
            await page.fill("#key", e2e_mesh.api_key)
            await page.dispatch_event("#key", "change")
            await page.wait_for_selector(f"#model option[value='{MODEL}']", state="attached", timeout=120_000)
            values = await page.eval_on_selector_all("#model option", "els => els.map(e => e.value)")
        finally:
            await browser.close()
    assert values == [MODEL]


async def test_models_lists_what_is_served_then_not(e2e_mesh: Mesh) -> None:
    """tiny-llama (2 sim engines) is listed; SmolLM2, configured but served by
    no engine here, is not. Once the engines are gone, nothing is."""
    async with client(e2e_mesh) as c:
        models = {m.id: m.model_extra for m in (await c.models.list()).data}
    assert set(models) == {MODEL} and models[MODEL]["engines"] == 2 and models[MODEL]["max_model_len"] > 0
    e2e_mesh.kill("engine-0")
    e2e_mesh.kill("engine-1")
    deadline = time.monotonic() + 60
    async with client(e2e_mesh) as c:
        while (await c.models.list()).data:
            assert time.monotonic() < deadline, "the listing kept a model no engine serves"
            await asyncio.sleep(0.5)
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve(MODEL)
