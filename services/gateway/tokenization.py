"""Each served model's tokenizer, as the gateway uses it: the prompt's token
ids (rendering and tokenizing are services/common/tokenizer.py's, shared with
the engines' own OpenAI endpoints, so both give the same ids), its prefix
block hashes, the context length, and template errors as `GatewayError`s.

Tokenizing (+ prefix hashing) is CPU work. Measured here with SmolLM2's
tokenizer: 100 chars 0.05 ms, 2k chars 0.8 ms, 8k chars 5 ms, 100k chars
106 ms. So prompts longer than `INLINE_CHARS` are tokenized and hashed in a
worker thread (the Rust tokenizer releases the GIL); shorter ones inline,
where the ~0.1 ms thread hop would cost more than it saves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.config import ConfigError, ModelConfig
from services.common.prefix_hash import block_hashes
from services.common.tokenizer import HfTokenizer, context_length
from services.gateway.errors import ErrorKind, GatewayError
from services.gateway.prefix_tokens import CachedPrefix, PrefixTokenCache, SplitPrompt, joined_hashes

__all__ = ["INLINE_CHARS", "ModelTokenizer", "TokenizedPrompt", "TokenizerRegistry"]

log = logging.getLogger(__name__)

# Above this many characters, tokenize off the event loop (~0.8 ms of work
# at 2k chars, measured; see the module docstring).
INLINE_CHARS = 2048

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TokenizedPrompt:
    token_ids: list[int]
    prefix_hashes: list[int]
    text: str | None  # the rendered prompt (chat template applied), if any


class ModelTokenizer:
    """One model's tokenizer, chat template (services/common/tokenizer.py, the
    same the engines' own endpoints use) and context length. Immutable."""

    def __init__(self, name: str, model_dir: Path, max_model_len: int = 0, tool_parser: str = "hermes") -> None:
        self.name = name
        self.model_dir = model_dir
        self.tool_parser = tool_parser  # models[].tool_parser: how its tool calls are written and read
        try:
            self._hf = HfTokenizer(model_dir, name)
        except ConfigError as exc:
            raise ConfigError(f"models[{name}].path: {exc}") from exc
        self.max_model_len = max_model_len or context_length(model_dir)
        if self.max_model_len <= 0:
            raise ConfigError(
                f"models[{name}].max_model_len: not set and {model_dir}/config.json has no max_position_embeddings"
            )
        self.vocab_size = self._hf.vocab_size
        # Long system prompts' ids, reused (prefix_tokens.py; the loop's thread only).
        self.prefixes = PrefixTokenCache(self._hf.raw)

    @property
    def has_chat_template(self) -> bool:
        return self._hf.has_chat_template

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._hf.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode(ids)

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self._hf.render_chat(messages, add_generation_prompt=add_generation_prompt)  # ChatTemplateError: a 400

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return self._hf.token_strs(ids)

    # ---- whole-prompt preparation (maybe off the event loop)

    def _chat_sync(self, messages: Sequence[dict[str, Any]], hash_block_tokens: int,
                   tools: Sequence[dict[str, Any]] | None = None, tool_format: str = "hermes") -> TokenizedPrompt:
        prompt = self._hf.chat_prompt(messages, tools, tool_format)
        return TokenizedPrompt(prompt.token_ids, block_hashes(prompt.token_ids, hash_block_tokens), prompt.text)

    def _text_sync(self, text: str, hash_block_tokens: int) -> TokenizedPrompt:
        prompt = self._hf.text_prompt(text)
        return TokenizedPrompt(prompt.token_ids, block_hashes(prompt.token_ids, hash_block_tokens), text)

    async def tokenize_chat(self, messages: Sequence[dict[str, Any]], hash_block_tokens: int,
                            tools: Sequence[dict[str, Any]] | None = None,
                            tool_format: str = "hermes") -> TokenizedPrompt:
        """The chat's prompt; `tools` (and the history's tool calls) rendered
        by the template or the generic tool prompt in `tool_format`
        (services/common/tokenizer.py)."""
        size = sum(len(m.get("content") or "") for m in messages) + (len(str(tools)) if tools else 0)
        if size < INLINE_CHARS:
            return self._chat_sync(messages, hash_block_tokens, tools, tool_format)
        # Rendering is ~16 us even at 8k chars (measured); tokenizing is the cost.
        text = self._hf.render_chat(messages, tools, tool_format)
        split = self.prefixes.split(text, messages)
        if split is not None:
            found = await self._from_prefix(split, hash_block_tokens)
            if found is not None:
                return found
        prompt, entry = await asyncio.to_thread(self._whole_sync, text, split, hash_block_tokens)
        if split is not None:
            self.prefixes.store(split, entry)
        return prompt

    async def _from_prefix(self, split: SplitPrompt, hash_block_tokens: int) -> TokenizedPrompt | None:
        """The prompt from its cached prefix + the rest tokenized (inline
        when short: a question after a system prompt takes ~0.05 ms)."""
        entry = self.prefixes.lookup(split, hash_block_tokens)
        if entry is None:
            return None
        if len(split.rest) < INLINE_CHARS:
            rest = self.prefixes.encode_rest(split)
        else:
            rest = await asyncio.to_thread(self.prefixes.encode_rest, split)
        if rest is None:
            return None
        ids = entry.token_ids + rest
        return TokenizedPrompt(ids, joined_hashes(entry, ids), split.text)

    def _whole_sync(self, text: str, split: SplitPrompt | None,
                    hash_block_tokens: int) -> tuple[TokenizedPrompt, CachedPrefix | None]:
        """The whole prompt tokenized (a worker thread), and the entry for
        its prefix when the split encoding gives the same ids."""
        ids = self._hf.encode(text, add_special_tokens=False)
        entry = None if split is None else self.prefixes.split_encode(split, ids, hash_block_tokens)
        return TokenizedPrompt(ids, block_hashes(ids, hash_block_tokens), text), entry

    async def tokenize_text(self, prompt: str, hash_block_tokens: int) -> TokenizedPrompt:
        if len(prompt) < INLINE_CHARS:
            return self._text_sync(prompt, hash_block_tokens)
        return await asyncio.to_thread(self._text_sync, prompt, hash_block_tokens)

    async def from_ids(self, ids: list[int], hash_block_tokens: int) -> TokenizedPrompt:
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise GatewayError(
                ErrorKind.INVALID_REQUEST,
                f"token id {bad} is outside the model's vocabulary (size {self.vocab_size})",
                param="prompt",
            )
        if len(ids) < INLINE_CHARS:
            return TokenizedPrompt(ids, block_hashes(ids, hash_block_tokens), None)
        hashes = await asyncio.to_thread(block_hashes, ids, hash_block_tokens)
        return TokenizedPrompt(ids, hashes, None)


