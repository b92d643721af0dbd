"""Stream resumption after a gateway is lost (README "Resuming a stream"):
two gateways behind Envoy, streams running, one gateway SIGKILLed; every
client whose stream broke re-sends the same request with `Last-Event-ID`
through Envoy and gets the rest from the other gateway -- the full text
exactly once, identical to an uninterrupted run. A resume with another
tenant's key, or after the grace, is a clear 404."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
import pytest
from _streams import gateway_counter, sim_unthrottled

from services.bench.sse import SseEvents
from services.common.config import ApiKeyConfig, MeshConfig
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.launcher.mesh import Mesh

MESH_GATEWAYS = 2
# Every resume here comes within a second or two of the break (the page's
# backoff is 0.5 s); the 404 test waits the grace out.
GRACE_SECONDS = 8.0
OTHER_KEY = "resume-test-other-tenant-key"
STREAMS = 8
MAX_TOKENS = 500
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _tune(config: MeshConfig) -> None:
    config.resume.grace_seconds = GRACE_SECONDS
    config.gateway.api_keys.append(ApiKeyConfig(
        sha256=hashlib.sha256(OTHER_KEY.encode()).hexdigest(), tenant="other-tenant"))


MESH_TUNE = _tune


@dataclass
class Client:
    """One client's view: the text, the last event id, how it ended."""

    prompt: str
    text: str = ""
    last_id: str | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    done: bool = False
    resumes: int = 0
    error: str | None = None


def _body(mesh: Mesh, prompt: str) -> dict:
    return {"model": mesh.config.engines.template.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}


async def _stream(session: aiohttp.ClientSession, url: str, mesh: Mesh, client: Client, key: str,
                  started: asyncio.Event | None = None) -> int:
    """One attempt (a resume when the client has a last id); returns the
    HTTP status. A broken connection leaves `done` False."""
    headers = {"Authorization": f"Bearer {key}"}
    if client.last_id is not None:
        headers["Last-Event-ID"] = client.last_id
    try:
        async with session.post(f"{url}/v1/completions", json=_body(mesh, client.prompt), headers=headers) as resp:
            if resp.status != 200:
                client.error = (await resp.text())[:500]
                return resp.status
            events = SseEvents(resp.content)
            async for event in events:
                client.last_id = events.last_id
                for choice in event.get("choices", ()):
                    client.text += choice.get("text") or ""
                    client.finish_reason = choice.get("finish_reason") or client.finish_reason
                    if started is not None and client.text:
                        started.set()
                if event.get("usage"):
                    client.usage = event["usage"]
            client.done = events.done
            return resp.status
    except (TimeoutError, aiohttp.ClientError):
        return 0


async def _until_done(session: aiohttp.ClientSession, mesh: Mesh, client: Client,
                      started: asyncio.Event) -> None:
    url = mesh.endpoints.public_http
    status = await _stream(session, url, mesh, client, mesh.api_key, started)
    while not client.done and status in (0, 200) and client.resumes < 5:
        assert client.last_id is not None, "the stream broke before its first event"
        client.resumes += 1
        status = await _stream(session, url, mesh, client, mesh.api_key)
    assert client.done, f"status {status}: {client.error}"


async def _reference(mesh: Mesh, prompts: list[str]) -> list[Client]:
    """The uninterrupted answers, all at once and the sim unthrottled (its
    text is a pure function of the tokens before it, whatever the batch or
    the speed)."""
    with sim_unthrottled(mesh):
        return await _references(mesh, prompts)


async def _references(mesh: Mesh, prompts: list[str]) -> list[Client]:
    async with aiohttp.ClientSession() as session:
        clients = [Client(p) for p in prompts]
        statuses = await asyncio.gather(*(_stream(session, mesh.endpoints.public_http, mesh, client, mesh.api_key)
                                          for client in clients))
        assert statuses == [200] * len(clients)
        assert all(client.done for client in clients)
        return clients


