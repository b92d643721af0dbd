"""OpenAI's exact response shapes: `chat.completion`, `chat.completion.chunk`,
`text_completion` (streamed and not), usage with
`prompt_tokens_details.cached_tokens`, logprobs in each API's own layout."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from services.common.proto.kvmesh.v1 import common_pb2
from services.gateway.events import Finished, TextDelta, Usage

__all__ = ["ChatFormatter", "CompletionFormatter", "Formatter", "sse", "usage_dict"]

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEARTBEAT = b": keep-alive\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


# json's C string encoder (ensure_ascii=False), exactly what `sse` uses for a str.
_json_str = json.encoder.encode_basestring
_SLOT = "\x00kvmesh-text-slot\x00"


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


class Formatter:
    """Shared state of one response: id, creation time, model."""

    object_chunk = ""
    object_full = ""

    def __init__(self, request_id: str, model: str, include_usage: bool, prefix: str) -> None:
        self.id = f"{prefix}-{request_id}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        # (head, tail) bytes around the text of a delta chunk; built once.
        self._frame: tuple[bytes, bytes] | None = None

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "object": self.object_chunk, "created": self.created, "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def delta_chunk(self, delta: TextDelta) -> dict[str, Any]:  # pragma: no cover - per subclass
        raise NotImplementedError

    def delta_sse(self, delta: TextDelta) -> bytes:
        """`sse(self.delta_chunk(delta))`, byte for byte, but on the hot path
        (a delta without logprobs) only the text is JSON-encoded: the rest of
        the chunk is the same for every delta of a response."""
        if delta.logprobs:
            return sse(self.delta_chunk(delta))
        if self._frame is None:
            whole = sse(self.delta_chunk(TextDelta(_SLOT, [])))
            head, tail = whole.split(_json_str(_SLOT).encode(), 1)
            self._frame = (head, tail)
        head, tail = self._frame
        return head + _json_str(delta.text).encode() + tail

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {
            "id": self.id, "object": self.object_chunk, "created": self.created, "model": self.model,
            "choices": [], "usage": usage_dict(usage),
        }


class ChatFormatter(Formatter):
    object_chunk = "chat.completion.chunk"
    object_full = "chat.completion"

    def __init__(self, request_id: str, model: str, include_usage: bool = False) -> None:
        super().__init__(request_id, model, include_usage, "chatcmpl")

    @staticmethod
    def logprobs(items: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
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

    def first_chunk(self) -> dict[str, Any]:
        return self._chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def delta_chunk(self, delta: TextDelta) -> dict[str, Any]:
        return self._chunk(
            [{"index": 0, "delta": {"content": delta.text}, "logprobs": self.logprobs(delta.logprobs),
              "finish_reason": None}]
        )

    def final_chunk(self, finished: Finished) -> dict[str, Any]:
        return self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finished.reason.value}])

    def response(
        self, text: str, logprobs: Sequence[common_pb2.TokenLogprob], finished: Finished
    ) -> dict[str, Any]:
        return {
            "id": self.id, "object": self.object_full, "created": self.created, "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": self.logprobs(logprobs),
                    "finish_reason": finished.reason.value,
                }
            ],
            "usage": usage_dict(finished.usage),
        }


class CompletionFormatter(Formatter):
    object_chunk = "text_completion"
    object_full = "text_completion"

    def __init__(self, request_id: str, model: str, include_usage: bool = False) -> None:
        super().__init__(request_id, model, include_usage, "cmpl")
        self._offset = 0  # text_offset of the next token

    def logprobs(self, items: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any] | None:
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

    def first_chunk(self) -> dict[str, Any] | None:
        return None  # text completions have no role chunk

    def delta_chunk(self, delta: TextDelta) -> dict[str, Any]:
        return self._chunk(
            [{"index": 0, "text": delta.text, "logprobs": self.logprobs(delta.logprobs), "finish_reason": None}]
        )

    def final_chunk(self, finished: Finished) -> dict[str, Any]:
        return self._chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": finished.reason.value}])

    def response(
        self, text: str, logprobs: Sequence[common_pb2.TokenLogprob], finished: Finished
    ) -> dict[str, Any]:
        return {
            "id": self.id, "object": self.object_full, "created": self.created, "model": self.model,
            "choices": [
                {"index": 0, "text": text, "logprobs": self.logprobs(logprobs),
                 "finish_reason": finished.reason.value}
            ],
            "usage": usage_dict(finished.usage),
        }