class TokenizerRegistry:
    """Every configured model's tokenizer. A model whose files cannot be
    loaded is kept as a load error: requests for it get 503 saying why,
    the rest of the gateway keeps serving."""

    def __init__(self, models: Sequence[ModelConfig], root: Path = REPO_ROOT) -> None:
        self._models: dict[str, ModelTokenizer] = {}
        self._errors: dict[str, str] = {}
        for model in models:
            path = Path(model.path)
            if not path.is_absolute():
                path = root / path
            try:
                self._models[model.name] = ModelTokenizer(model.name, path, model.max_model_len, model.tool_parser)
            except (ConfigError, OSError, Exception) as exc:  # noqa: BLE001 - a bad model must not stop the gateway
                log.error("model %s: cannot load tokenizer from %s: %s", model.name, path, exc)
                self._errors[model.name] = str(exc)

    @property
    def names(self) -> list[str]:
        return sorted(self._models)

    @property
    def model_dirs(self) -> dict[str, Path]:
        """model -> the directory its tokenizer was loaded from."""
        return {name: model.model_dir for name, model in self._models.items()}

    def get(self, name: str) -> ModelTokenizer:
        found = self._models.get(name)
        if found is not None:
            return found
        if name in self._errors:
            raise GatewayError(
                ErrorKind.UNAVAILABLE,
                f"model {name!r} is configured but its tokenizer failed to load: {self._errors[name]}",
                param="model",
                code="model_unavailable",
            )
        known = ", ".join(self.names) or "none"
        raise GatewayError(
            ErrorKind.NOT_FOUND,
            f"the model {name!r} does not exist; available models: {known}",
            param="model",
            code="model_not_found",
        )
