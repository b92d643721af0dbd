"""Scheduler restarts seen from the gateway (soft state): a running request
keeps streaming from its engine and re-attaches its lease on the restarted
scheduler (`running_on_engine`), which then gets first_token and done."""

from __future__ import annotations

import asyncio

import grpc
import openai
from conftest import KEY_FULL, MODEL, AdmitRecord, FakeScheduler, Mesh
from openai.types.chat import ChatCompletionMessageParam

from services.common.proto.kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello world"}]


class ReattachingScheduler(FakeScheduler):
    """Like the real scheduler: a request `running_on_engine` a known engine
    is answered `placed` there at once (no queue)."""

    async def Admit(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - the proto's method name
        first = await context.read()
        record = AdmitRecord(first.request)
        self.admits.append(record)
        engine = first.request.running_on_engine
        await context.write(scheduler_pb2.AdmitServerMessage(placed=scheduler_pb2.Placed(
            engine_id=engine, engine_address=self.engines[engine], lease_id="lease-again")))
        while True:
            message = await context.read()
            if message is grpc.aio.EOF:
                return
            kind = message.WhichOneof("msg")
            record.messages.append(kind)
            if kind == "done":
                record.done = message.done


async def _restart_scheduler(mesh: Mesh, scheduler: FakeScheduler) -> FakeScheduler:
    """`scheduler` comes up on the dead one's address, knowing its engines."""
    scheduler.engines = dict(mesh.scheduler.engines)
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    assert server.add_insecure_port(mesh.config.gateway.scheduler_address)
    await server.start()
    mesh.servers.append(server)
    return scheduler


async def test_running_request_reattaches_after_scheduler_restart(mesh: Mesh) -> None:
    engine = mesh.engines["engine-a"]
    engine.answer_tokens, engine.token_delay = 60, 0.03
    old_server = mesh.servers[0]
    async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0, timeout=30) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, stream=True, max_tokens=60)
        text, restarted = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if restarted is None and len(text) > 0:
                await old_server.stop(0)          # the scheduler dies mid-stream
                restarted = await _restart_scheduler(mesh, ReattachingScheduler())
    assert restarted is not None
    # The stream was never interrupted: one engine call, every token.
    assert len(engine.requests) == 1
    assert chunk.choices == [] or chunk.choices[0].finish_reason in ("stop", "length")
    # The new scheduler got the lease back on the same engine, then the progress reports.
    async def reported() -> None:
        while not (restarted.admits and restarted.admits[-1].done is not None):
            await asyncio.sleep(0.02)
    await asyncio.wait_for(reported(), 10)
    again = restarted.admits[-1]
    assert again.request.running_on_engine == "engine-a"
    assert again.request.arrival_unix == mesh.scheduler.admits[0].request.arrival_unix
    assert again.messages == ["first_token", "done"]
    for server in mesh.servers[1:]:
        await server.stop(0)


async def test_queued_request_is_admitted_again_after_scheduler_restart(mesh: Mesh) -> None:
    """A request waiting in the queue when the scheduler dies is admitted
    again on the restarted one, with its original arrival time."""
    mesh.scheduler.queue_hold = asyncio.Event()          # never placed by the first scheduler
    async with openai.AsyncOpenAI(base_url=f"{mesh.http}/v1", api_key=KEY_FULL, max_retries=0, timeout=30) as c:
        request = asyncio.create_task(c.chat.completions.create(model=MODEL, messages=CHAT))

        async def queued() -> None:
            while not mesh.scheduler.admits:
                await asyncio.sleep(0.02)
        await asyncio.wait_for(queued(), 10)
        await asyncio.sleep(0.1)                           # the gateway has read its queue place
        await mesh.servers[0].stop(0)
        restarted = await _restart_scheduler(mesh, FakeScheduler())
        out = await asyncio.wait_for(request, 30)
    assert out.usage.completion_tokens == 6
    assert len(restarted.admits) == 1
    again = restarted.admits[0].request
    assert again.arrival_unix == mesh.scheduler.admits[0].request.arrival_unix and not again.running_on_engine
    text = mesh.gateway.metrics.render().decode()
    assert 'kvmesh_gateway_scheduler_readmissions_total{state="queued"} 1.0' in text
    for server in mesh.servers[1:]:
        await server.stop(0)
