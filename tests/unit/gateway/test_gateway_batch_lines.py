"""Batch lines through the gateway's HTTP API (services/gateway/batch_lines.py):
only the batch service's internal credential makes a request a batch line
(P2, `AdmitRequest.batch`, the batch's deadline, under the creator's key);
anyone else sending the batch headers is refused, never quietly admitted;
a batch line whose client leaves keeps its generation for a resume."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import conftest
import pytest
from conftest import KEY_FULL, KEY_OTHER, MODEL, Mesh, make_config, open_mesh, sha

from services.common.config import MeshConfig
from services.gateway.keys import KeyStore

INTERNAL = "batch-internal-credential"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 50}


@contextlib.asynccontextmanager
async def _mesh(model_dir: Path, internal_sha256: str = sha(INTERNAL)) -> AsyncIterator[Mesh]:
    """conftest's mesh, its config's `batch.internal_key_sha256` set."""
    def config_with_credential(*args: object, **kw: object) -> MeshConfig:
        config = make_config(*args, **kw)  # type: ignore[arg-type]  # passes conftest.make_config its own arguments
        config.batch.internal_key_sha256 = internal_sha256
        return config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conftest, "make_config", config_with_credential)
        async with open_mesh(model_dir) as mesh:
            yield mesh


def _key_id(mesh: Mesh, key: str) -> str:
    return KeyStore(mesh.config.gateway).authenticate(key).key_id


def _line(bearer: str, key_id: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {bearer}", "X-Kvmesh-Batch-Key-Id": key_id,
            "X-Kvmesh-Batch-Deadline": "4102444800.5", "X-Kvmesh-Batch-Request-Id": "batch_x-1-1", **extra}


async def _post(mesh: Mesh, headers: dict[str, str]) -> tuple[int, dict, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(f"{mesh.http}/v1/chat/completions", json=CHAT,
                                                     headers=headers) as r:
        return r.status, await r.json(), dict(r.headers)


async def test_the_internal_credential_makes_a_batch_line_under_the_creators_key(model_dir: Path) -> None:
    async with _mesh(model_dir) as mesh:
        status, body, headers = await _post(mesh, _line(INTERNAL, _key_id(mesh, KEY_FULL)))
        assert status == 200, body
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6
        request = mesh.scheduler.admits[0].request
        assert request.batch and request.batch_deadline_unix == 4102444800.5
        assert request.priority == 2 and request.tenant == "acme" and request.request_id == "batch_x-1-1"
        assert not request.resume
        # The line's timing, for the batch service's pacing.
        assert headers["X-Kvmesh-Batch-Queued"] == "1"
        assert float(headers["X-Kvmesh-Batch-Wait-Seconds"]) >= 0 <= float(headers["X-Kvmesh-Batch-Run-Seconds"])
        # A resume asks the scheduler for the kept generation under the same id.
        status, body, _ = await _post(mesh, _line(INTERNAL, _key_id(mesh, KEY_FULL), **{"X-Kvmesh-Batch-Resume": "1"}))
        assert mesh.scheduler.admits[1].request.resume and mesh.scheduler.admits[1].request.batch


@pytest.mark.parametrize("bearer", [KEY_FULL, "not-the-credential"])
async def test_a_line_cannot_be_marked_batch_without_the_internal_credential(model_dir: Path, bearer: str) -> None:
    """A user's own key (or any other) with the batch headers is refused:
    batch lines bypass the tenant queue caps."""
    async with _mesh(model_dir) as mesh:
        for headers in (_line(bearer, _key_id(mesh, KEY_FULL)), {"Authorization": f"Bearer {bearer}",
                                                                "X-Kvmesh-Batch-Deadline": "4102444800"}):
            status, body, _ = await _post(mesh, headers)
            assert status == 403 and body["error"]["code"] == "batch_not_allowed", body
        assert mesh.scheduler.admits == []
        # The same key without the headers is an ordinary request, never a batch line.
        status, _, headers = await _post(mesh, {"Authorization": f"Bearer {KEY_FULL}", "X-Priority": "2"})
        assert status == 200 and not mesh.scheduler.admits[0].request.batch
        assert "X-Kvmesh-Batch-Queued" not in headers


async def test_without_a_configured_credential_no_caller_makes_batch_lines(model_dir: Path) -> None:
    async with _mesh(model_dir, internal_sha256="") as mesh:
        status, body, _ = await _post(mesh, _line(INTERNAL, _key_id(mesh, KEY_FULL)))
        assert status == 403 and body["error"]["code"] == "batch_not_allowed"
        assert mesh.scheduler.admits == []


async def test_a_batch_line_keeps_the_creators_limits(model_dir: Path) -> None:
    """The creator's key decides the models (403) and an unknown key id is a 401."""
    async with _mesh(model_dir) as mesh:
        status, body, _ = await _post(mesh, _line(INTERNAL, _key_id(mesh, KEY_OTHER)))
        assert status == 403 and body["error"]["code"] == "model_not_allowed"
        status, body, _ = await _post(mesh, _line(INTERNAL, "0123456789ab"))
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body, _ = await _post(mesh, _line(INTERNAL, _key_id(mesh, KEY_FULL),
                                                  **{"X-Kvmesh-Batch-Deadline": "soon"}))
        assert status == 400
        assert mesh.scheduler.admits == []


async def test_a_batch_line_whose_client_left_is_kept_for_a_resume(model_dir: Path) -> None:
    """The batch service died mid-line: unlike an ordinary client's, its
    generation is not cancelled (no `cancel` to the engine, the lease kept),
    so the next batch process resumes it."""
    async with _mesh(model_dir) as mesh:
        engine = mesh.engines["engine-a"]
        engine.token_delay = 0.2
        async with aiohttp.ClientSession() as s:
            request = asyncio.create_task(s.post(f"{mesh.http}/v1/chat/completions", json=CHAT,
                                                 headers=_line(INTERNAL, _key_id(mesh, KEY_FULL))))
            async with asyncio.timeout(5):
                while not engine.requests:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
        await asyncio.sleep(0.5)
        assert engine.polite_cancels == 0
        record = mesh.scheduler.admits[0]
        assert record.done is None and "done" not in record.messages   # no withdrawal: the lease is kept


async def test_a_line_past_its_admit_by_time_is_refused_before_it_is_admitted(model_dir: Path) -> None:
    """The gateway's half of the batch ownership fence (services/batch/
    ownership.py): a line sent by an owner whose lease has run out since --
    another batch process may own the batch now -- is refused, never run;
    one within its time, or from a batch service that sends none, runs."""
    async with _mesh(model_dir) as mesh:
        key_id = _key_id(mesh, KEY_FULL)
        for admit_by in ("1000.000", "soon", "-1"):
            status, body, _ = await _post(mesh, _line(INTERNAL, key_id, **{"X-Kvmesh-Batch-Admit-By": admit_by}))
            assert (status, body["error"]["code"]) == ((409, "batch_lease_expired") if admit_by == "1000.000"
                                                       else (400, "invalid_request")), body
        assert mesh.scheduler.admits == []   # nothing reached the scheduler
        status, body, _ = await _post(mesh, _line(INTERNAL, key_id, **{"X-Kvmesh-Batch-Admit-By": "4102444800.000"}))
        assert status == 200, body
        status, body, _ = await _post(mesh, _line(INTERNAL, key_id, **{"X-Kvmesh-Batch-Request-Id": "batch_x-1-2"}))
        assert status == 200, body
        assert len(mesh.scheduler.admits) == 2
