"""The gateway's prompt prefix token cache (services/gateway/prefix_tokens.py):
a long system prompt's ids are reused, and the result is always the ids of
the whole prompt tokenized at once."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from conftest import REAL_TOKENIZER
from tokenizers import Tokenizer, models, pre_tokenizers

from services.common.prefix_hash import block_hashes
from services.gateway.prefix_tokens import PrefixTokenCache
from services.gateway.tokenization import ModelTokenizer


def _word_tokenizer() -> Tokenizer:
    words = ["[UNK]", "system", "user", "hello", "world", "what", "is", "it"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


def _render(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']} {m['content']}<|im_end|>" for m in messages) + "<|im_start|>assistant"


def _chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_split_after_the_first_messages_boundary_and_reuse() -> None:
    tok = _word_tokenizer()
    cache = PrefixTokenCache(tok, min_chars=20)
    system = " ".join(["hello world"] * 10)
    messages = _chat(system, "what is it")
    text = _render(messages)
    split = cache.split(text, messages)
    assert split is not None and split.prefix.endswith(system + "<|im_end|>")
    whole = tok.encode(text, add_special_tokens=False).ids
    assert cache.lookup(split, 4) is None
    entry = cache.split_encode(split, whole, 4)
    assert entry is not None
    cache.store(split, entry)
    again = cache.split(_render(_chat(system, "hello")), _chat(system, "hello"))
    assert again is not None
    found = cache.lookup(again, 4)
    rest = cache.encode_rest(again)
    assert found is not None and rest is not None
    assert found.token_ids + rest == tok.encode(again.text, add_special_tokens=False).ids
    assert found.hashes == block_hashes(found.token_ids, 4)
    assert cache.lookup(again, 8) is None  # hashes are per block size


def test_short_first_message_or_no_boundary_is_not_split() -> None:
    cache = PrefixTokenCache(_word_tokenizer(), min_chars=20)
    assert cache.split(_render(_chat("hello", "what")), _chat("hello", "what")) is None
    long = " ".join(["hello"] * 10)
    assert cache.split(f"{long} and nothing after", _chat(long, "what")) is None


def test_a_mismatch_turns_the_cache_off() -> None:
    tok = _word_tokenizer()
    cache = PrefixTokenCache(tok, min_chars=20)
    system = " ".join(["hello world"] * 10)
    split = cache.split(_render(_chat(system, "what")), _chat(system, "what"))
    assert split is not None
    whole = tok.encode(split.text, add_special_tokens=False).ids
    assert cache.split_encode(split, [*whole, 0], 4) is None  # as if the split encoding differed
    cache.store(split, None)
    assert not cache.enabled and cache.split(split.text, _chat(system, "what")) is None


def test_least_recently_used_prefix_goes_first() -> None:
    tok = _word_tokenizer()
    cache = PrefixTokenCache(tok, entries=2, min_chars=20)
    splits = []
    for n in (10, 11, 12):
        system = " ".join(["hello world"] * n)
        split = cache.split(_render(_chat(system, "it")), _chat(system, "it"))
        assert split is not None
        cache.store(split, cache.split_encode(split, tok.encode(split.text, add_special_tokens=False).ids, 4))
        splits.append(split)
        if n == 11:
            assert cache.lookup(splits[0], 4) is not None  # used: the 11 one is now the oldest
    assert cache.lookup(splits[0], 4) is not None and cache.lookup(splits[2], 4) is not None
    assert cache.lookup(splits[1], 4) is None


@pytest.mark.skipif(not (REAL_TOKENIZER / "tokenizer.json").is_file(), reason="needs .models/tiny-llama")
async def test_the_real_tokenizer_gives_the_whole_prompts_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    tok = ModelTokenizer("tiny-llama", Path(REAL_TOKENIZER))
    rng = random.Random(3)
    pieces = "river stone  cloud\tlantern émoji 日本 \n\n orbit <b> x".split(" ")
    system = " ".join(rng.choice(pieces) + str(rng.randint(0, 99)) for _ in range(600))
    questions = ["what?", " leading space", "\nnewline", "", "<|im_end|> inside", "long " * 600]
    first = await tok.tokenize_chat(_chat(system, questions[0]), 16)
    assert first == tok._chat_sync(_chat(system, questions[0]), 16)
    assert tok.prefixes.enabled and tok.prefixes.misses == 1

    async def no_thread(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a cached prefix with a short rest is tokenized on the loop")

    for question in questions:
        messages = _chat(system, question)
        if len(question) < 2048:
            monkeypatch.setattr(asyncio, "to_thread", no_thread)
        got = await tok.tokenize_chat(messages, 16)
        monkeypatch.undo()
        assert got == tok._chat_sync(messages, 16), question
    assert tok.prefixes.hits == len(questions)
