"""The batch service as a process (`kvmesh batch`, services/batch/server.py)
in front of a fake gateway: users authenticate with their own keys, lines
leave under the internal credential with the creator's key id, and a batch
process SIGKILLed mid-batch and started again finishes the batch with every
custom_id once, resuming the lines it had in flight under their ids."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from services.batch.credential import CREDENTIAL_ENV, internal_credential
from services.common.config import ApiKeyConfig, ConfigError, MeshConfig, ModelConfig
from services.common.config.batch import BatchConfig
from services.common.health_http import HttpEndpoint
from services.gateway.keys import KeyStore
from services.launcher.ports import PortAllocator

ROOT = Path(__file__).resolve().parents[3]
USER_KEY = "batch-user-key"
INTERNAL = "the-internal-credential"
LINES = 12


class FakeGateway:
    """Answers lines; while `hold` is clear, keeps them waiting (in flight)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.hold = asyncio.Event()
        self.hold.set()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append({k.lower(): v for k, v in request.headers.items() if k.lower().startswith(
            ("authorization", "x-kvmesh-batch-"))} | {"content": body["messages"][0]["content"]})
        await self.hold.wait()
        answer = {"object": "chat.completion", "model": body["model"],
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                               "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
        return web.json_response(answer, headers={"X-Kvmesh-Batch-Queued": "0"})


@contextlib.asynccontextmanager
async def _fake_gateway() -> AsyncIterator[tuple[FakeGateway, str]]:
    gateway = FakeGateway()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", gateway.handle)
    endpoint = HttpEndpoint(app)
    try:
        yield gateway, f"http://127.0.0.1:{await endpoint.start('127.0.0.1', 0)}"
    finally:
        await endpoint.stop()


def _config(tmp_path: Path, gateway_url: str) -> tuple[Path, MeshConfig]:
    ports = PortAllocator()
    config = MeshConfig(models=[ModelConfig(name="m", path=str(tmp_path))], run_dir=str(tmp_path))
    config.gateway.api_keys = [ApiKeyConfig(sha256=hashlib.sha256(USER_KEY.encode()).hexdigest(), tenant="t")]
    config.batch = BatchConfig(port=ports.one(), metrics_port=ports.one(), gateway_url=gateway_url,
                               internal_key_sha256=hashlib.sha256(INTERNAL.encode()).hexdigest(),
                               lease_seconds=1.0, poll_seconds=0.2, max_in_flight=4)
    path = tmp_path / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))
    return path, config


