"""Which model an engine serves, where its files are, and its text codec.

`resolve_model` names the model and its directory. `load_codec` gives the
engine's text <-> token ids: the directory's own tokenizer and chat template
(`HfCodec`, built on services/common/tokenizer.py, the same code the gateway
tokenizes with) when it has a tokenizer.json, else a synthetic word
vocabulary (`SyntheticCodec`) for a model-less sim. The sim generates from a
codec's clean tokens; the engine's OpenAI HTTP endpoint tokenizes with it.
"""

from __future__ import annotations

import logging
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.common.config import EngineConfig, MeshConfig
from services.common.tokenizer import HfTokenizer, RenderedPrompt, context_length, read_model_json

__all__ = ["HfCodec", "ModelSpec", "REPO_ROOT", "SyntheticCodec", "TextCodec", "load_codec", "resolve_model"]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
# A sim engine serving no configured model still needs a name and a context.
DEFAULT_SIM_MODEL = "sim"
DEFAULT_MAX_MODEL_LEN = 8192

# A generated token's text must be clean on its own: a space and 2-12 ASCII
# lowercase letters, so that decoding tokens one by one and decoding the
# whole sequence agree (byte-level BPE pieces like "Ġthe" do).
_CLEAN_WORD = re.compile(r"^ [a-z]{2,12}$")

_LOREM = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua enim ad minim veniam quis nostrud "
    "exercitation ullamco laboris nisi aliquip ex ea commodo consequat duis aute irure "
    "in reprehenderit voluptate velit esse cillum fugiat nulla pariatur excepteur sint "
    "occaecat cupidatat non proident sunt culpa qui officia deserunt mollit anim id est "
    "laborum"
).split()


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: Path | None          # the HF directory, None when not configured
    max_model_len: int          # 0 = unknown (the backend decides)


def resolve_model(config: MeshConfig, engine: EngineConfig) -> ModelSpec:
    """engine.model names an entry of config.models (ConfigError if unknown);
    empty = the first model, or a model-less sim named "sim"."""
    if not engine.model and not config.models:
        return ModelSpec(DEFAULT_SIM_MODEL, None, 0)
    model = config.model(engine.model) if engine.model else config.models[0]
    path = Path(model.path) if model.path else None
    if path is not None and not path.is_absolute():
        path = REPO_ROOT / path
    max_len = model.max_model_len or (context_length(path) if path is not None else 0)
    return ModelSpec(model.name, path, max_len)


class TextCodec(Protocol):
    vocab_size: int
    eos_token_id: int
    # Token ids whose text is clean; the sim draws its output from these.
    clean_token_ids: list[int]
    # Local directory a router may load the tokenizer from ("" = none).
    path: str

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> RenderedPrompt: ...

    def text_prompt(self, text: str) -> RenderedPrompt: ...


class SyntheticCodec:
    """No tokenizer on disk: id 0 is EOS (text ""), every other id is a lorem
    word chosen by the id alone. Encoding maps a known word to its smallest
    id and any other word to a stable hash, so encode is deterministic."""

    path = ""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = 0
        first = 256 if vocab_size > 256 + len(_LOREM) else 1
        last = min(vocab_size, first + 16 * len(_LOREM))
        self.clean_token_ids = list(range(first, last))
        self._word_id: dict[str, int] = {}
        for token_id in self.clean_token_ids:
            self._word_id.setdefault(_LOREM[token_id % len(_LOREM)], token_id)

    def token_text(self, token_id: int) -> str:
        if token_id == self.eos_token_id:
            return ""
        return " " + _LOREM[token_id % len(_LOREM)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(self.token_text(t) for t in token_ids)

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            token_id = self._word_id.get(word)
            if token_id is None:
                token_id = 1 + zlib.crc32(word.encode()) % (self.vocab_size - 1)
            ids.append(token_id)
        return ids

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> RenderedPrompt:
        # No template to follow: one "role: content" line per message.
        lines = [f"{m.get('role', 'user')}: {m.get('content') or ''}" for m in messages]
        return self.text_prompt("\n".join([*lines, "assistant:"]))

    def text_prompt(self, text: str) -> RenderedPrompt:
        return RenderedPrompt(text, self.encode(text))


class HfCodec(HfTokenizer):
    """A Hugging Face model directory's tokenizer, plus what the sim needs:
    each token's own text and the tokens whose text is clean."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.path = str(directory)
        # The model's embedding may be larger than the tokenizer's vocabulary.
        model_vocab = read_model_json(directory / "config.json").get("vocab_size")
        self.vocab_size = max(model_vocab if isinstance(model_vocab, int) else 0, self.vocab_size)
        self._texts: dict[int, str] = {}
        special = self.special_token_ids()
        self.clean_token_ids = [
            i for i in range(self.base_vocab_size())
            if i not in special and _CLEAN_WORD.match(self.token_text(i) or "")
        ]
        if not self.clean_token_ids:
            raise ValueError(f"{directory}: tokenizer has no plain word tokens to generate from")

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = super().decode([token_id], skip_special_tokens=True)
            self._texts[token_id] = text
        return text

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return super().decode(token_ids, skip_special_tokens=skip_special_tokens)


def load_codec(model_dir: str | Path | None, vocab_size: int) -> TextCodec:
    """The directory's tokenizer when it has a tokenizer.json, else synthetic."""
    if model_dir:
        directory = Path(model_dir)
        if (directory / "tokenizer.json").is_file():
            return HfCodec(directory)
        log.warning("%s has no tokenizer.json; using synthetic lorem text", directory)
    return SyntheticCodec(vocab_size)
