from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.prefix_hash import ROOT_HASH, block_hashes, chain_hash

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)


@given(tokens, st.integers(min_value=1, max_value=32))
def test_one_hash_per_full_block(ids: list[int], block: int) -> None:
    assert len(block_hashes(ids, block)) == len(ids) // block


@given(tokens, tokens)
def test_shared_prefix_gives_shared_hashes(a: list[int], b: list[int]) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    ha, hb = block_hashes(a, 4), block_hashes(b, 4)
    shared = 0
    while shared < min(len(ha), len(hb)) and ha[shared] == hb[shared]:
        shared += 1
    assert shared == min(common // 4, len(ha), len(hb))


def test_hash_chains_on_the_parent() -> None:
    # Same block content after different prefixes must hash differently.
    x = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    y = block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert x[1] != y[1]
    assert x[0] == chain_hash(ROOT_HASH, [1, 2, 3, 4])
    assert x[1] == chain_hash(x[0], [9, 9, 9, 9])


def test_coarser_blocks_are_covered_by_finer_ones() -> None:
    # An engine with 128-token blocks reports the 16-token hashes it covers;
    # that only works because hashing is over tokens, not over engine blocks.
    ids = list(range(300))
    fine = block_hashes(ids, 16)
    assert len(fine) == 18
    assert block_hashes(ids[:128], 16) == fine[:8]


def test_rejects_non_positive_block() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