def _start(path: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, CREDENTIAL_ENV: INTERNAL, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "services.cli", "--config", str(path), "batch"], env=env,
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def _until(check: object, seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while not await check():  # type: ignore[operator]
            await asyncio.sleep(0.1)


async def _ready(session: aiohttp.ClientSession, url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        async with session.get(f"{url}/health") as r:
            return r.status == 200
    return False


def _jsonl(n: int) -> bytes:
    return "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}}) + "\n"
                   for i in range(n)).encode()


async def _create_batch(session: aiohttp.ClientSession, url: str, auth: dict[str, str]) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", _jsonl(LINES), filename="in.jsonl")
    async with session.post(f"{url}/v1/files", data=form, headers=auth) as r:
        assert r.status == 200, await r.text()
        file_id = (await r.json())["id"]
    async with session.post(f"{url}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                       "completion_window": "24h"}, headers=auth) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["id"])


async def test_killed_mid_batch_and_restarted_it_finishes_with_every_custom_id_once(tmp_path: Path) -> None:
    auth = {"Authorization": f"Bearer {USER_KEY}"}
    async with _fake_gateway() as (gateway, gateway_url), aiohttp.ClientSession() as session:
        path, config = _config(tmp_path, gateway_url)
        url = f"http://127.0.0.1:{config.batch.port}"
        process = _start(path)
        try:
            await _until(lambda: _ready(session, url))
            async with session.get(f"{url}/v1/batches", headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
            gateway.hold.clear()          # lines go out and stay in flight
            batch_id = await _create_batch(session, url, auth)

            async def four_in_flight() -> bool:
                return len(gateway.seen) >= 4
            await _until(four_in_flight)
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)
        finally:
            if process.poll() is None:
                process.kill()
        first = list(gateway.seen)
        key_id = KeyStore(config.gateway).authenticate(USER_KEY).key_id
        assert {h["authorization"] for h in first} == {f"Bearer {INTERNAL}"}   # never the user's key
        assert {h["x-kvmesh-batch-key-id"] for h in first} == {key_id}
        assert all("x-kvmesh-batch-resume" not in h and float(h["x-kvmesh-batch-deadline"]) > 0 for h in first)

        gateway.hold.set()
        process = _start(path)
        try:
            await _until(lambda: _ready(session, url))

            async def done() -> bool:
                async with session.get(f"{url}/v1/batches/{batch_id}", headers=auth) as r:
                    return r.status == 200 and (await r.json())["status"] == "completed"
            await _until(done, 30.0)
            async with session.get(f"{url}/v1/batches/{batch_id}", headers=auth) as r:
                batch = await r.json()
            async with session.get(f"{url}/v1/files/{batch['output_file_id']}/content", headers=auth) as r:
                out = [json.loads(line) for line in (await r.text()).splitlines()]
            async with session.get(f"http://127.0.0.1:{config.batch.metrics_port}/metrics") as r:
                metrics = await r.text()
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(20) == 0
    assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    assert sorted(o["custom_id"] for o in out) == sorted(f"c{i}" for i in range(LINES))   # each once
    # The lines in flight at the kill were resumed under their recorded ids.
    resumed = [h for h in gateway.seen[len(first):] if h.get("x-kvmesh-batch-resume") == "1"]
    assert sorted(h["x-kvmesh-batch-request-id"] for h in resumed) == sorted(
        h["x-kvmesh-batch-request-id"] for h in first)
    assert f'kvmesh_batch_requests_total{{result="resumed"}} {float(len(first))}' in metrics


def test_the_credential_must_match_its_hash(tmp_path: Path) -> None:
    settings = BatchConfig(internal_key_sha256=hashlib.sha256(INTERNAL.encode()).hexdigest())
    assert internal_credential(settings, {CREDENTIAL_ENV: INTERNAL}) == INTERNAL
    with pytest.raises(ConfigError, match="does not match"):
        internal_credential(settings, {CREDENTIAL_ENV: "other"})
    with pytest.raises(ConfigError, match=CREDENTIAL_ENV):
        internal_credential(settings, {})
    secret = tmp_path / "credential"
    secret.write_text(INTERNAL + "\n")
    assert internal_credential(dataclasses.replace(settings, internal_key_file=str(secret)), {}) == INTERNAL
    with pytest.raises(ConfigError, match="internal_key_sha256"):
        internal_credential(BatchConfig(), {CREDENTIAL_ENV: INTERNAL})


async def test_a_drain_takes_it_out_of_rotation_and_reports(tmp_path: Path) -> None:
    """POST /drain (a preStop hook): not ready, /health 503 for Envoy's
    checks, the report says what was left; the probes live on the metrics port."""
    from services.batch.server import BatchService

    _, config = _config(tmp_path, "http://127.0.0.1:9")
    service = BatchService(config, INTERNAL)
    await service.start()   # the free ports _config picked
    api, admin = f"http://127.0.0.1:{service.port}", f"http://127.0.0.1:{service.metrics_port}"
    try:
        async with aiohttp.ClientSession() as session:
            for url in (f"{api}/health", f"{admin}/health/ready", f"{admin}/health/started"):
                async with session.get(url) as r:
                    assert r.status == 200, url
            async with session.get(f"{api}/v1/nothing") as r:
                assert r.status == 404 and (await r.json())["error"]["type"] == "invalid_request_error"
            async with session.post(f"{admin}/drain") as r:
                report = await r.json()
            assert r.status == 200 and report["status"] == "drained" and report["in_flight"] == 0
            for url in (f"{api}/health", f"{admin}/health/ready"):
                async with session.get(url) as r:
                    assert r.status == 503, url
            async with session.get(f"{admin}/metrics") as r:
                assert "kvmesh_batch_in_flight_limit" in await r.text()
    finally:
        await service.stop()
