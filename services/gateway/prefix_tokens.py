"""Token ids (and block hashes) of long chat prompts' shared beginnings, kept
so a request tokenizes only what follows its system message.

Measured (BENCHMARKS.md, "Path cost per request"): a 2,000-token system
context costs the gateway 2.5 ms of tokenizing per request on an idle core,
in a worker thread (two more wake-ups), although every request of a tenant
renders the same beginning. The cache splits the rendered prompt right after
the first special token that follows the first message's content (ChatML's
`<|im_end|>`, Llama's `</s>`, ...) -- the prefix -- and keeps the prefix's ids.

Why the split is exact: a Hugging Face tokenizer cuts the text at special
added tokens (not normalized) before normalizing and pre-tokenizing, and
encodes each piece on its own; so ids(prefix + rest) = ids(prefix) + the ids
of `rest` as it follows that special token, which is ids(token + rest)
without its first id (the token put in front keeps `rest` off offset 0,
where some pre-tokenizers add a prefix space). Not taken on trust: the
first time a prefix is seen, the split encoding is compared with the whole
prompt's, and one mismatch turns the cache off for the tokenizer for good
(a warning says so) -- every prompt is then tokenized whole, as before.

Ownership: the event loop's thread alone reads and writes the entries
(`lookup`, `store`); worker threads only call `split_encode`, which reads
nothing mutable.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from services.common.prefix_hash import ROOT_HASH, block_hashes

__all__ = ["CachedPrefix", "PrefixTokenCache", "SplitPrompt", "joined_hashes"]

log = logging.getLogger(__name__)

# Prefixes kept per model: tenants' distinct system prompts, least recently
# used dropped first. 2,000-token prefixes take ~80 KB each (text + ids).
DEFAULT_ENTRIES = 256
# A first message shorter than this is tokenized with the rest (2,048 chars
# is also where tokenizing leaves the event loop: tokenization.INLINE_CHARS).
MIN_PREFIX_CHARS = 2048


@dataclass(frozen=True)
class CachedPrefix:
    """A prefix's ids and the hashes of its full blocks (one block size)."""

    token_ids: list[int]
    block_tokens: int
    hashes: list[int]


@dataclass(frozen=True)
class SplitPrompt:
    """A rendered prompt cut after its boundary token."""

    text: str
    prefix: str            # text[:cut], ends with `boundary`
    boundary: str          # the special token it ends with
    boundary_id: int

    @property
    def rest(self) -> str:
        return self.text[len(self.prefix):]


class PrefixTokenCache:
    """One tokenizer's cached prefixes (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, entries: int = DEFAULT_ENTRIES,
                 min_chars: int = MIN_PREFIX_CHARS) -> None:
        self._tok = tokenizer
        self._entries: OrderedDict[str, CachedPrefix] = OrderedDict()
        self._capacity = entries
        self._min_chars = min_chars
        self._boundaries = _boundary_tokens(tokenizer)
        self.enabled = bool(self._boundaries) and entries > 0
        self.hits = 0
        self.misses = 0

    def split(self, text: str, messages: Sequence[dict[str, Any]]) -> SplitPrompt | None:
        """Where `text` (the rendered chat) would be cut, or None when it is
        not worth it or not possible (short first message, no boundary)."""
        if not self.enabled or not messages:
            return None
        first = messages[0].get("content")
        if not isinstance(first, str) or len(first) < self._min_chars:
            return None
        at = text.find(first)
        if at < 0:
            return None
        after = at + len(first)
        best: tuple[int, str, int] | None = None
        for token, token_id in self._boundaries:
            pos = text.find(token, after)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, token, token_id)
        if best is None:
            return None
        pos, token, token_id = best
        return SplitPrompt(text, text[:pos + len(token)], token, token_id)

    def lookup(self, split: SplitPrompt, block_tokens: int) -> CachedPrefix | None:
        entry = self._entries.get(split.prefix)
        if entry is None or entry.block_tokens != block_tokens:
            self.misses += 1
            return None
        self._entries.move_to_end(split.prefix)
        self.hits += 1
        return entry

    def encode_rest(self, split: SplitPrompt) -> list[int] | None:
        """The ids of what follows the prefix, or None if the boundary did
        not come out as its own token (then tokenize whole)."""
        ids: list[int] = self._tok.encode(split.boundary + split.rest, add_special_tokens=False).ids
        if not ids or ids[0] != split.boundary_id:
            return None
        return ids[1:]

    def split_encode(self, split: SplitPrompt, whole: list[int], block_tokens: int) -> CachedPrefix | None:
        """A new prefix's entry, checked against the whole prompt's ids
        (any thread); None if the split encoding differs from `whole`."""
        prefix_ids: list[int] = self._tok.encode(split.prefix, add_special_tokens=False).ids
        rest = self.encode_rest(split)
        if rest is None or prefix_ids + rest != whole:
            return None
        full_blocks = len(prefix_ids) - len(prefix_ids) % block_tokens
        return CachedPrefix(prefix_ids, block_tokens, block_hashes(prefix_ids[:full_blocks], block_tokens))

    def store(self, split: SplitPrompt, entry: CachedPrefix | None) -> None:
        """Keep `entry` (from `split_encode`); None = the check failed:
        the cache is off for this tokenizer from now on."""
        if entry is None:
            if self.enabled:
                log.warning("prompt prefix cache off: splitting after %r changed the token ids; "
                            "every prompt is tokenized whole", split.boundary)
            self.enabled = False
            self._entries.clear()
            return
        self._entries[split.prefix] = entry
        self._entries.move_to_end(split.prefix)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)


def joined_hashes(entry: CachedPrefix, token_ids: list[int]) -> list[int]:
    """Block hashes of `token_ids` (the prefix's ids + the rest's), the
    prefix's full blocks taken from `entry`."""
    done = len(entry.hashes) * entry.block_tokens
    parent = entry.hashes[-1] if entry.hashes else ROOT_HASH
    return entry.hashes + block_hashes(token_ids[done:], entry.block_tokens, parent)


def _boundary_tokens(tokenizer: Tokenizer) -> list[tuple[str, int]]:
    """Special added tokens matched before normalization, and inside no
    other added token (a longer match could straddle the cut)."""
    added = tokenizer.get_added_tokens_decoder()
    contents = [a.content for a in added.values()]
    out = []
    for token_id, a in added.items():
        if not a.special or a.normalized or not a.content:
            continue
        if any(a.content in other and a.content != other for other in contents):
            continue
        out.append((a.content, token_id))
    return out
