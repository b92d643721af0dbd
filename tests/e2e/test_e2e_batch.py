"""The Batch API through Envoy on a sim mesh with two gateways and the batch
service (`kvmesh batch`), driven by the official `openai` SDK (README
"Batch API"):

- a 1,000-line batch completes with 1,000 results (one per custom_id, in
  OpenAI's output shape) while interactive P0 streams run;
- SIGKILL of the batch process that owns a running batch (found in its
  database's lease row): started again, it takes the batch over, resumes
  the lines in flight, and the batch completes, 1,000 output lines, no
  custom_id twice;
- another tenant gets 404 for the files and batches; cancel ends a batch
  `cancelled` with every line accounted for; an upload larger than Envoy's
  request body limit passes on the files route, one over
  `batch.max_file_bytes` gets 413.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sqlite3
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from _streams import stream_completion

from services.common.config import ApiKeyConfig, MeshConfig
from services.launcher.mesh import Mesh

MESH_GATEWAYS = 2
OTHER_KEY = "batch-test-other-tenant-key"
LINES = 1000
MAX_FILE_BYTES = 3 * 1024 * 1024   # above Envoy's 1 MiB request limit
BATCH_TIMEOUT = 420.0


def _tune(config: MeshConfig) -> None:
    config.gateway.api_keys.append(ApiKeyConfig(
        sha256=hashlib.sha256(OTHER_KEY.encode()).hexdigest(), tenant="batch-other-tenant"))
    config.batch.max_file_bytes = MAX_FILE_BYTES
    # A dead owner is taken over within ~3 s (resume grace 15 s: its lines in flight resume).
    config.batch.lease_seconds = 3.0
    config.batch.poll_seconds = 0.5
    config.batch.max_in_flight = 24
    config.engines.template.sim.speed_factor = 0.25


MESH_TUNE = _tune


def _client(mesh: Mesh, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.endpoints.public_http}/v1", api_key=key or mesh.api_key,
                         max_retries=3, timeout=60.0)


def _jsonl(mesh: Mesh, n: int, max_tokens: int, tag: str) -> bytes:
    model = mesh.config.engines.template.model
    lines = [json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": model, "max_tokens": max_tokens, "temperature": 0,
                                  "messages": [{"role": "user", "content": f"{tag} question {i}: why?"}]}})
             for i in range(n)]
    return ("\n".join(lines) + "\n").encode()


def _wait_batch(client: openai.OpenAI, batch_id: str, done: tuple[str, ...] = ("completed", "failed", "expired",
                                                                               "cancelled")) -> object:
    deadline = time.monotonic() + BATCH_TIMEOUT
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in done:
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} did not end in {BATCH_TIMEOUT:g}s: {batch}")


def _output_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def _db(mesh: Mesh) -> sqlite3.Connection:
    return sqlite3.connect(str(mesh.run_dir / "batch.sqlite3"), timeout=10.0)


@pytest.fixture(scope="module")
def mesh(e2e_mesh: Mesh) -> Iterator[Mesh]:
    yield e2e_mesh


async def _p0_load(mesh: Mesh, stop: asyncio.Event, results: list) -> None:
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> None:
            while not stop.is_set():
                results.append(await stream_completion(session, mesh, f"interactive {i}: tell me more", 24,
                                                       priority=0))
        await asyncio.gather(*(one(i) for i in range(3)))


async def test_sdk_batch_of_1000_completes_beside_p0_streams(mesh: Mesh) -> None:
    client = _client(mesh)
    upload = await asyncio.to_thread(client.files.create, file=("in.jsonl", _jsonl(mesh, LINES, 8, "a")),
                                     purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0
    stop, p0 = asyncio.Event(), []
    load = asyncio.create_task(_p0_load(mesh, stop, p0))
    try:
        batch = await asyncio.to_thread(client.batches.create, input_file_id=upload.id,
                                        endpoint="/v1/chat/completions", completion_window="24h",
                                        metadata={"test": "load"})
        assert batch.status == "in_progress" and batch.request_counts.total == LINES
        batch = await asyncio.to_thread(_wait_batch, client, batch.id)
    finally:
        stop.set()
        await load
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0), batch.request_counts
    assert batch.error_file_id is None and batch.metadata == {"test": "load"}
    out = await asyncio.to_thread(_output_lines, client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"a-{i}" for i in range(LINES))
    first = out[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["message"]["content"]
    bad = [r for r in p0 if not r.ok]
    assert p0 and not bad, f"{len(bad)} of {len(p0)} interactive streams failed: {bad[:3]}"
    listed = await asyncio.to_thread(client.batches.list, limit=100)
    assert batch.id in [b.id for b in listed.data]


def _batch_counter(mesh: Mesh, name: str, labels: str) -> float:
    """A counter from the batch service's /metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{mesh.config.batch.metrics_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    wanted = f"{name}{{{labels}}} "
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(wanted)), 0.0)


