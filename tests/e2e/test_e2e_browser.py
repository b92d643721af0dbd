"""The chat page in headless Chromium, through the real Envoy and mesh.

The mesh has two single-slot sim engines, so two long requests fill it and
the page's request really waits in the scheduler's queue: the page must show
its queue position, then stream tokens one by one once a slot frees, and its
stop button must free the engine's blocks.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import aiohttp
import pytest
from _streams import engine_infos as _engine_infos
from _streams import eventually as _eventually

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
MODEL = "tiny-llama"
MESH_TOPOLOGY = "tests/e2e/topology-e2e.yaml"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    # One running request per engine and no engine-side queue: a third
    # request must wait in the scheduler.
    config.engines.template.max_running = 1
    config.scheduler.engine_queue_slack = 0
    config.scheduler.queued_update_seconds = 0.2


async def _blocker(session: aiohttp.ClientSession, mesh: Mesh, started: asyncio.Event) -> None:
    """A long streamed request that holds one engine slot until cancelled."""
    body = {"model": MODEL, "stream": True, "max_tokens": 1800,
            "messages": [{"role": "user", "content": "Hold this engine for a while."}]}
    async with session.post(f"{mesh.endpoints.public_http}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {mesh.api_key}"}) as resp:
        assert resp.status == 200
        async for _line in resp.content:
            started.set()


async def test_chat_page_queues_streams_and_stop_frees_blocks(e2e_mesh: Mesh) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (scripts/setup.sh installs Debian's chromium as root)")
    from playwright.async_api import async_playwright  # only this test needs it

    await _eventually(lambda: all(i.running == 0 for i in _engine_infos(e2e_mesh)), 30, "idle engines")
    ARTIFACTS.mkdir(exist_ok=True)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    started = [asyncio.Event(), asyncio.Event()]
    blockers = [asyncio.create_task(_blocker(session, e2e_mesh, ev)) for ev in started]
    try:
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
        await _eventually(lambda: sum(i.running for i in _engine_infos(e2e_mesh)) == 2, 30,
                          "both engine slots taken")
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                page = await browser.new_page(viewport={"width": 1000, "height": 760})
                console: list[str] = []
                page.on("console", lambda m: console.append(m.text))
                await page.goto(f"{e2e_mesh.endpoints.public_http}/")
                assert await page.title() == "kvmesh chat"
                await page.fill("#key", e2e_mesh.api_key)
                await page.dispatch_event("#key", "change")
                await page.wait_for_selector(f"#model option[value='{MODEL}']", state="attached",
                                             timeout=120_000)
                await page.select_option("#model", MODEL)
                await page.fill("#max-tokens", "1500")
                await page.fill("#question", "Tell me a very long story about a mesh of engines.")
                await page.click("#send")

                # The mesh is full: the page shows where its request waits.
                await page.wait_for_selector("#status[data-state='queued'][data-queue-position='1']",
                                             timeout=120_000)
                assert "position 1" in (await page.text_content("#status") or "")
                await page.screenshot(path=str(ARTIFACTS / "chat-page-queued.png"), full_page=True)

                blockers[0].cancel()  # a slot frees; the page's request is placed
                answer = page.locator(".turn.assistant .text").last
                # Tokens arrive one by one: the visible answer grows across
                # several observations while the request is still running.
                lengths: list[int] = []
                deadline = time.monotonic() + 60
                while len(set(lengths)) < 4 and time.monotonic() < deadline:
                    lengths.append(len(await answer.text_content() or ""))
                    await asyncio.sleep(0.05)
                assert len(set(lengths)) >= 4, f"answer did not grow step by step: {lengths} {console}"
                assert lengths == sorted(lengths)
                assert int(await answer.get_attribute("data-deltas") or 0) >= 3
                assert await page.get_attribute("#status", "data-state") == "generating"

                await page.click("#stop")
                await page.wait_for_selector("#status[data-state='stopped']", timeout=60_000)
                await page.screenshot(path=str(ARTIFACTS / "chat-page.png"), full_page=True)
                stopped_at = len(await answer.text_content() or "")
                assert stopped_at > 0
                blockers[1].cancel()
                await _eventually(
                    lambda: all(i.running == 0 and i.blocks_used == 0 for i in _engine_infos(e2e_mesh)),
                    30, "the engines to free the stopped request's blocks")
                assert len(await answer.text_content() or "") == stopped_at  # nothing after stop
                assert await page.is_enabled("#send") and not await page.is_enabled("#stop")
            finally:
                await browser.close()
    finally:
        for task in blockers:
            task.cancel()
        await asyncio.gather(*blockers, return_exceptions=True)
        await session.close()
    assert (ARTIFACTS / "chat-page.png").stat().st_size > 0
