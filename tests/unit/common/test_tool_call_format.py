"""The one decision of tool calling (services/common/tool_calling/call_format.py):
which tools are offered, and the format calls are written in -- the same for
the prompt and for the parser that reads the output. A call written into the
prompt in a request's format is read back whole by that request's parser."""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from services.common.openai_api.requests import parse_chat_body
from services.common.proto.kvmesh.v1 import common_pb2, inference_pb2
from services.common.tool_calling.call_format import FORCED_FORMAT, call_format, offered_tools
from services.common.tool_calling.grpc_mapping import ToolEventMapper
from services.common.tool_calling.parsers import PARSERS, collect, parser_for
from services.common.tool_calling.prompt import generic_messages

PACKAGE = Path(__file__).resolve().parents[3] / "services" / "common" / "tool_calling"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
NAMED = {"type": "function", "function": {"name": "f"}}


def _generation(**fields: Any) -> Any:
    return parse_chat_body({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})


# (request fields, the model's format, tools offered?, the call format)
CASES: list[tuple[dict[str, Any], str, bool, str]] = [
    ({}, "hermes", False, "hermes"),
    ({}, "json", False, "json"),
    ({"tools": [TOOL], "tool_choice": "none"}, "hermes", False, "hermes"),
    ({"tools": [TOOL]}, "hermes", True, "hermes"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "json", True, "json"),
    ({"tools": [TOOL], "tool_choice": "required"}, "hermes", True, FORCED_FORMAT),
    ({"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}, "hermes", True, FORCED_FORMAT),
    ({"tools": [TOOL], "tool_choice": NAMED}, "hermes", True, FORCED_FORMAT),
]


@pytest.mark.parametrize(("fields", "model_format", "offered", "fmt"), CASES)
def test_one_decision_for_prompt_and_parser(fields: dict[str, Any], model_format: str, offered: bool,
                                            fmt: str) -> None:
    generation = _generation(**fields)
    assert (offered_tools(generation) is not None) is offered
    assert call_format(generation, model_format) == fmt
    parser = parser_for(generation, model_format)
    assert (parser is not None) is offered
    if parser is not None:
        assert parser.name == fmt


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_a_call_written_in_the_prompt_reads_back_in_the_same_format(fmt: str) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"q": "a"}'}}
    rendered = generic_messages([{"role": "assistant", "content": None, "tool_calls": [call]}], None, fmt)
    content, calls = collect(PARSERS[fmt](), rendered[0]["content"])
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"q": "a"})]


def test_the_package_imports_nothing_from_the_gateway() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.startswith("services.gateway") for n in names), f"{path.name} imports {names}"


def test_grpc_mapper_reads_the_proto_form_only() -> None:
    mapper = ToolEventMapper("r1", PARSERS["json"]())
    delta = inference_pb2.GenerateEvent(request_id="r1", delta=inference_pb2.DeltaEvent(
        text='{"name": "f", "arguments": {}}', token_ids=[1, 2]))
    out = mapper.map(None, delta)
    assert out[0].delta.text == "" and list(out[0].delta.token_ids) == [1, 2]
    assert [(e.tool_call.index, e.tool_call.name) for e in out[1:] if e.tool_call.name] == [(0, "f")]
    finished = inference_pb2.GenerateEvent(request_id="r1", finished=inference_pb2.FinishedEvent(
        finish_reason=common_pb2.FINISH_REASON_STOP))
    assert mapper.map(None, finished)[-1].finished.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    heartbeat = inference_pb2.GenerateEvent(request_id="r1", heartbeat=inference_pb2.HeartbeatEvent())
    assert mapper.map(None, heartbeat) == [heartbeat]


@pytest.mark.parametrize("name", sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"))
def test_public_surface(name: str) -> None:
    module = importlib.import_module(f"services.common.tool_calling.{name}")
    assert module.__all__, name
    for symbol in module.__all__:
        assert hasattr(module, symbol), f"{name}.{symbol}"