def test_sigkill_of_the_batch_process_mid_batch(mesh: Mesh) -> None:
    client = _client(mesh)
    upload = client.files.create(file=("kill.jsonl", _jsonl(mesh, LINES, 24, "k")), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + BATCH_TIMEOUT
    while client.batches.retrieve(batch.id).request_counts.completed < 150:
        assert time.monotonic() < deadline, "the batch made no progress"
        time.sleep(0.2)
    with _db(mesh) as db:
        owner, epoch = db.execute("SELECT owner, epoch FROM leases WHERE batch_id = ?", (batch.id,)).fetchone()
        running = db.execute("SELECT COUNT(*) FROM lines WHERE batch_id = ? AND state = 'running'",
                             (batch.id,)).fetchone()[0]
    pid = int(owner.split("/pid-")[1].split("/")[0])
    assert pid == mesh.pid("batch"), (owner, pid)
    os.kill(pid, signal.SIGKILL)
    mesh.wait("batch", 30)
    mesh.restart("batch")
    done = _wait_batch(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0), done.request_counts
    out = _output_lines(client, done.output_file_id)
    ids = [o["custom_id"] for o in out]
    assert len(ids) == LINES and sorted(set(ids)) == sorted(f"k-{i}" for i in range(LINES)), "duplicate/missing"
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 24 for o in out)
    with _db(mesh) as db:
        new_owner, new_epoch = db.execute("SELECT owner, epoch FROM leases WHERE batch_id = ?",
                                          (batch.id,)).fetchone()
    assert new_owner != owner and new_epoch == epoch + 1, (owner, epoch, new_owner, new_epoch)
    assert running > 0, "no line was in flight when the owner was killed"
    # The new owner re-attached to the dead one's generations rather than running them again.
    resumed = _batch_counter(mesh, "kvmesh_batch_requests_total", 'result="resumed"')
    assert resumed >= 1, f"none of the {running} lines in flight at the kill was resumed"


def test_tenant_isolation_and_upload_limits(mesh: Mesh) -> None:
    client, other = _client(mesh), _client(mesh, OTHER_KEY)
    # Larger than Envoy's 1 MiB body limit, within batch.max_file_bytes: passes on the files route.
    big = _jsonl(mesh, 6000, 4, "big")
    assert len(big) > 1024 * 1024
    upload = client.files.create(file=("big.jsonl", big), purpose="batch")
    assert upload.bytes == len(big)
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("huge.jsonl", b"x" * (MAX_FILE_BYTES + 1024)), purpose="batch")
    assert too_large.value.status_code == 413
    small = client.files.create(file=("s.jsonl", _jsonl(mesh, 3, 4, "s")), purpose="batch")
    batch = client.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: other.files.retrieve(small.id), lambda: other.files.content(small.id),
                 lambda: other.files.delete(small.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id),
                 lambda: other.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert small.id not in [f.id for f in other.files.list()]
    assert batch.id not in [b.id for b in other.batches.list()]
    assert _wait_batch(client, batch.id).status == "completed"
    client.files.delete(upload.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_invalid_input_fails_the_batch_with_errors(mesh: Mesh) -> None:
    client = _client(mesh)
    model = mesh.config.engines.template.model
    lines = [{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}},
             {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}},
             {"custom_id": "y", "method": "POST", "url": "/v1/completions", "body": {"model": model}}]
    bad = client.files.create(file=("bad.jsonl", "\n".join(json.dumps(x) for x in lines).encode()),
                              purpose="batch")
    batch = client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 2), ("invalid_url", 3)]
    # A line whose body is no valid request fails alone: a 400 in the error file.
    lines = [lines[0], {"custom_id": "z", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": model, "messages": []}}]
    mixed = client.files.create(file=("mixed.jsonl", "\n".join(json.dumps(x) for x in lines).encode()),
                                purpose="batch")
    done = _wait_batch(client, client.batches.create(input_file_id=mixed.id, endpoint="/v1/chat/completions",
                                                     completion_window="24h").id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    errors = _output_lines(client, done.error_file_id)
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("z", 400)]


def test_cancel_stops_the_batch(mesh: Mesh) -> None:
    client = _client(mesh)
    upload = client.files.create(file=("c.jsonl", _jsonl(mesh, LINES, 64, "c")), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + BATCH_TIMEOUT
    while client.batches.retrieve(batch.id).request_counts.completed < 20:
        assert time.monotonic() < deadline, "the batch made no progress"
        time.sleep(0.2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts.completed < LINES, counts
    out = _output_lines(client, done.output_file_id)
    errors = _output_lines(client, done.error_file_id)
    ids = [o["custom_id"] for o in out + errors]
    assert sorted(ids) == sorted(f"c-{i}" for i in range(LINES)), "a line is missing or twice"
    assert len(out) == counts.completed
    assert {e["error"]["code"] for e in errors if e["response"] is None} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(client.batches.list(limit=100).data[-1].id)


def test_scheduler_sigkill_mid_batch_loses_nothing(mesh: Mesh) -> None:
    """Last in the module: the scheduler is SIGKILLed mid-batch and started
    again; lines in flight re-attach, queued ones are
    re-admitted, refusals meanwhile are waited out -- every line once."""
    client = _client(mesh)
    n = 400
    upload = client.files.create(file=("sched.jsonl", _jsonl(mesh, n, 24, "s")), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + BATCH_TIMEOUT
    while client.batches.retrieve(batch.id).request_counts.completed < 50:
        assert time.monotonic() < deadline, "the batch made no progress"
        time.sleep(0.2)
    pid = mesh.pid("scheduler")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    mesh.wait("scheduler", 30)
    mesh.restart("scheduler")
    done = _wait_batch(client, batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (n, 0), done
    ids = [o["custom_id"] for o in _output_lines(client, done.output_file_id)]
    assert len(ids) == n and set(ids) == {f"s-{i}" for i in range(n)}
