"""The gateway and an engine's own OpenAI endpoint send the engine the same
prompt token ids for the same chat, whatever the model's chat template.

Peer routers are benchmarked over the engines' HTTP endpoints while kvmesh
goes through its gateway: if the two tokenized chats differently, the two
would not run the same prompts. Both front doors are driven through their
real HTTP handlers: the gateway's tokenized prompt is what reaches the
(fake) engine on the Generate stream; the engine's is what its runtime is
asked to run, and what its /render endpoint returns.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import KEY_FULL, MODEL, ROOT, Mesh

from services.common.config import EngineConfig, MeshConfig, ModelConfig
from services.engine.backend import GenerationRequest
from services.engine.runtime import Generation
from services.engine.server import EngineService

SMOLLM2 = ROOT / ".models" / "SmolLM2-135M-Instruct"
TINY_LLAMA = ROOT / ".models" / "tiny-llama"

# Templates with what Hugging Face templates use and a template engine might
# get wrong: specials as variables, tojson of non-ASCII text, a default system
# prompt, {% break %}/{% continue %}, strftime_now, raise_exception.
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LIST_DEFAULT = ("{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content | tojson }}\n"
                 "{% endfor %}{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
_JINJA_FILE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content | trim + '<|im_end|>' }}\n"
               "{% endfor %}{{ '<|im_start|>assistant\n' }}")
_LOOPCONTROLS = (
    "Date: {{ strftime_now('%Y-%m') }}\n"
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n{% endfor %}<|im_start|>assistant\n"
)
_SYSTEM_DEFAULT = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are kvmesh's test assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# name -> (tokenizer_config.json overrides, chat_template.jinja text or None)
VARIANTS: dict[str, tuple[dict[str, Any], str | None]] = {
    "list-form": ({"chat_template": [{"name": "tool_use", "template": "TOOLS {{ messages }}"},
                                     {"name": "default", "template": _LIST_DEFAULT}]}, None),
    "jinja-file": ({"chat_template": "IGNORED {{ messages }}"}, _JINJA_FILE),
    "loopcontrols-strftime": ({"chat_template": _LOOPCONTROLS}, None),
    "system-default": ({"chat_template": _SYSTEM_DEFAULT}, None),
    "chatml-no-file": ({"chat_template": _CHATML}, None),
}

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "héllo — ünïcode ✓ 日本語  "},
     {"role": "assistant", "content": "Hi."},
     {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]},
     {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "and\nnew lines\t tabs"}],
]


def _variant(directory: Path, name: str) -> Path:
    overrides, template_file = VARIANTS[name]
    directory.mkdir()
    for file in ("tokenizer.json", "config.json"):
        (directory / file).symlink_to(SMOLLM2 / file)
    config = json.loads((SMOLLM2 / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, **overrides}))
    if template_file is not None:
        (directory / "chat_template.jinja").write_text(template_file)
    return directory


@pytest.fixture(params=["SmolLM2-135M-Instruct", "tiny-llama", *VARIANTS])
def model_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Overrides conftest's: the gateway mesh serves this model as MODEL."""
    if not (SMOLLM2 / "tokenizer.json").is_file():
        pytest.skip("the local models are not built (.models/)")
    if request.param == "SmolLM2-135M-Instruct":
        return SMOLLM2
    if request.param == "tiny-llama":
        return TINY_LLAMA
    return _variant(tmp_path / request.param, request.param)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


Engine = tuple[str, list[GenerationRequest]]


@pytest.fixture
async def engine(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Engine]:
    """A sim engine serving the same model directory on its own HTTP port;
    yields its base URL and the requests its runtime was asked to run."""
    config = EngineConfig(port=0, scheduler_address="", total_blocks=512, max_running=8,
                          stop_grace_seconds=0.0, http_port=_free_port(), model=MODEL)
    config.sim.speed_factor = 0.0
    svc = EngineService(MeshConfig(models=[ModelConfig(name=MODEL, path=str(model_dir))]), config)
    opened: list[GenerationRequest] = []
    open_generation = svc.runtime.open

    def recording_open(request: GenerationRequest) -> Generation:
        opened.append(request)
        return open_generation(request)

    monkeypatch.setattr(svc.runtime, "open", recording_open)  # spy on what the endpoint runs
    await svc.start()
    try:
        yield f"http://127.0.0.1:{config.http_port}", opened
    finally:
        await svc.stop()


async def _gateway_prompt(session: aiohttp.ClientSession, mesh: Mesh, messages: list[dict[str, Any]]) -> list[int]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY_FULL}"}
    async with session.post(f"{mesh.http}/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
    return list(mesh.engines["engine-a"].requests[-1].prompt_token_ids)


async def _engine_prompts(session: aiohttp.ClientSession, base: str, opened: list[GenerationRequest],
                          messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    async with session.post(f"{base}/v1/chat/completions/render", json=body) as resp:
        assert resp.status == 200, await resp.text()
        rendered = (await resp.json())["token_ids"]
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["usage"]["prompt_tokens"] == len(rendered)
    return rendered, list(opened[-1].prompt_token_ids)


async def test_gateway_and_engine_send_identical_prompt_ids(
    mesh: Mesh, engine: Engine
) -> None:
    base, opened = engine
    async with aiohttp.ClientSession() as session:
        for messages in CHATS:
            via_gateway = await _gateway_prompt(session, mesh, messages)
            rendered, via_engine = await _engine_prompts(session, base, opened, messages)
            assert len(via_gateway) > 5
            # Byte-identical: the same ids in the same order, as 32-bit words on the wire.
            as_bytes = [b"".join(t.to_bytes(4, "little") for t in ids) for ids in (via_gateway, via_engine, rendered)]
            assert as_bytes[0] == as_bytes[1] == as_bytes[2]


@pytest.mark.parametrize("model_dir", ["loopcontrols-strftime"], indirect=True)
async def test_template_errors_are_the_same_400_at_both_doors(
    mesh: Mesh, engine: Engine
) -> None:
    base, _ = engine
    body = {"model": MODEL, "messages": [{"role": "developer", "content": "x"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {KEY_FULL}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{mesh.http}/v1/chat/completions", json=body, headers=headers) as resp:
            gateway = (resp.status, (await resp.json())["error"])
        async with session.post(f"{base}/v1/chat/completions/render", json=body) as resp:
            engine_side = (resp.status, (await resp.json())["error"])
    assert gateway == engine_side
    assert gateway[0] == 400 and "bad role" in gateway[1]["message"] and gateway[1]["param"] == "messages"
