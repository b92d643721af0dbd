"""KvEventSubscriber: sequence numbers, gap replay and the clear fallback,
against a fake publisher speaking vLLM's wire format (no vLLM needed)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from services.common.prefix_hash import block_hashes
from services.engine.vllm_backend.kv_events import KvEventSubscriber
from services.engine.vllm_backend.kv_translate import KvDelta, KvTranslator

pytestmark = pytest.mark.unit  # in-process, no vLLM: the fast tier (tests/conftest.py)

BLOCK = 32


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored]


def payload(i: int) -> bytes:
    """Batch i stores block i+1, chained on block i."""
    event = BlockStored([i + 1], i or None, list(range(i * BLOCK, (i + 1) * BLOCK)), BLOCK)
    return msgspec.msgpack.encode(Batch(0.0, [event]))


async def run(tmp_path: Path, send: list[int], replay_has: list[int]) -> tuple[list, KvTranslator]:
    deltas: list[KvDelta] = []
    sub = KvEventSubscriber(deltas.append, Batch)
    translator = KvTranslator(BLOCK, 16)
    replay_ep = f"ipc://{tmp_path}/replay.ipc"
    ctx = zmq.asyncio.Context()
    # XPUB, unlike vLLM's PUB, shows when the subscription has arrived, so
    # the test never races ZMQ's slow joiner (which replay covers in vLLM).
    pub = ctx.socket(zmq.XPUB)
    pub.connect(sub.endpoint)
    router = ctx.socket(zmq.ROUTER)
    router.bind(replay_ep)

    async def serve_replay() -> None:
        while True:
            client, _, start = await router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq in replay_has:
                if seq >= first:
                    await router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), payload(seq)])
            await router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    server = asyncio.create_task(serve_replay())
    sub.start(translator, replay_ep)
    try:
        assert (await asyncio.wait_for(pub.recv(), 10))[:1] == b"\x01"
        for seq in send:
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload(seq)])
        await sub.wait_for_seq(send[-1], timeout=10)
    finally:
        server.cancel()
        await sub.stop()
        pub.close(0)
        router.close(0)
        ctx.term()
    return deltas, translator


def chain(n: int) -> list[int]:
    return block_hashes(list(range(n * BLOCK)), 16)


async def test_in_order_batches(tmp_path: Path) -> None:
    deltas, translator = await run(tmp_path, [0, 1, 2], replay_has=[])
    assert sorted(translator.snapshot()) == sorted(chain(3))
    assert all(op == "stored" for d in deltas for op, _ in d.ops)


async def test_gap_is_filled_by_replay(tmp_path: Path) -> None:
    deltas, translator = await run(tmp_path, [0, 2, 3], replay_has=[0, 1, 2, 3])
    assert sorted(translator.snapshot()) == sorted(chain(4))
    assert not any(op == "cleared" for d in deltas for op, _ in d.ops)


async def test_unfillable_gap_clears_and_skips_orphans(tmp_path: Path) -> None:
    deltas, translator = await run(tmp_path, [0, 2, 3], replay_has=[2, 3])
    ops = [op for d in deltas for op, _ in d.ops]
    assert "cleared" in ops
    # Blocks 3 and 4 chain on block 2, which was never seen: not reported.
    assert translator.snapshot() == []
    assert translator.skipped_orphans == 2
