"""KvTranslator: vLLM KV events -> shared prefix hashes (no vLLM needed)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common.prefix_hash import block_hashes
from services.engine.vllm_backend.kv_translate import KvTranslator

pytestmark = pytest.mark.unit  # in-process, no vLLM: the fast tier (tests/conftest.py)

BLOCK = 64
HASH = 16


@dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list[int]
    block_size: int
    group_idx: int | None = None


@dataclass
class BlockRemoved:
    block_hashes: list
    group_idx: int | None = None


class AllBlocksCleared:
    pass


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_chained_stores_match_block_hashes() -> None:
    t = KvTranslator(BLOCK, HASH)
    seq = tokens(3 * BLOCK)
    d1 = t.apply([BlockStored([b"a", b"b"], None, seq[: 2 * BLOCK], BLOCK)])
    d2 = t.apply([BlockStored([b"c"], b"b", seq[2 * BLOCK :], BLOCK)])
    expected = block_hashes(seq, HASH)
    assert d1.ops == [("stored", expected[:8])]
    assert d2.ops == [("stored", expected[8:])]
    assert sorted(t.snapshot()) == sorted(expected)
    assert t.num_blocks == 3


def test_remove_and_clear() -> None:
    t = KvTranslator(BLOCK, HASH)
    seq = tokens(2 * BLOCK)
    expected = block_hashes(seq, HASH)
    t.apply([BlockStored([1, 2], None, seq, BLOCK)])
    delta = t.apply([BlockRemoved([2])])
    assert delta.ops == [("removed", expected[4:])]
    assert sorted(t.snapshot()) == sorted(expected[:4])
    assert t.apply([AllBlocksCleared()]).ops == [("cleared", [])]
    assert t.snapshot() == [] and t.num_blocks == 0
    assert t.apply([BlockRemoved([1])]).empty()  # unknown after a clear: ignored


def test_removed_then_restored_in_one_batch_stays_held() -> None:
    t = KvTranslator(BLOCK, HASH)
    seq = tokens(BLOCK)
    t.apply([BlockStored([1], None, seq, BLOCK)])
    delta = t.apply([BlockRemoved([1]), BlockStored([1], None, seq, BLOCK)])
    assert [op for op, _ in delta.ops] == ["removed", "stored"]
    assert sorted(t.snapshot()) == sorted(block_hashes(seq, HASH))


def test_orphan_with_unknown_parent_is_skipped() -> None:
    t = KvTranslator(BLOCK, HASH)
    delta = t.apply([BlockStored([b"x"], b"never-seen", tokens(BLOCK), BLOCK)])
    assert delta.empty() and t.skipped_orphans == 1


def test_reuse_report_is_idempotent() -> None:
    t = KvTranslator(BLOCK, HASH)
    event = BlockStored([1], None, tokens(BLOCK), BLOCK)
    t.apply([event])
    assert t.apply([event]).empty()
    # One removal still removes it: vLLM held one block under that hash.
    assert t.apply([BlockRemoved([1])]).ops[0][0] == "removed"


def test_other_kv_groups_are_ignored() -> None:
    t = KvTranslator(BLOCK, HASH)
    assert t.apply([BlockStored([1], None, tokens(BLOCK), BLOCK, group_idx=1)]).empty()


def test_block_size_must_be_multiple_of_hash_tokens() -> None:
    with pytest.raises(ValueError, match="multiple"):
        KvTranslator(24, HASH)
