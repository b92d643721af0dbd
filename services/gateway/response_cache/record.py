"""Record a generation's events on its way to the client, replay them later.

An entry is the request's `TextDelta`s (text, token ids, logprobs, choice,
resume index: the engine's own chunking, before the stream's coalescing)
and `Finished` events, as JSON (logprobs as base64 protobuf). Only a
COMPLETE generation is stored: every choice finished with stop or length
-- never an error, timeout, abort or a partial stream (the recorder sees
the final `Finished` or nothing is stored).

Replay emits the same events into a normal `EventStream`, so every transport
renders a hit exactly like a fresh answer (new request id and `created`),
with its usage saying it was cached: `cached_tokens = prompt_tokens`.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services.common.proto.kvmesh.v1 import common_pb2
from services.gateway.events import Emit, Finished, FinishReason, QueuedUpdate, TextDelta, Usage

__all__ = ["ENTRY_VERSION", "Recorder", "Run", "decode_entry", "encode_entry", "replay"]

ENTRY_VERSION = 1
Run = Callable[[Emit], Awaitable[None]]
Recorded = TextDelta | Finished
_STORABLE = (FinishReason.STOP, FinishReason.LENGTH)


def _logprobs_out(logprobs: Sequence[common_pb2.TokenLogprob]) -> list[str]:
    return [base64.b64encode(lp.SerializeToString()).decode() for lp in logprobs]


def _logprobs_in(encoded: Sequence[str]) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob.FromString(base64.b64decode(item)) for item in encoded]


def _event_out(event: Recorded) -> dict[str, Any]:
    if isinstance(event, TextDelta):
        out: dict[str, Any] = {"t": "d", "x": event.text, "ids": event.token_ids, "i": event.index,
                               "c": event.choice}
        if event.logprobs:
            out["lp"] = _logprobs_out(event.logprobs)
        return out
    usage = event.usage
    return {"t": "f", "r": event.reason.value, "u": [usage.prompt_tokens, usage.completion_tokens],
            "c": event.choice, "last": event.final}


def _event_in(item: dict[str, Any]) -> Recorded:
    if item["t"] == "d":
        return TextDelta(str(item["x"]), [int(t) for t in item["ids"]], _logprobs_in(item.get("lp", ())),
                         int(item["i"]), int(item["c"]))
    prompt, completion = (int(v) for v in item["u"])
    # Replayed: every prompt token "cached" (OpenAI's prompt_tokens_details).
    return Finished(FinishReason(item["r"]), Usage(prompt, completion, prompt), choice=int(item["c"]),
                    final=bool(item["last"]))


def encode_entry(events: Sequence[Recorded]) -> bytes:
    return json.dumps({"v": ENTRY_VERSION, "events": [_event_out(e) for e in events]},
                      separators=(",", ":"), ensure_ascii=False).encode()


def decode_entry(raw: bytes) -> list[Recorded]:
    """The entry's events; ValueError for anything not an entry of this
    version (a corrupt or foreign value is a miss, not a crash)."""
    try:
        document = json.loads(raw)
        if document.get("v") != ENTRY_VERSION:
            raise ValueError(f"entry version {document.get('v')!r}")
        events = [_event_in(item) for item in document["events"]]
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"not a response cache entry: {exc}") from exc
    if not events or not isinstance(events[-1], Finished) or not events[-1].final:
        raise ValueError("not a response cache entry: no final event")
    return events


def replay(events: Sequence[Recorded]) -> Run:
    """A driver `run` that emits the entry's events and touches nothing else."""
    async def run(emit: Emit) -> None:
        for event in events:
            await emit(event)
            # Let the transport write each chunk on its own: a hit streams
            # like an answer, not one coalesced block.
            await asyncio.sleep(0)
    return run


class Recorder:
    """Wraps one generation's `run`: keeps its deltas and finishes, and when
    the final `Finished` of a complete generation passes, hands the encoded
    entry to `store` (before emitting it: the transport ends the stream at
    that event, which may cancel whatever the driver does after it)."""

    def __init__(self, store: Callable[[bytes], None], max_bytes: int) -> None:
        self._store = store
        self._max_bytes = max_bytes
        self._events: list[Recorded] = []
        self._size = 0

    def wrap(self, run: Run) -> Run:
        async def recorded(emit: Emit) -> None:
            async def tee(event: QueuedUpdate | TextDelta | Finished) -> None:
                self._see(event)
                await emit(event)
            await run(tee)
        return recorded

    def _see(self, event: QueuedUpdate | TextDelta | Finished) -> None:
        if isinstance(event, QueuedUpdate) or self._size > self._max_bytes:
            return
        self._events.append(event)
        if isinstance(event, TextDelta):
            # A cheap running bound; the exact size is checked when encoded.
            self._size += len(event.text) * 4 + len(event.token_ids) * 8 + len(event.logprobs) * 64
        elif event.final and all(e.reason in _STORABLE for e in self._events if isinstance(e, Finished)):
            raw = encode_entry(self._events)
            if len(raw) <= self._max_bytes:
                self._store(raw)
