"""StructuredSpec <-> common.proto StructuredOutput, and its trip to the engine."""

from __future__ import annotations

import pytest

from services.common.openai_api.structured_outputs import (
    STRUCTURED_KINDS,
    StructuredSpec,
    structured_from_proto,
    structured_to_proto,
)
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2
from services.engine.grpc_api import request_from_proto


@pytest.mark.parametrize("kind", STRUCTURED_KINDS)
def test_round_trip(kind: str) -> None:
    spec = StructuredSpec(kind=kind, value='{"type": "object"}' if kind != "json_object" else "",  # type: ignore[arg-type]  # kind is each of STRUCTURED_KINDS, a str where a Literal is declared
                          strict=kind == "json_schema")
    params = common_pb2.SamplingParams(max_tokens=5)
    params.structured.CopyFrom(structured_to_proto(spec))
    wire = common_pb2.SamplingParams.FromString(params.SerializeToString())
    assert structured_from_proto(wire) == spec


def test_unset_and_unspecified_are_none() -> None:
    assert structured_from_proto(common_pb2.SamplingParams(max_tokens=5)) is None
    params = common_pb2.SamplingParams(max_tokens=5, structured=common_pb2.StructuredOutput(value="x"))
    assert structured_from_proto(params) is None


def test_engine_request_carries_it() -> None:
    spec = StructuredSpec(kind="choice", value='["yes", "no"]')
    params = common_pb2.SamplingParams(max_tokens=5, structured=structured_to_proto(spec))
    request = request_from_proto(engine_pb2.EngineRequest(request_id="r", prompt_token_ids=[1, 2], sampling=params,
                                                          resumed_tokens=1))
    assert request.sampling.structured == spec
    assert request.resumed_tokens == 1
    plain = request_from_proto(engine_pb2.EngineRequest(request_id="r", prompt_token_ids=[1],
                                                        sampling=common_pb2.SamplingParams(max_tokens=5)))
    assert plain.sampling.structured is None
