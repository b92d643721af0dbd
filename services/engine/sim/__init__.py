"""The `sim` backend: a simulated GPU behind the real engine service.

Modules, one job each:
- backend.py: `SimBackend`, the EngineBackend -- the step loop task (schedule,
  let the cost model's time pass, apply) and the contract's methods;
- core.py: `SimCore`, the scheduler -- continuous batching, chunked prefill,
  preemption, the sim's own request check (KV capacity); owned by one
  SimBackend, synchronous, on the event loop;
- blocks.py: paged KV blocks and the prefix cache (LRU eviction, KV events);
- cost_model.py: how long a step takes (prefill, decode, context);
- text.py: which token comes next and its text (deterministic per prompt and
  seed);
- structured.py: structured outputs (json_schema, json_object, choice,
  regex) as a documented minimal contract: one deterministic valid instance,
  continued exactly after a migration;
- sink.py: where a request's outputs wait for its reader;
- profiles.py: named cost profiles of real models on real GPUs (YAML under
  config/sim-profiles/) and their calibration check.
The rules every backend shares are checked before the sim sees a request, by
the runtime (services/engine/runtime.py).
"""

from services.engine.sim.backend import SimBackend

__all__ = ["SimBackend"]
