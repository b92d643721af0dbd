"""A model directory's tokenizer and chat template (services/common/tokenizer.py):
where the template is found and what it may use."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from services.common.config import ConfigError
from services.common.openai_api.errors import ApiError, ErrorKind
from services.common.tokenizer import ChatTemplateError, HfTokenizer, context_length

HI = [{"role": "user", "content": "hi"}]


def _model(directory: Path, tok_config: dict, template_file: str | None = None, config: dict | None = None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["<s>", "</s>", "<unk>", "hi", "user", "assistant", ":", "A", "B"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (directory / "config.json").write_text(json.dumps(config or {"max_position_embeddings": 64}))
    if template_file is not None:
        (directory / "chat_template.jinja").write_text(template_file)
    return directory


def test_chat_template_jinja_file_wins_over_the_config(tmp_path: Path) -> None:
    tok = HfTokenizer(_model(tmp_path, {"chat_template": "B"}, template_file="A {{ messages[0].content }}"))
    assert tok.render_chat(HI) == "A hi"


@pytest.mark.parametrize(("templates", "expected"), [
    ([{"name": "tool_use", "template": "B"}, {"name": "default", "template": "A"}], "A"),
    ([{"name": "rag", "template": "B"}], "B"),  # no "default": the first
])
def test_list_form_templates(tmp_path: Path, templates: list, expected: str) -> None:
    assert HfTokenizer(_model(tmp_path, {"chat_template": templates})).render_chat(HI) == expected


def test_template_globals_and_extensions(tmp_path: Path) -> None:
    template = ("{{ bos_token }}{{ strftime_now('%Y') }}{% for m in messages %}{% if loop.index > 1 %}{% break %}"
                "{% endif %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content | tojson }}"
                "{% endfor %}{{ eos_token }}")
    tok = HfTokenizer(_model(tmp_path, {"chat_template": template, "bos_token": {"content": "<s>"},
                                        "eos_token": "</s>"}))
    text = tok.render_chat([{"role": "user", "content": "ü"}, {"role": "user", "content": "never"}])
    assert text == f'<s>{datetime.now().year}"ü"</s>'
    assert tok.eos_token_id == 1


def test_template_errors_and_no_template_are_400s_on_messages(tmp_path: Path) -> None:
    tok = HfTokenizer(_model(tmp_path, {"chat_template": "{{ raise_exception('no ' + messages[0].role) }}"}))
    with pytest.raises(ChatTemplateError, match="no user") as err:
        tok.render_chat(HI)
    assert isinstance(err.value, ApiError) and err.value.kind is ErrorKind.INVALID_REQUEST
    assert err.value.param == "messages"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        HfTokenizer(tmp_path).chat_prompt(HI)


def test_chat_gets_no_extra_specials_but_a_raw_prompt_does(tmp_path: Path) -> None:
    tok = HfTokenizer(_model(tmp_path, {"chat_template": "{{ messages[0].content }}"}))
    assert tok.chat_prompt(HI).token_ids == [3]
    assert tok.text_prompt("hi").token_ids == [0, 3]


def test_context_length_and_missing_files(tmp_path: Path) -> None:
    _model(tmp_path, {}, config={"n_positions": 1024})
    assert context_length(tmp_path) == 1024
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable JSON"):
        context_length(tmp_path)
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        HfTokenizer(tmp_path / "nowhere")
