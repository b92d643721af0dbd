"""A model directory's tokenizer and chat template: the one place that turns a
chat or a text prompt into the token ids an engine runs.

Both OpenAI front doors use it — the gateway (services/gateway/tokenization.py
adds prefix hashing and the context check) and an engine's own HTTP endpoint
(services/engine/model.py adds the sim's text codec) — so a chat sent to
either gives byte-identical prompt token ids.

Uses `tokenizers` + jinja2 directly (the same sandboxed rendering transformers
uses for `apply_chat_template`) rather than transformers' AutoTokenizer:
importing transformers costs ~4.7 s here, `tokenizers` ~0.07 s, and the token
ids are the same (same tokenizer.json). Nothing is ever fetched from a hub.

The chat template is found the way transformers finds it: `chat_template.jinja`
next to the tokenizer first, else `tokenizer_config.json`'s `chat_template`
(a string, or a list of named templates of which "default" is used). It is
rendered with the globals and extensions Hugging Face templates rely on:
`raise_exception`, `strftime_now`, `tojson`, `{% break %}`/`{% continue %}`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.common.config import ConfigError
from services.common.openai_api.errors import ApiError, ErrorKind
from services.common.tool_calling.prompt import generic_messages, has_tool_fields, template_messages

__all__ = [
    "ChatTemplateError",
    "HfTokenizer",
    "RenderedPrompt",
    "context_length",
    "load_chat_template",
    "read_model_json",
    "template_renders_tools",
]

# Special tokens a template may name; passed to it as variables.
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# config.json keys that hold the context length, in the order HF models use them.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class ChatTemplateError(ApiError):
    """The model has no chat template, or its template rejected the messages
    (a `raise_exception` in the template, or a template error): a 400 on
    `messages` at either front door."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorKind.INVALID_REQUEST, message, param="messages")


@dataclass(frozen=True)
class RenderedPrompt:
    text: str             # the prompt as text (chat template applied for a chat)
    token_ids: list[int]


def read_model_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON file as a dict ({} when absent or not an object)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def context_length(model_dir: Path) -> int:
    """The context length config.json declares, 0 when it declares none."""
    config = read_model_json(model_dir / "config.json")
    for key in _CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def load_chat_template(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    """The template's source, found as transformers finds it (module docstring)."""
    template_file = model_dir / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def template_renders_tools(source: str) -> bool:
    """Whether a chat template takes `tools` (it reads the variable), as
    Qwen2.5's, Llama 3.1's or Hermes' do; else tools are rendered through
    services/common/tool_calling/prompt.py's generic prompt."""
    return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(source))


def _special(config: dict[str, Any], name: str) -> str | None:
    value = config.get(name)
    if isinstance(value, dict):  # {"content": "<s>", ...} (AddedToken form)
        value = value.get("content")
    return value if isinstance(value, str) else None


class HfTokenizer:
    """A Hugging Face model directory's tokenizer.json + chat template. Immutable."""

    def __init__(self, model_dir: Path, name: str = "") -> None:
        self.model_dir = model_dir
        self.name = name or model_dir.name  # for messages
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(f"no tokenizer.json in {model_dir}")
        self._tokenizer = Tokenizer.from_file(str(tok_file))
        tok_config = read_model_json(model_dir / "tokenizer_config.json")
        self.bos_token = _special(tok_config, "bos_token")
        self.eos_token = _special(tok_config, "eos_token")
        self._specials = {k: v for k in _SPECIAL_NAMES if (v := _special(tok_config, k))}
        source = load_chat_template(model_dir, tok_config)
        self._template = _compile(source) if source is not None else None
        self.template_renders_tools = source is not None and template_renders_tools(source)
        # Every id the tokenizer can produce or decode, added tokens included.
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._eos_id()

    def _eos_id(self) -> int:
        eos_id = self._tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        if eos_id is None:
            eos_id = read_model_json(self.model_dir / "config.json").get("eos_token_id")
            eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
        return int(eos_id) if isinstance(eos_id, int) else 0

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def raw(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` itself (its added tokens, plain encodes)."""
        return self._tokenizer

    def render_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    tool_format: str = "hermes", add_generation_prompt: bool = True) -> str:
        """The chat as prompt text, ending with the assistant's turn opened
        (unless `add_generation_prompt` is False: /tokenize's option).
        Tools and the history's tool calls and results go through the
        template when it renders tools, else through the generic tool prompt
        in `tool_format` ("hermes" or "json", as services/common/tool_calling/call_format.py
        decides; the prompt: services/common/tool_calling/prompt.py)."""
        if self._template is None:
            raise ChatTemplateError(
                f"model {self.name!r} has no chat template; use /v1/completions with a raw prompt"
            )
        extra: dict[str, Any] = {}
        if tools or has_tool_fields(messages):
            if self.template_renders_tools:
                messages, extra = template_messages(messages), {"tools": list(tools) if tools else None}
            else:
                messages = generic_messages(messages, tools, tool_format)
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self._specials, **extra)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # a shape the template did not expect
            raise ChatTemplateError(f"the model's chat template could not render the messages: {exc!r}") from exc

    def chat_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
                    tool_format: str = "hermes") -> RenderedPrompt:
        text = self.render_chat(messages, tools, tool_format)
        # The template already holds BOS/specials: do not add them twice.
        return RenderedPrompt(text, self.encode(text, add_special_tokens=False))

    def text_prompt(self, text: str) -> RenderedPrompt:
        # A raw prompt gets the tokenizer's own specials (BOS), as vLLM does.
        return RenderedPrompt(text, self.encode(text, add_special_tokens=True))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string as the vocabulary spells it ("Ġhello")."""
        return [self._tokenizer.id_to_token(i) or "" for i in ids]

    def special_token_ids(self) -> set[int]:
        return {int(i) for i, tok in self._tokenizer.get_added_tokens_decoder().items() if tok.special}

    def base_vocab_size(self) -> int:
        """Ids of the model's vocabulary proper, added tokens excluded."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)
