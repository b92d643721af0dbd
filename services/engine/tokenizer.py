"""Text <-> token ids for an engine: the model directory's own tokenizer when
it has one, else a synthetic word vocabulary.

Used by the sim (a token's text, which ids give clean text, EOS) and by the
OpenAI HTTP endpoint (tokenize prompts, render chat templates). Loads
`tokenizer.json` with `tokenizers` (not transformers: that import alone costs
seconds) and the chat template from `tokenizer_config.json` with jinja2, the
way transformers renders it. Never touches the network.
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["HfCodec", "SyntheticCodec", "TextCodec", "load_codec"]

log = logging.getLogger(__name__)

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


class TextCodec(Protocol):
    vocab_size: int
    eos_token_id: int
    # Token ids whose text is clean; the sim draws its output from these.
    clean_token_ids: list[int]
    # Local directory a router may load the tokenizer from ("" = none).
    path: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...


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
        self._word_id = {}
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

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        lines = [f"{m.get('role', 'user')}: {_content_text(m.get('content'))}" for m in messages]
        return "\n".join([*lines, "assistant:"])


class HfCodec:
    """A Hugging Face model directory's tokenizer.json + chat template."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer  # noqa: PLC0415 - only when a model dir exists

        self.path = str(directory)
        self._tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "tokenizer_config.json")
        model_config = _read_json(directory / "config.json")
        self.vocab_size = max(
            int(model_config.get("vocab_size") or 0), self._tok.get_vocab_size(with_added_tokens=True)
        )
        self._bos = _token_str(config.get("bos_token"))
        self._eos = _token_str(config.get("eos_token"))
        eos_id = self._tok.token_to_id(self._eos) if self._eos else None
        if eos_id is None:
            eos_id = model_config.get("eos_token_id")
            eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
        self.eos_token_id = int(eos_id) if eos_id is not None else 0
        self._template = config.get("chat_template") if isinstance(config.get("chat_template"), str) else None
        self._texts: dict[int, str] = {}
        special = {int(i) for i in self._special_ids()}
        self.clean_token_ids = [
            i for i in range(self._tok.get_vocab_size(with_added_tokens=False))
            if i not in special and _CLEAN_WORD.match(self.token_text(i) or "")
        ]
        if not self.clean_token_ids:
            raise ValueError(f"{directory}: tokenizer has no plain word tokens to generate from")

    def _special_ids(self) -> list[int]:
        return [i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special]

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=True)
            self._texts[token_id] = text
        return text

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if not self._template:
            return SyntheticCodec.render_chat(self, messages)  # type: ignore[arg-type]
        from jinja2 import TemplateError  # noqa: PLC0415
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)
        return env.from_string(self._template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=self._bos or "", eos_token=self._eos or "",
        )


def load_codec(model_dir: str | Path | None, vocab_size: int) -> TextCodec:
    """The directory's tokenizer when it has a tokenizer.json, else synthetic."""
    if model_dir:
        directory = Path(model_dir)
        if (directory / "tokenizer.json").is_file():
            return HfCodec(directory)
        log.warning("%s has no tokenizer.json; using synthetic lorem text", directory)
    return SyntheticCodec(vocab_size)


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content or "")


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