async def _kill_mid_stream(mesh: Mesh, prompts: list[str]) -> list[Client]:
    clients = [Client(p) for p in prompts]
    started = [asyncio.Event() for _ in prompts]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = [asyncio.create_task(_until_done(session, mesh, c, s)) for c, s in zip(clients, started)]
        async with asyncio.timeout(120):
            await asyncio.gather(*(s.wait() for s in started))
        await asyncio.to_thread(mesh.kill, "gateway-1")
        await asyncio.gather(*tasks)
    return clients


def test_sigkilled_gateway_streams_resume_exactly_once(e2e_mesh: Mesh) -> None:
    prompts = [f"Resume stream {i}: tell me a long story about gateways." for i in range(STREAMS)]
    want = asyncio.run(_reference(e2e_mesh, prompts))
    got = asyncio.run(_kill_mid_stream(e2e_mesh, prompts))
    assert sum(c.resumes > 0 for c in got) >= 1, "no stream ran on the killed gateway"
    for reference, client in zip(want, got):
        assert client.text == reference.text, f"resumed {client.resumes}x: text differs"
        assert client.finish_reason == reference.finish_reason
        assert client.usage is not None and reference.usage is not None
        assert client.usage["completion_tokens"] == reference.usage["completion_tokens"]
        assert client.usage["prompt_tokens"] == reference.usage["prompt_tokens"]
    e2e_mesh.restart("gateway-1")


async def _detached_stream(mesh: Mesh, client: Client) -> None:
    """A stream straight to gateway-1, which is killed after a few events."""
    started = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        task = asyncio.create_task(_stream(session, mesh.endpoints.gateway_http[1], mesh, client,
                                           mesh.api_key, started))
        async with asyncio.timeout(60):
            await started.wait()
        await asyncio.to_thread(mesh.kill, "gateway-1")
        await task
    assert not client.done and client.last_id is not None


