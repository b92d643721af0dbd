"""Placements of the other scheduler replicas (LoadReport.placed_elsewhere,
README "Several schedulers"): an engine tells each replica the prompts the
others placed on it, and the replica's policy remembers them as its own
placements -- in-flight prefixes and live working set -- so a burst sharing a
new prefix, split across replicas by request id, still lands on the engine
the first placement made warm, as with one scheduler."""

from __future__ import annotations

from typing import Any

from services.scheduler.core import SchedulerCore
from services.scheduler.engine_registry import EngineLoad
from services.scheduler.events import LoadReported

from .helpers import add_engine, admit, make_core, opts

# A 2,000-token prompt: 125 blocks of 16 tokens, none reported cached anywhere yet.
PREFIX = tuple(range(1, 126))
SPEEDS: dict[str, Any] = dict(prefill_tokens_per_second=4000.0, step_seconds=0.04)


def _fleet() -> tuple[SchedulerCore, int]:
    core, _ = make_core(policy="predicted_ttft")
    add_engine(core, "e0", **SPEEDS)
    return core, add_engine(core, "e1", **SPEEDS)


def _report(core: SchedulerCore, engine_id: str, token: int, placed: list[tuple[int, ...]]) -> None:
    """e1 runs another replica's generation of the prompt: its 2,000 tokens
    queued for prefill, its KV events not in yet."""
    load = EngineLoad(serving=True, blocks_total=1000, queued_tokens=2000, **SPEEDS)
    core.handle(LoadReported(engine_id, token, load, placed))


def _request(rid: str) -> Any:
    return opts(rid, prompt_tokens=2000, prefix_hashes=PREFIX)


def test_a_prompt_another_replica_placed_counts_as_placed_here() -> None:
    core, token = _fleet()
    _report(core, "e1", token, [PREFIX])
    admit(core, _request("r1"))
    # Warm by the overlay (0.54 s predicted, the other's prefill ahead of it)
    # against e0 cold (0.54 s, a second copy of the prompt): e1, as one scheduler would.
    assert core.lease_holder("r1") == "e1"
    assert core.policy.live is not None
    assert core.policy.live.live_hashes(["e0", "e1"]) == {"e0": 0, "e1": len(PREFIX)}


def test_without_it_the_burst_pays_a_second_cold_prefill() -> None:
    core, token = _fleet()
    _report(core, "e1", token, [])
    admit(core, _request("r1"))
    assert core.lease_holder("r1") == "e0"


def test_a_stale_registrations_report_is_not_remembered() -> None:
    core, token = _fleet()
    _report(core, "e1", token + 100, [PREFIX])
    assert core.policy.live is not None
    assert core.policy.live.live_hashes(["e1"]) == {"e1": 0}
