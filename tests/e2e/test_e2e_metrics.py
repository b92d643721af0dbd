"""Every service's issue-17 series on a real sim mesh (scheduler, two sim
engines, a gateway, Envoy; loopback, free ports): after a few requests
through Envoy -- a P0, a P2, two sharing a long prefix, one refused -- all
three kinds of metrics port are scraped and each new family is present, with
a non-zero value where the requests must have moved it."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import aiohttp
import pytest
from _streams import wait_until
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from services.common.config import MeshConfig
from services.launcher.mesh import Mesh
from services.observability.metric_catalogue import exported_metric_names

pytestmark = pytest.mark.e2e

# A system prompt several KV blocks long: the second request with it finds
# the first one's blocks in the engine's prefix cache.
SYSTEM = " ".join(f"Rule {i}: answer briefly and politely, citing the ledger." for i in range(12))


def MESH_TUNE(config: MeshConfig) -> None:  # noqa: N802 - the fixture's hook name
    config.engines.template.report_interval_seconds = 0.2


def _scrape(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _ports(mesh: Mesh) -> dict[str, list[int]]:
    return {
        "gateway": [mesh.config.gateway.metrics_port],
        "scheduler": [mesh.config.scheduler.metrics_port],
        "engine": [mesh.config.engine_config(i).metrics_port for i in range(len(mesh.endpoints.engines))],
    }


def _total(samples: list[Sample], name: str, where: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
    return sum(s.value for s in samples if s.name == name and where(s.labels))


async def _chat(session: aiohttp.ClientSession, mesh: Mesh, priority: int, user: str, key: str = "") -> int:
    body = {"model": mesh.config.engines.template.model, "max_tokens": 24, "stream": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    headers = {"Authorization": f"Bearer {key or mesh.api_key}", "X-Priority": str(priority)}
    async with session.post(f"{mesh.endpoints.public_http}/v1/chat/completions", json=body,
                            headers=headers) as resp:
        await resp.read()
        return resp.status


async def test_every_new_series_is_exported_and_moves(e2e_mesh: Mesh) -> None:
    mesh = e2e_mesh
    async with aiohttp.ClientSession() as session:
        assert await _chat(session, mesh, 0, "What is in the ledger?") == 200
        assert await _chat(session, mesh, 2, "Summarise the ledger.") == 200
        assert await _chat(session, mesh, 1, "Count the ledger lines.") == 200
        assert await _chat(session, mesh, 1, "Who are you?", key="sk-not-a-key") == 401
    ports = _ports(mesh)

    def scrape(service: str) -> list[Sample]:
        return [s for port in ports[service] for s in _scrape(port)]

    # Engines report their prefix-cache figures with their load (every 0.2 s here).
    await wait_until(lambda: max(s.value for s in scrape("scheduler")
                                 if s.name == "kvmesh_scheduler_reported_prefix_hit_rate") > 0,
                     30, "an engine's reported prefix hit rate")
    gateway, scheduler, engine = scrape("gateway"), scrape("scheduler"), scrape("engine")

    catalogue = exported_metric_names()
    for service, samples in (("gateway", gateway), ("scheduler", scheduler), ("engine", engine)):
        unknown = {s.name for s in samples} - catalogue[service]
        assert not unknown, f"{service} exports samples the catalogue lacks: {sorted(unknown)}"

    def cls(name: str) -> Callable[[dict[str, str]], bool]:
        return lambda labels: labels.get("priority") == name

    # Gateway: kvmesh's own, by class and model.
    for priority in ("P0", "P2"):
        for name in ("kvmesh_gateway_e2e_request_latency_seconds_count",
                     "kvmesh_gateway_time_to_first_token_seconds_count",
                     "kvmesh_gateway_inter_token_latency_seconds_count",
                     "kvmesh_gateway_prompt_tokens_total", "kvmesh_gateway_generation_tokens_total"):
            assert _total(gateway, name, cls(priority)) > 0, (name, priority)
    assert _total(gateway, "kvmesh_gateway_rejections_total", lambda lb: lb["reason"] == "invalid_api_key") == 1
    for name in ("kvmesh_gateway_paced_streams", "kvmesh_gateway_heartbeats_total",
                 "kvmesh_gateway_slow_readers_total"):
        assert any(s.name == name for s in gateway), name
    # Gateway: the field's names.
    for name in ("gen_ai_server_time_to_first_token_seconds_count", "gen_ai_server_time_per_output_token_seconds_count",
                 "gen_ai_server_request_duration_seconds_count", "gen_ai_client_operation_duration_seconds_count",
                 "inference_objective_request_total", "inference_objective_request_duration_seconds_count",
                 "inference_objective_input_tokens_sum", "inference_objective_output_tokens_sum"):
        assert _total(gateway, name) >= 3, name
    assert _total(gateway, "gen_ai_client_token_usage_sum", lambda lb: lb["gen_ai_token_type"] == "output") > 0
    assert _total(gateway, "inference_objective_running_requests") == 0

    # Scheduler.
    assert _total(scheduler, "kvmesh_scheduler_decision_seconds_count") >= 3
    assert _total(scheduler, "kvmesh_scheduler_engine_serving") == 2
    assert _total(scheduler, "inference_pool_ready_pods") == 2
    assert _total(scheduler, "kvmesh_scheduler_start_time_seconds") > 0
    assert _total(scheduler, "kvmesh_scheduler_aging_bound_seconds", cls("P2")) > 0
    assert _total(scheduler, "kvmesh_scheduler_queue_length", cls("P0")) == 0  # P0..P2 labels everywhere
    for name in ("kvmesh_scheduler_oldest_wait_seconds", "kvmesh_scheduler_admissions_paused",
                 "inference_pool_average_kv_cache_utilization", "inference_pool_average_queue_size"):
        assert any(s.name == name for s in scheduler), name

    # Engines (sim): vLLM's names from the sim's step loop, and kvmesh's own.
    for name in ("kvmesh_engine_step_seconds_count", "vllm:iteration_tokens_total_sum",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count"):
        assert _total(engine, name) > 0, name
    assert _total(engine, "kvmesh_engine_serving") == 2
    assert _total(engine, "kvmesh_engine_kv_blocks", lambda lb: lb["state"] == "total") > 0
    assert _total(engine, "kvmesh_engine_kv_blocks", lambda lb: lb["state"] == "cached") > 0
    for name in ("vllm:num_preemptions_total", "kvmesh_engine_migrations_out_total"):
        assert any(s.name == name for s in engine), name
