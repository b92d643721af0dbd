"""The soak's Batch API client: one batch after another through Envoy with
the official `openai` SDK (as a user would: its retries carry it over the
seconds the batch service is down after a kill), each checked whole when it
ends -- status completed, no line failed, every custom_id in the output
exactly once with a 200 and an answer. A batch that ends otherwise, or does
not end within `BATCH_TIMEOUT_SECONDS`, counts its missing lines as lost."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, field

import openai

from scripts.chaoslib.outcomes import Target

__all__ = ["BatchTally", "run_batches"]

BATCH_TIMEOUT_SECONDS = 900.0
_DONE = ("completed", "failed", "expired", "cancelled")


@dataclass
class BatchTally:
    batches: list[str] = field(default_factory=list)   # "id: status, lines ok/total, took"
    lines: int = 0
    lines_ok: int = 0
    lost: collections.Counter[str] = field(default_factory=collections.Counter)


def _jsonl(model: str, tag: str, lines: int) -> bytes:
    rows = [json.dumps({"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": model, "max_tokens": 8, "temperature": 0,
                                 "messages": [{"role": "user", "content": f"{tag} line {i}: why?"}]}})
            for i in range(lines)]
    return ("\n".join(rows) + "\n").encode()


def check_output(rows: list[dict[str, object]], tag: str, lines: int) -> tuple[int, collections.Counter[str]]:
    """(lines answered once with a 200 and text, what is wrong with the rest)."""
    seen = collections.Counter(str(r.get("custom_id")) for r in rows)
    wrong: collections.Counter[str] = collections.Counter()
    ok = 0
    for row in rows:
        response = row.get("response")
        body = response.get("body") if isinstance(response, dict) else None
        good = (isinstance(response, dict) and response.get("status_code") == 200 and isinstance(body, dict)
                and bool(body.get("choices")))
        if seen[str(row.get("custom_id"))] > 1:
            wrong["custom_id more than once in the output"] += 1
        elif good:
            ok += 1
        else:
            wrong["line without a 200 answer"] += 1
    missing = sum(1 for i in range(lines) if f"{tag}-{i}" not in seen)
    if missing:
        wrong["line missing from the output"] += missing
    return ok, wrong


async def _one(client: openai.AsyncOpenAI, model: str, tag: str, lines: int, tally: BatchTally) -> None:
    began = time.monotonic()
    upload = await client.files.create(file=(f"{tag}.jsonl", _jsonl(model, tag, lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"soak": tag})
    while batch.status not in _DONE and time.monotonic() - began < BATCH_TIMEOUT_SECONDS:
        await asyncio.sleep(2.0)
        try:
            batch = await client.batches.retrieve(batch.id)
        except openai.APIError:
            continue   # the batch service down past the SDK's retries: ask again
    rows = []
    if batch.output_file_id:
        content = await client.files.content(batch.output_file_id)
        rows = [json.loads(line) for line in content.text.splitlines() if line.strip()]
    ok, wrong = check_output(rows, tag, lines)
    if batch.status != "completed" and not wrong:
        wrong[f"batch ended {batch.status} with every line answered"] += 1
    tally.lines_ok += ok
    tally.lost.update(wrong)
    counts = batch.request_counts
    tally.batches.append(f"{batch.id}: {batch.status}, {ok}/{lines} lines once with a 200 "
                         f"(counts: {counts.completed if counts else '?'} completed, "
                         f"{counts.failed if counts else '?'} failed), {time.monotonic() - began:.0f}s")


async def run_batches(target: Target, lines: int, last_start: float, tally: BatchTally) -> None:
    """Batches one after another, a minute apart, the last started before
    `last_start` (and waited for)."""
    client = openai.AsyncOpenAI(base_url=f"{target.base_url}/v1", api_key=target.api_key, max_retries=10,
                                timeout=60.0)
    n = 0
    try:
        while time.monotonic() < last_start:
            tally.lines += lines
            try:
                await _one(client, target.model, f"soak{n}", lines, tally)
            except openai.APIError as exc:   # past the SDK's retries
                tally.lost[f"batch API call failed: {type(exc).__name__}: {str(exc)[:80]}"] += lines
            n += 1
            await asyncio.sleep(min(60.0, max(0.0, last_start - time.monotonic())))
    finally:
        await client.close()
