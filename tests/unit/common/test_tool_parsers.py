"""The tool-call parsers (services/common/tool_calling/parsers.py) and the
OpenAI chunks they become (chat_output.py): a table of outputs, each fed
whole, split at every character boundary, one character at a time and in
random pieces -- the same content and calls every time."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.common.openai_api.requests import parse_chat_body
from services.common.tool_calling.chat_output import ToolChatFormatter
from services.common.tool_calling.parsers import (
    PARSERS,
    CallArguments,
    CallStart,
    TextOut,
    ToolCallParser,
    ToolEvent,
    collect,
    parser_for,
)
from services.gateway.events import Usage

Calls = list[tuple[str, str]]

CASES: list[tuple[str, str, str | None, Calls]] = [
    # (parser, model output, content, [(name, arguments)])
    ("hermes", "Just text.", "Just text.", []),
    ("hermes", "  spaced  out \n", "  spaced  out \n", []),
    ("hermes", 'a < b and <tool but no call', "a < b and <tool but no call", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("hermes", 'Let me look.\n<tool_call>{"name": "f", "arguments": {"q": "a}b\\"c", "n": [1, {"x": []}]}}'
     '</tool_call>\n<tool_call>\n{"name":"g","arguments":{}}\n</tool_call>\n', "Let me look.",
     [("f", '{"q": "a}b\\"c", "n": [1, {"x": []}]}'), ("g", "{}")]),
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "late_name"}</tool_call>', None,
     [("late_name", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "s", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("s", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "p", "parameters": {"k": true}}</tool_call>', None, [("p", '{"k": true}')]),
    ("hermes", '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"z": 0}}]</tool_call>',
     None, [("a", "{}"), ("b", '{"z": 0}')]),
    ("hermes", '<tool_call>{"not": "a call"}</tool_call> ok', '<tool_call>{"not": "a call"}</tool_call> ok', []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}', None, [("f", "{}")]),  # close tag missing
    ("hermes", '<tool_call>{"name": "f", "arguments": {}} then text', "then text", [("f", "{}")]),
    ("hermes", '<tool_call>{"name": "cut", "arguments": {"a": "unfinish', None, [("cut", '{"a": "unfinish')]),
    ("hermes", '<tool_call>{"na', '<tool_call>{"na', []),
    ("hermes", 'x <tool_call>', "x <tool_call>", []),
    ("hermes", '<tool_call>{"name": "\\u00e9t\\u00e9", "arguments": {"v": "\\u00e9"}}</tool_call>', None,
     [("été", '{"v": "\\u00e9"}')]),
    ("json", '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ("json", ' [{"name":"a","arguments":{"q":[1,{"z":"]}"}]}} , {"name":"b","arguments":{}}]', None,
     [("a", '{"q":[1,{"z":"]}"}]}'), ("b", "{}")]),
    ("json", "[]", None, []),
    ("json", '{"answer": 42}', '{"answer": 42}', []),
    ("json", '[1, 2]', "[1, 2]", []),
    ("json", "  Hello there", "  Hello there", []),
    ("json", '{"name": "f", "arguments": {}}\n\nand a remark', "and a remark", [("f", "{}")]),
    ("json", '{"name": "cut", "arguments": {"a": 1', None, [("cut", '{"a": 1')]),
    # SmolLM2-135M-Instruct on vLLM, constrained by tool_call_schema (required, then a named function)
    ("json", '[\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "C"\n  }\n},\n'
     '{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n    "unit": "F"\n  }\n}\n]', None,
     [("get_weather", '{\n    "city": "Paris",\n    "unit": "C"\n  }'),
      ("get_weather", '{\n    "city": "Paris",\n    "unit": "F"\n  }')]),
    ("json", '{\n  "name": "get_weather"\n  ,"arguments": {\n    "city": "Paris",\n    "unit": "C"\n  }\n}', None,
     [("get_weather", '{\n    "city": "Paris",\n    "unit": "C"\n  }')]),
]


def _run(parser: ToolCallParser, pieces: list[str]) -> list[ToolEvent]:
    events: list[ToolEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def _summary(events: list[ToolEvent]) -> tuple[str | None, Calls]:
    content = "".join(e.text for e in events if isinstance(e, TextOut)) or None
    calls: list[list[str]] = []
    for event in events:
        if isinstance(event, CallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
        elif isinstance(event, CallArguments):
            assert event.index == len(calls) - 1, "arguments go to the call just started"
            calls[event.index][1] += event.fragment
    return content, [(name, args) for name, args in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_output(name: str, text: str, content: str | None, calls: Calls) -> None:
    assert _summary(_run(PARSERS[name](), [text])) == (content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_split_at_every_boundary_gives_the_same(name: str, text: str, content: str | None, calls: Calls) -> None:
    for i in range(len(text) + 1):
        assert _summary(_run(PARSERS[name](), [text[:i], text[i:]])) == (content, calls), f"split at {i}"
    assert _summary(_run(PARSERS[name](), list(text))) == (content, calls), "one character at a time"
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(4, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _summary(_run(PARSERS[name](), pieces)) == (content, calls), pieces


def test_a_call_streams_before_it_ends() -> None:
    parser = PARSERS["hermes"]()
    assert parser.feed('Sure.\n<tool_call>\n{"name": "get_wea') == [TextOut("Sure.")]
    started = parser.feed('ther", "arguments": {"city": "Pa')
    assert isinstance(started[0], CallStart) and started[0].name == "get_weather" and started[0].index == 0
    assert started[1:] == [CallArguments(0, '{"city": "Pa')]
    assert parser.feed('ris"}}\n</tool_call>') == [CallArguments(0, 'ris"}')]
    assert parser.finish() == []


def test_ids_are_openai_shaped_and_unique() -> None:
    text = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{}}}}</tool_call>' for i in range(5))
    _, calls = collect(PARSERS["hermes"](), text)
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == 5
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)
    assert [c["function"]["name"] for c in calls] == [f"f{i}" for i in range(5)]


def test_content_release_holds_only_a_possible_tag_and_trailing_space() -> None:
    parser = PARSERS["hermes"]()
    assert parser.feed("Hello ") == [TextOut("Hello")]
    assert parser.feed("<tool") == []
    assert parser.feed("s> are") == [TextOut(" <tools> are")]
    assert parser.finish() == []


# ------------------------------------------------------------ which parser


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _generation(**fields: Any) -> Any:
    return parse_chat_body({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})


def test_parser_choice() -> None:
    assert parser_for(_generation(), "hermes") is None
    assert parser_for(_generation(tools=[TOOL], tool_choice="none"), "hermes") is None
    assert parser_for(_generation(tools=[TOOL]), "hermes").name == "hermes"
    assert parser_for(_generation(tools=[TOOL]), "json").name == "json"
    forced: list[dict[str, Any]] = [{"tool_choice": "required"},
                                    {"tool_choice": {"type": "function", "function": {"name": "f"}}}]
    for fields in forced:  # constrained output: bare JSON whatever the model's parser
        assert parser_for(_generation(tools=[TOOL], **fields), "hermes").name == "json"


# ------------------------------------------------------------ OpenAI shapes


def _chunks(raw: bytes) -> list[dict[str, Any]]:
    frames = [f for f in raw.decode().split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    return [json.loads(f[len("data: "):]) for f in frames]


def test_streamed_tool_call_deltas_are_shaped_as_openai() -> None:
    formatter = ToolChatFormatter("r1", "m", False, PARSERS["hermes"]())
    pieces = ["I'll check.", " <tool_", 'call>{"name": "get_weather", ', '"arguments": {"city"', ': "Paris"}}',
              "</tool_call>"]
    raw = b"".join(formatter.delta_sse(p) for p in pieces) + formatter.final_sse("stop")
    chunks = _chunks(raw)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"content": "I'll check."}
    assert deltas[1] == {"tool_calls": [{"index": 0, "id": deltas[1]["tool_calls"][0]["id"], "type": "function",
                                         "function": {"name": "get_weather", "arguments": ""}}]}
    fragments = [d["tool_calls"][0] for d in deltas[2:-1]]
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == '{"city": "Paris"}'
    assert len(fragments) == 2  # streamed as it came, not at the end
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert formatter.resumable is False


def test_plain_answer_through_the_tool_formatter_is_plain() -> None:
    formatter = ToolChatFormatter("r1", "m", False, PARSERS["hermes"]())
    raw = formatter.delta_sse("Paris is ") + formatter.delta_sse("sunny. ") + formatter.final_sse("stop")
    chunks = _chunks(raw)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Paris is sunny. "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_length_stays_length() -> None:
    formatter = ToolChatFormatter("r1", "m", False, PARSERS["json"]())
    raw = formatter.delta_sse('{"name": "f", "arguments": {"a": ') + formatter.final_sse("length")
    assert _chunks(raw)[-1]["choices"][0]["finish_reason"] == "length"


def test_whole_response_has_tool_calls_and_null_content() -> None:
    formatter = ToolChatFormatter("r1", "m", False, PARSERS["json"]())
    body = formatter.response('[{"name": "f", "arguments": {"a": 1}}]', [], "stop", Usage(10, 5, 0))
    ChatCompletion.model_validate(body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and choice["message"]["role"] == "assistant"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_whole_response_without_calls_keeps_content() -> None:
    formatter = ToolChatFormatter("r1", "m", False, PARSERS["hermes"]())
    body = formatter.response("No tool needed.", [], "stop", Usage(10, 5, 0))
    message = body["choices"][0]["message"]
    assert message["content"] == "No tool needed." and "tool_calls" not in message
    assert body["choices"][0]["finish_reason"] == "stop"