async def _resume_status(mesh: Mesh, client: Client, key: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        copy = Client(client.prompt, last_id=client.last_id)
        status = await _stream(session, mesh.endpoints.public_http, mesh, copy, key)
        return status, json.loads(copy.error or "{}")


def test_resume_with_another_key_or_after_the_grace_is_a_404(e2e_mesh: Mesh) -> None:
    client = Client("Resume stream refused: tell me a long story about keys.")
    asyncio.run(_detached_stream(e2e_mesh, client))
    status, body = asyncio.run(_resume_status(e2e_mesh, client, OTHER_KEY))
    assert status == 404 and body["error"]["code"] == "resume_not_found", body
    # Nobody resumes it: after the grace it is gone for its own key too.
    asyncio.run(asyncio.sleep(GRACE_SECONDS + 3))
    status, body = asyncio.run(_resume_status(e2e_mesh, client, e2e_mesh.api_key))
    assert status == 404 and body["error"]["code"] == "resume_not_found", body
    e2e_mesh.restart("gateway-1")


def _generate_request(mesh: Mesh, resume: inference_pb2.ResumeFrom | None = None) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest(
        model=mesh.config.engines.template.model, prompt="Resume over gRPC: a long story about streams.",
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    if resume is not None:
        request.resume.CopyFrom(resume)
    return request


def _read(call: object, events: list[inference_pb2.GenerateEvent], until: int | None = None) -> None:
    """Read a Generate call into `events` (all of it, or `until` deltas)."""
    for event in call:  # type: ignore[attr-defined]  # a grpc Generate call, typed object here
        events.append(event)
        if until is not None and sum(e.HasField("delta") for e in events) >= until:
            return


def test_grpc_stream_resumes_with_resume_from(e2e_mesh: Mesh) -> None:
    meta = [("authorization", f"Bearer {e2e_mesh.api_key}")]
    with grpc.insecure_channel(e2e_mesh.endpoints.public_grpc) as channel, sim_unthrottled(e2e_mesh):
        want = list(inference_pb2_grpc.InferenceStub(channel).Generate(
            _generate_request(e2e_mesh), metadata=meta, timeout=120))
    first: list[inference_pb2.GenerateEvent] = []
    with grpc.insecure_channel(e2e_mesh.endpoints.gateway_grpc[1]) as direct:
        # Held until the gateway is dead: a call dropped (garbage-collected)
        # first is a client's polite cancel, and the engine rightly ends the
        # generation instead of keeping it for a resume (lost that race once
        # on a loaded CI machine).
        call = inference_pb2_grpc.InferenceStub(direct).Generate(
            _generate_request(e2e_mesh), metadata=meta, timeout=120)
        _read(call, first, until=5)
        e2e_mesh.kill("gateway-1")
        call.cancel()
    last = [e for e in first if e.HasField("delta")][-1]
    rest: list[inference_pb2.GenerateEvent] = []
    resume = inference_pb2.ResumeFrom(request_id=last.request_id, last_index=last.index)
    try:
        with grpc.insecure_channel(e2e_mesh.endpoints.public_grpc) as channel:
            _read(inference_pb2_grpc.InferenceStub(channel).Generate(
                _generate_request(e2e_mesh, resume), metadata=meta, timeout=120), rest)
    finally:  # the next test needs both gateways, also after a failure here
        e2e_mesh.restart("gateway-1")

    def text(events: list[inference_pb2.GenerateEvent]) -> str:
        return "".join(e.delta.text for e in events if e.HasField("delta"))

    assert text(first) + text(rest) == text(want)
    assert rest[-1].finished.usage.completion_tokens == want[-1].finished.usage.completion_tokens
    assert rest[-1].finished.finish_reason == want[-1].finished.finish_reason


async def _busy_gateway(mesh: Mesh) -> str:
    """The gateway replica streaming the (only) running request."""
    for _ in range(200):
        for replica in range(MESH_GATEWAYS):
            if await asyncio.to_thread(gateway_counter, mesh, "kvmesh_gateway_active_streams", "", replica) > 0:
                return f"gateway-{replica}"
        await asyncio.sleep(0.05)
    raise AssertionError("no gateway reports the page's stream")


@pytest.mark.browser
async def test_chat_page_resumes_a_dropped_stream_by_itself(e2e_mesh: Mesh) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (scripts/setup.sh installs Debian's chromium as root)")
    from playwright.async_api import async_playwright  # only this test needs it

    question = "Tell me a long story about a gateway that came back."
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page()
            console: list[str] = []
            page.on("console", lambda m: console.append(m.text))
            await page.goto(f"{e2e_mesh.endpoints.public_http}/")
            await page.fill("#key", e2e_mesh.api_key)
            await page.dispatch_event("#key", "change")
            model = e2e_mesh.config.engines.template.model
            await page.wait_for_selector(f"#model option[value='{model}']", state="attached", timeout=120_000)
            await page.select_option("#model", model)
            await page.fill("#max-tokens", "1500")
            answer = page.locator(".turn.assistant .text").last

            async def ask() -> None:
                await page.fill("#question", question)
                await page.click("#send")

            async def ended() -> str:
                await page.wait_for_selector("#status:not([data-state='generating']):not([data-state='connecting'])"
                                             ":not([data-state='resuming']):not([data-state='queued'])",
                                             timeout=120_000)
                return f"{await page.get_attribute('#status', 'data-state')}: {await page.text_content('#status')}"

            with sim_unthrottled(e2e_mesh):  # uninterrupted: the reference answer (its text is all that counts)
                await ask()
                first_end = await ended()
            assert first_end.startswith("done"), (first_end, console, await answer.get_attribute("data-resumes"),
                                                  await answer.get_attribute("data-deltas"))
            want = await answer.text_content()
            await page.click("#clear")
            await ask()
            await page.wait_for_selector("#status[data-state='generating']", timeout=60_000)
            await asyncio.to_thread(e2e_mesh.kill, await _busy_gateway(e2e_mesh))
            status = await ended()
            assert status.startswith("done"), status
            assert int(await answer.get_attribute("data-resumes") or 0) >= 1
            assert await answer.text_content() == want
        finally:
            await browser.close()
    for replica in range(MESH_GATEWAYS):
        if not e2e_mesh.is_running(f"gateway-{replica}"):
            e2e_mesh.restart(f"gateway-{replica}")
