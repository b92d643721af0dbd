"""The Admin service over real gRPC in process: never open without a key,
token checks, each knob, invalid input, the engine commands a drain sends,
and the log line of every call."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from services.common.clock import FakeClock
from services.common.config import ConfigError, MeshConfig, config_from_dict, validate_config
from services.common.config.scheduler import AdminKeyConfig
from services.common.grpc_server import client_options
from services.common.proto.kvmesh.v1 import admin_pb2, admin_pb2_grpc, scheduler_pb2_grpc
from services.common.proto.kvmesh.v1 import scheduler_pb2 as pb
from services.scheduler.admin_api import AdminKeys
from services.scheduler.server import SchedulerService

from .helpers import make_config
from .test_grpc import TIMEOUT, admit_msg, hello, wait_state

TOKEN = "s3cret-admin-token"
DIGEST = hashlib.sha256(TOKEN.encode()).hexdigest()
AUTH = (("authorization", f"Bearer {TOKEN}"),)


async def _start(keys: list[AdminKeyConfig]) -> tuple[SchedulerService, grpc.aio.Channel]:
    config = make_config(queued_update_seconds=0.1, tick_seconds=0.05, admin_keys=keys)
    service = SchedulerService(config, clock=FakeClock())
    port = await service.start(port=0)
    return service, grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=client_options())


@pytest.fixture
async def admin() -> AsyncIterator[tuple[admin_pb2_grpc.AdminStub, scheduler_pb2_grpc.SchedulerStub]]:
    service, channel = await _start([AdminKeyConfig(sha256=DIGEST.upper(), name="oncall")])
    try:
        yield admin_pb2_grpc.AdminStub(channel), scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        await channel.close()
        await service.stop(grace=0.5)


async def test_without_admin_keys_every_call_is_refused_with_how_to_configure() -> None:
    service, channel = await _start([])
    try:
        stub = admin_pb2_grpc.AdminStub(channel)
        for call in (stub.PauseClass(admin_pb2.ClassRequest(priority=2), metadata=AUTH, timeout=TIMEOUT),
                     stub.GetAdminState(admin_pb2.GetAdminStateRequest(), metadata=AUTH, timeout=TIMEOUT)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "scheduler.admin_keys" in err.value.details()
        assert not service.core.waiting.paused
    finally:
        await channel.close()
        await service.stop(grace=0.5)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)])
async def test_missing_or_wrong_token_is_unauthenticated(admin, metadata, caplog) -> None:
    stub, state = admin
    caplog.set_level(logging.INFO, "services.scheduler.admin_api")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PauseClass(admin_pb2.ClassRequest(priority=2), metadata=metadata, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not (await state.GetState(pb.GetStateRequest(), timeout=TIMEOUT)).paused_priorities
    assert "admin call refused (UNAUTHENTICATED): pause P2" in caplog.text


async def test_pause_and_resume_are_visible_and_logged(admin, caplog) -> None:
    stub, state = admin
    caplog.set_level(logging.INFO, "services.scheduler.admin_api")
    reply = await stub.PauseClass(admin_pb2.ClassRequest(priority=2), metadata=AUTH, timeout=TIMEOUT)
    assert reply.changed and list(reply.state.paused_priorities) == [2]
    again = await stub.PauseClass(admin_pb2.ClassRequest(priority=2), metadata=AUTH, timeout=TIMEOUT)
    assert not again.changed
    assert list((await state.GetState(pb.GetStateRequest(), timeout=TIMEOUT)).paused_priorities) == [2]
    assert f"admin by oncall (key {DIGEST[:12]}): pause P2 -> P2 is paused" in caplog.text
    reply = await stub.ResumeClass(admin_pb2.ClassRequest(priority=2), metadata=AUTH, timeout=TIMEOUT)
    assert reply.changed and not reply.state.paused_priorities
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PauseClass(admin_pb2.ClassRequest(priority=7), metadata=AUTH, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "P0 .. P2" in err.value.details()
    assert "pause P7 -> refused INVALID_ARGUMENT" in caplog.text


async def test_set_placement_policy(admin) -> None:
    stub, state = admin
    reply = await stub.SetPlacementPolicy(
        admin_pb2.SetPlacementPolicyRequest(policy="least_load"), metadata=AUTH, timeout=TIMEOUT)
    assert reply.changed and reply.state.policy == "least_load" and "round_robin" in reply.state.policies
    assert (await state.GetState(pb.GetStateRequest(), timeout=TIMEOUT)).policy == "least_load"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.SetPlacementPolicy(
            admin_pb2.SetPlacementPolicyRequest(policy="fastest"), metadata=AUTH, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'fastest'" in err.value.details() and "kv_precise" in err.value.details()
    assert (await state.GetState(pb.GetStateRequest(), timeout=TIMEOUT)).policy == "least_load"


async def test_drain_and_undrain_an_engine(admin) -> None:
    stub, state = admin
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.DrainEngine(admin_pb2.DrainEngineRequest(engine_id="ghost"), metadata=AUTH, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    engine = state.Connect(timeout=TIMEOUT * 3)
    await engine.write(hello("eng-1"))
    await engine.write(pb.EngineMessage(load=pb.LoadReport(serving=True, blocks_total=1000)))
    await wait_state(state, lambda s: len(s.engines) == 1 and s.engines[0].fresh)

    reply = await stub.DrainEngine(
        admin_pb2.DrainEngineRequest(engine_id="eng-1", move_running=True), metadata=AUTH, timeout=TIMEOUT)
    assert reply.changed and list(reply.state.drained_engines) == ["eng-1"]
    command = await asyncio.wait_for(engine.read(), TIMEOUT)
    assert command.WhichOneof("cmd") == "drain" and command.drain.hand_over
    seen = await state.GetState(pb.GetStateRequest(), timeout=TIMEOUT)
    assert seen.engines[0].drained_by_admin and seen.engines[0].draining
    assert list(seen.drained_engines) == ["eng-1"]

    call = state.Admit(timeout=TIMEOUT * 3)
    await call.write(admit_msg("r"))
    assert (await asyncio.wait_for(call.read(), TIMEOUT)).WhichOneof("msg") == "queued"
    reply = await stub.UndrainEngine(admin_pb2.UndrainEngineRequest(engine_id="eng-1"), metadata=AUTH,
                                     timeout=TIMEOUT)
    assert reply.changed and not reply.state.drained_engines
    command = await asyncio.wait_for(engine.read(), TIMEOUT)
    assert command.WhichOneof("cmd") == "undrain"
    msg = await asyncio.wait_for(call.read(), TIMEOUT)
    while msg.WhichOneof("msg") == "queued":
        msg = await asyncio.wait_for(call.read(), TIMEOUT)
    assert msg.placed.engine_id == "eng-1"
    call.cancel()
    engine.cancel()


def test_admin_keys_config_rules_and_file(tmp_path: Path) -> None:
    config = MeshConfig()
    config.scheduler.admin_keys = [AdminKeyConfig(sha256="abc", name="x")]
    with pytest.raises(ConfigError, match=r"scheduler.admin_keys\[0\].sha256: expected 64 hex"):
        validate_config(config)
    config.scheduler.admin_keys = [AdminKeyConfig(sha256=DIGEST, name="")]
    with pytest.raises(ConfigError, match=r"admin_keys\[0\].name: required"):
        validate_config(config)
    loaded = config_from_dict(MeshConfig, {"scheduler": {"admin_keys": [{"sha256": DIGEST, "name": "a"}]}})
    assert loaded.scheduler.admin_keys[0].name == "a"

    other = hashlib.sha256(b"other").hexdigest()
    keys_file = tmp_path / "admin-keys.yaml"
    keys_file.write_text(f"admin_keys:\n  - {{name: robot, sha256: {other}}}\n")
    config = MeshConfig()
    config.scheduler.admin_keys_file = str(keys_file)
    keys = AdminKeys(config.scheduler)
    assert len(keys) == 1
    assert str(keys.caller((("authorization", "Bearer other"),))) == f"robot (key {other[:12]})"
    keys_file.write_text(f"admin_keys:\n  - {{name: robot, sha256: {other}}}\n  - {{name: b, sha256: {other}}}\n")
    with pytest.raises(ConfigError, match="duplicate key"):
        AdminKeys(config.scheduler)
