"""OpenAI's exact response shapes: `chat.completion`, `chat.completion.chunk`,
`text_completion` (streamed and not), usage with
`prompt_tokens_details.cached_tokens`, logprobs in each API's own layout, and
SSE framing. Both OpenAI front doors format with it.

A formatter is one response's state (id, creation time, model, the
completions API's running text offset). With `token_ids=True` each choice
also carries the generated token ids (vLLM's extension, which the engines'
own endpoint serves to load generators and peer routers).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Protocol

from services.common.proto.kvmesh.v1 import common_pb2

__all__ = [
    "SSE_DONE",
    "SSE_HEARTBEAT",
    "ChatFormatter",
    "CompletionFormatter",
    "Formatter",
    "UsageCounts",
    "sse",
    "usage_dict",
]

SSE_DONE = b"data: [DONE]\n\n"
# A comment line with no blank line after it: every SSE parser skips it, and
# none dispatches an event for it -- a blank line would make some (openai's
# Python SDK) dispatch an empty event once an `id:` was seen (stream resume).
SSE_HEARTBEAT = b": keep-alive\n"

Logprobs = Sequence[common_pb2.TokenLogprob]


class UsageCounts(Protocol):
    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

    @property
    def cached_tokens(self) -> int: ...


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


# json's C string encoder (ensure_ascii=False), exactly what `sse` uses for a str.
_json_str = json.encoder.encode_basestring
_SLOT = "\x00kvmesh-text-slot\x00"


def usage_dict(usage: UsageCounts) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


class Formatter:
    """Shared state of one response: id, creation time, model."""

    object_chunk = ""
    object_full = ""
    prefix = ""
    # Whether each delta chunk may carry an SSE `id:` to resume after it
    # (False when a chunk is not one engine delta: tool-call parsing).
    resumable = True

    def __init__(self, request_id: str, model: str, include_usage: bool = False, token_ids: bool = False) -> None:
        self.id = f"{self.prefix}-{request_id}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.token_ids = token_ids
        # (head, tail) bytes around the text of a delta chunk; built once.
        self._frame: tuple[bytes, bytes] | None = None

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = {**self._envelope(self.object_chunk), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def _with_ids(self, choice: dict[str, Any], token_ids: Sequence[int]) -> dict[str, Any]:
        if self.token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def first_chunk(self, index: int = 0) -> dict[str, Any] | None:
        return None

    def _delta_choice(self, text: str, logprobs: Logprobs) -> dict[str, Any]:  # pragma: no cover - per subclass
        raise NotImplementedError

    def _full_choice(self, text: str, logprobs: Logprobs) -> dict[str, Any]:  # pragma: no cover - per subclass
        raise NotImplementedError

    def final_chunk(self, reason: str, index: int = 0) -> dict[str, Any]:  # pragma: no cover - per subclass
        raise NotImplementedError

    def delta_chunk(self, text: str, logprobs: Logprobs = (), token_ids: Sequence[int] = (),
                    index: int = 0) -> dict[str, Any]:
        choice = self._with_ids(self._delta_choice(text, logprobs), token_ids)
        choice["index"] = index  # which of n choices
        return self._chunk(choice)

    def delta_sse(self, text: str, logprobs: Logprobs = (), token_ids: Sequence[int] = (), index: int = 0) -> bytes:
        """`sse(self.delta_chunk(...))`, byte for byte, but on the hot path
        (a delta of choice 0 without logprobs or token ids) only the text is
        JSON-encoded: the rest of the chunk is the same for every delta."""
        if logprobs or self.token_ids or index:
            return sse(self.delta_chunk(text, logprobs, token_ids, index))
        if self._frame is None:
            whole = sse(self.delta_chunk(_SLOT))
            head, tail = whole.split(_json_str(_SLOT).encode(), 1)
            self._frame = (head, tail)
        head, tail = self._frame
        return head + _json_str(text).encode() + tail

    def final_sse(self, reason: str, index: int = 0) -> bytes:
        """The last chunk of choice `index` (and whatever a subclass held back before it)."""
        return sse(self.final_chunk(reason, index))

    def usage_chunk(self, usage: UsageCounts) -> dict[str, Any]:
        return {**self._envelope(self.object_chunk), "choices": [], "usage": usage_dict(usage)}

    def response(self, text: str, logprobs: Logprobs, reason: str | None, usage: UsageCounts,
                 token_ids: Sequence[int] = ()) -> dict[str, Any]:
        return self.response_n([(text, logprobs, reason)], usage, [token_ids])

    def response_n(self, choices: Sequence[tuple[str, Logprobs, str | None]], usage: UsageCounts,
                   token_ids: Sequence[Sequence[int]] = ()) -> dict[str, Any]:
        """The whole response with one choice per (text, logprobs, finish
        reason), `index` in order: n > 1."""
        out = []
        for i, (text, logprobs, reason) in enumerate(choices):
            choice = {**self._full_choice(text, logprobs), "finish_reason": reason}
            choice["index"] = i
            out.append(self._with_ids(choice, token_ids[i] if i < len(token_ids) else ()))
        return {**self._envelope(self.object_full), "choices": out, "usage": usage_dict(usage)}


class ChatFormatter(Formatter):
    object_chunk = "chat.completion.chunk"
    object_full = "chat.completion"
    prefix = "chatcmpl"

    @staticmethod
    def logprobs(items: Logprobs) -> dict[str, Any] | None:
        if not items:
            return None
        return {
            "content": [
                {
                    "token": lp.token, "logprob": lp.logprob, "bytes": _bytes(lp.token),
                    "top_logprobs": [
                        {"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token)} for t in lp.top
                    ],
                }
                for lp in items
            ],
            "refusal": None,
        }

    def first_chunk(self, index: int = 0) -> dict[str, Any]:
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def _delta_choice(self, text: str, logprobs: Logprobs) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text}, "logprobs": self.logprobs(logprobs), "finish_reason": None}

    def final_chunk(self, reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})

    def _full_choice(self, text: str, logprobs: Logprobs) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": self.logprobs(logprobs)}

    def tool_call_chunk(self, index: int, arguments: str, call_id: str = "", name: str = "") -> dict[str, Any]:
        """A streamed tool-call delta as OpenAI shapes it: a call's first
        chunk has its id, type and name (and arguments ""), the next ones
        only arguments fragments."""
        call: dict[str, Any] = {"index": index}
        if call_id:
            call.update(id=call_id, type="function", function={"name": name, "arguments": arguments})
        else:
            call["function"] = {"arguments": arguments}
        return self._chunk({"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None})

    def tool_response(self, content: str | None, tool_calls: list[dict[str, Any]], logprobs: Logprobs,
                      reason: str | None, usage: UsageCounts) -> dict[str, Any]:
        """The whole response with `message.tool_calls` (content None when
        the model wrote only calls)."""
        body = Formatter.response(self, content or "", logprobs, reason, usage)
        message = body["choices"][0]["message"]
        message["content"] = content
        if tool_calls:
            message["tool_calls"] = tool_calls
        return body


class CompletionFormatter(Formatter):
    object_chunk = "text_completion"
    object_full = "text_completion"
    prefix = "cmpl"

    def __init__(self, request_id: str, model: str, include_usage: bool = False, token_ids: bool = False) -> None:
        super().__init__(request_id, model, include_usage, token_ids)
        self._offset = 0  # text_offset of the next token

    def logprobs(self, items: Logprobs) -> dict[str, Any] | None:
        if not items:
            return None
        offsets = []
        for lp in items:
            offsets.append(self._offset)
            self._offset += len(lp.token)
        return {
            "tokens": [lp.token for lp in items],
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items],
            "text_offset": offsets,
        }

    def _delta_choice(self, text: str, logprobs: Logprobs) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": None}

    def final_chunk(self, reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"index": index, "text": "", "logprobs": None, "finish_reason": reason})

    def _full_choice(self, text: str, logprobs: Logprobs) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self.logprobs(logprobs)}
