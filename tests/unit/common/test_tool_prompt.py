"""Tools in the prompt: through the chat template when it renders tools,
else through the generic tool prompt (services/common/tool_calling/prompt.py); the
history's tool calls and results are rendered so the model sees them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.common.openai_api.errors import ApiError
from services.common.tokenizer import HfTokenizer, template_renders_tools
from services.common.tool_calling.prompt import generic_messages

ROOT = Path(__file__).resolve().parents[3]
SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather", "strict": False,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1"},
]

# A template that takes tools, Qwen2.5-like (tools listed, calls and results rendered).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _model(directory: Path, template: str) -> HfTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "[UNK]"}))
    return HfTokenizer(directory)


@pytest.fixture
def tools_model(tmp_path: Path) -> HfTokenizer:
    return _model(tmp_path, TOOLS_TEMPLATE)


@pytest.fixture
def plain_model(tmp_path: Path) -> HfTokenizer:
    return _model(tmp_path, PLAIN_TEMPLATE)


def test_template_support_is_detected() -> None:
    assert template_renders_tools(TOOLS_TEMPLATE)
    assert not template_renders_tools(PLAIN_TEMPLATE)


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(), reason="SmolLM2 not built (make setup)")
def test_smollm2_template_has_no_tool_support_so_the_generic_prompt_is_used() -> None:
    model = HfTokenizer(SMOLLM2)
    assert not model.template_renders_tools
    text = model.render_chat(HISTORY, [WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_with_tools_gets_tools_and_calls_as_objects(tools_model: HfTokenizer) -> None:
    text = tools_model.render_chat(HISTORY, [WEATHER])
    assert text.startswith("<|im_start|>system\nTOOLS: get_weather<|im_end|>")
    # arguments reach the template as a dict (as vLLM and transformers pass them)
    assert '<call>get_weather {"city": "Paris"}</call>' in text
    assert "<|im_start|>tool\nsunny, 21C<|im_end|>" in text
    assert "# Tools" not in text


def test_template_with_tools_without_tools_in_request(tools_model: HfTokenizer) -> None:
    text = tools_model.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_generic_prompt_on_a_plain_template(plain_model: HfTokenizer) -> None:
    text = plain_model.render_chat(HISTORY, [WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert json.dumps(WEATHER) in text
    assert '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text


def test_plain_chat_is_unchanged(plain_model: HfTokenizer) -> None:
    chat = [{"role": "user", "content": "hi"}]
    assert plain_model.render_chat(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_generic_messages_merge_system_and_results() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."}, *HISTORY,
        {"role": "tool", "content": "also windy", "tool_call_id": "call_2"},
    ]
    out = generic_messages(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert out[3]["content"] == ("<tool_response>\nsunny, 21C\n</tool_response>\n"
                                 "<tool_response>\nalso windy\n</tool_response>")
    assert all(set(m) <= {"role", "content", "name"} for m in out)


def test_generic_json_format_asks_for_bare_json() -> None:
    out = generic_messages(HISTORY, [WEATHER], "json")
    assert "<tool_call>" not in out[0]["content"] and "only a json object" in out[0]["content"]
    assert out[2]["content"] == '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_history_without_tools_still_renders_calls(plain_model: HfTokenizer) -> None:
    text = plain_model.render_chat(HISTORY)
    assert "# Tools" not in text and "<tool_call>" in text and "<tool_response>" in text


def test_assistant_content_kept_before_calls() -> None:
    out = generic_messages([{"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}], None)
    assert out[0]["content"].startswith("Checking.\n<tool_call>\n")


def test_template_errors_stay_400(tmp_path: Path) -> None:
    model = _model(tmp_path, "{{ raise_exception('no tools here') }}{{ tools }}")
    with pytest.raises(ApiError) as err:
        model.render_chat(HISTORY, [WEATHER])
    assert err.value.param == "messages"


def test_template_type_errors_are_400(tmp_path: Path) -> None:
    # A tools template that expects arguments as an object meets arguments that are not JSON.
    model = _model(tmp_path, "{% for m in messages %}{% for c in m.tool_calls or [] %}"
                             "{{ c.function.arguments + 1 }}{% endfor %}{% endfor %}{{ tools }}")
    bad = {**CALL, "function": {"name": "get_weather", "arguments": "not json"}}
    with pytest.raises(ApiError) as err:
        model.render_chat([{"role": "assistant", "content": "", "tool_calls": [bad]}], [WEATHER])
    assert err.value.param == "messages"
