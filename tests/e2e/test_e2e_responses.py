"""`/v1/responses` through the real Envoy on the sim mesh (scheduler, two sim
engines, one gateway): the official SDK, streamed and not, and a stored
response continued and read back."""

from __future__ import annotations

import openai
import pytest

from services.launcher.mesh import Mesh

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def sdk(e2e_mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{e2e_mesh.endpoints.public_http}/v1", api_key=e2e_mesh.api_key,
                         timeout=60.0, max_retries=0)


def test_create_through_envoy(sdk: openai.OpenAI) -> None:
    out = sdk.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=12)
    assert out.object == "response" and out.status in ("completed", "incomplete")
    assert out.output_text and out.usage.output_tokens > 0


def test_stream_through_envoy_yields_the_typed_events(sdk: openai.OpenAI) -> None:
    events = list(sdk.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text


def test_store_continue_and_read_back(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=8, store=True)
    second = sdk.responses.create(model=MODEL, input="And then?", max_output_tokens=8, previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert sdk.responses.retrieve(first.id).output_text == first.output_text
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        sdk.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
