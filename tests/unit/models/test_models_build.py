"""The locally built model directories (services/models/build.py).

These check what `make setup` produced: the files every consumer needs, and
that both tokenizer loaders agree and round-trip text, offline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.models import build

REPO = Path(__file__).resolve().parents[3]
MODELS = REPO / ".models"
DIRS = [build.SMOLLM2_DIR, build.TINY_DIR]


def _model_dir(name: str) -> Path:
    path = MODELS / name
    if not build.is_complete(path):
        pytest.skip(f"{path} not built: run `make setup` (python -m services.models.build)")
    return path


def test_gguf_is_located_without_importing_llm() -> None:
    path = build.find_smollm2_gguf()
    assert path.name.endswith(".gguf") and path.stat().st_size > 50_000_000


@pytest.mark.parametrize("name", DIRS)
def test_directory_has_every_file(name: str) -> None:
    path = _model_dir(name)
    for required in build.REQUIRED_FILES:
        assert (path / required).is_file(), required
    assert list(path.glob("*.safetensors"))
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 49152
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]


def test_tiny_llama_shape() -> None:
    config = json.loads((_model_dir(build.TINY_DIR) / "config.json").read_text())
    shape = build.TinyLlamaShape()
    assert config["num_hidden_layers"] == shape.num_hidden_layers
    assert config["hidden_size"] == shape.hidden_size
    assert config["num_attention_heads"] == shape.num_attention_heads
    assert config["intermediate_size"] == shape.intermediate_size
    assert config["max_position_embeddings"] == shape.max_position_embeddings


@pytest.mark.parametrize("name", DIRS)
def test_tokenizers_agree_and_round_trip(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _model_dir(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(path))
    text = "The capital of France is Paris. Ünïcödé, 123 + tabs\tand\nnewlines."
    ids = raw.encode(text, add_special_tokens=False).ids
    assert ids == auto.encode(text, add_special_tokens=False)
    assert raw.decode(ids) == text
    assert auto.eos_token == "<|im_end|>"


@pytest.mark.parametrize("name", DIRS)
def test_chat_template_renders(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _model_dir(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(path))
    rendered = auto.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in rendered


def _built_tiny(tmp_path: Path, shape: build.TinyLlamaShape) -> Path:
    """A directory that looks complete, marked as built from `shape`."""
    done = tmp_path / build.TINY_DIR
    done.mkdir()
    for required in build.REQUIRED_FILES:
        (done / required).write_text("{}")
    (done / "model.safetensors").write_bytes(b"x")
    (done / build.COMPLETE_MARKER).write_text(f"built\n{shape.recipe()}\n")
    return done


def test_build_is_idempotent(tmp_path: Path) -> None:
    """A complete directory is skipped without loading anything."""
    done = _built_tiny(tmp_path, build.TinyLlamaShape())
    before = {p.name: p.stat().st_mtime_ns for p in done.iterdir()}
    assert build.build_tiny_llama(tmp_path, tokenizer_dir=tmp_path / "absent") == done
    assert {p.name: p.stat().st_mtime_ns for p in done.iterdir()} == before


def test_a_directory_from_another_recipe_is_not_complete(tmp_path: Path) -> None:
    """A changed TinyLlamaShape rebuilds the model instead of reusing the old one."""
    old = build.TinyLlamaShape(max_position_embeddings=2048)
    done = _built_tiny(tmp_path, old)
    assert build.is_complete(done)  # complete as a directory ...
    assert build.is_complete(done, old.recipe())
    assert not build.is_complete(done, build.TinyLlamaShape().recipe())  # ... but not this recipe


def test_incomplete_directory_is_not_complete(tmp_path: Path) -> None:
    partial = tmp_path / "m"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    assert not build.is_complete(partial)
    assert os.listdir(partial) == ["config.json"]
