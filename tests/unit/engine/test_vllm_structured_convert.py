"""kvmesh StructuredSpec -> vLLM: StructuredOutputsParams on a fresh request,
the resumed-grammar logits processor's extra_args on a resumed one."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.openai_api.structured_outputs import StructuredSpec
from services.engine.backend import InvalidRequest, Sampling
from services.engine.vllm_backend.convert import RESUMED_STRUCTURED, sampling_params, structured_fields
from services.engine.vllm_backend.vllm_api import VllmApi


class ClientError(Exception):
    pass


def _api(**kw: Any) -> VllmApi:
    base: dict[str, Any] = dict(async_llm=None, engine_args=None, kv_events_config=None, structured_outputs_config=None,
                                tokens_prompt=dict, sampling_params=dict, structured_outputs=dict, delta="delta",
                                kv_event_batch=None, client_error=ClientError, engine_dead=RuntimeError)
    return VllmApi(**{**base, **kw})


@pytest.mark.parametrize(("spec", "fields"), [
    (StructuredSpec("json_schema", '{"type": "object"}'), {"json": '{"type": "object"}'}),
    (StructuredSpec("json_object"), {"json_object": True}),
    (StructuredSpec("regex", "a+"), {"regex": "a+"}),
    (StructuredSpec("choice", '["x", "y"]'), {"choice": ["x", "y"]}),
    (StructuredSpec("grammar", 'root ::= "a"'), {"grammar": 'root ::= "a"'}),
])
def test_fields(spec: StructuredSpec, fields: dict[str, Any]) -> None:
    assert structured_fields(spec) == fields


def test_fresh_request_uses_vllms_own_path() -> None:
    spec = StructuredSpec("regex", "a+")
    params = sampling_params(_api(), Sampling(max_tokens=4, structured=spec))
    assert params["structured_outputs"] == {"regex": "a+"} and "extra_args" not in params


def test_resumed_request_goes_to_the_logits_processor() -> None:
    spec = StructuredSpec("json_schema", "{}")
    params = sampling_params(_api(), Sampling(max_tokens=4, structured=spec), resumed_tokens=7)
    assert "structured_outputs" not in params
    assert params["extra_args"] == {RESUMED_STRUCTURED: {"kind": "json_schema", "value": "{}", "resumed_tokens": 7}}


def test_unstructured_requests_carry_neither() -> None:
    params = sampling_params(_api(), Sampling(max_tokens=4), resumed_tokens=3)
    assert "structured_outputs" not in params and "extra_args" not in params


def test_vllm_refusing_the_constraint_is_invalid_request() -> None:
    def refuse(**_: Any) -> None:
        raise ClientError("bad grammar")
    with pytest.raises(InvalidRequest, match="bad grammar"):
        sampling_params(_api(structured_outputs=refuse),
                        Sampling(max_tokens=4, structured=StructuredSpec("regex", "(")))
