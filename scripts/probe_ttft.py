"""Where a mesh's time to first token goes: the same kind of request, one at
a time, at three points of one running mesh.

    .venv/bin/python scripts/probe_ttft.py [--backend vllm] [--requests 40]
    .venv/bin/python scripts/probe_ttft.py --backend sim --context-words 1500 --chat

  engine       Engine.Generate over gRPC, token ids in (no gateway, no scheduler)
  engine-http  the engine's own OpenAI endpoint (what sglang-router and
               vllm-router talk to; the engine tokenizes)
  gateway      POST straight to the gateway (tokenize, auth, Admit round trip
               to the scheduler, the engine's gRPC hop)
  envoy        the same through Envoy, as clients see it

Requests alternate between the points, so the machine's drift hits all alike;
each asks for 4 tokens. By default every prompt is a distinct 100-word text
(no prefix-cache help); `--context-words N` puts one shared N-word context in
front of a short distinct question instead (the shared-prefix case of
BENCHMARKS.md's router comparison: the context is cached, the path's cost per
prompt token shows). `--chat` sends the context as a system message to
/v1/chat/completions. Prints TTFT p50 / mean per point and the differences.
This is how BENCHMARKS.md's comparison of kvmesh with vLLM's own server found
Envoy's threads waiting behind vLLM's polling core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.config import load_config
from services.common.proto.kvmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from services.launcher.mesh import Mesh, MeshOptions

_WORDS = "river stone cloud lantern orbit maple copper violet harbor quartz".split()
_MAX_TOKENS = 4


@dataclass(frozen=True)
class Prompts:
    """The probe's prompts: a shared context (may be empty) + a distinct part."""

    context: str
    chat: bool

    def question(self, seed: int) -> str:
        rng = random.Random(seed)
        words = 12 if self.context else 100
        return f"{seed} " + " ".join(rng.choice(_WORDS) for _ in range(words))

    def text(self, seed: int) -> str:
        """As one completion prompt (what the engine's gRPC point is given)."""
        return f"{self.context}\n{self.question(seed)}" if self.context else self.question(seed)

    def body(self, model: str, seed: int) -> tuple[str, dict[str, object]]:
        common = {"model": model, "max_tokens": _MAX_TOKENS, "stream": True, "temperature": 0, "ignore_eos": True}
        if not self.chat:
            return "/v1/completions", {**common, "prompt": self.text(seed)}
        messages = [{"role": "user", "content": self.question(seed)}]
        if self.context:
            messages.insert(0, {"role": "system", "content": self.context})
        return "/v1/chat/completions", {**common, "messages": messages}


def shared_context(words: int) -> str:
    rng = random.Random(7)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def http_ttft(session: aiohttp.ClientSession, base_url: str, key: str, model: str, prompts: Prompts,
                    seed: int) -> float:
    path, body = prompts.body(model, seed)
    began = time.perf_counter()
    async with session.post(f"{base_url}{path}", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{base_url}: HTTP {resp.status}: {await resp.text()}")
        ttft = None
        # Read to the end: a stream left early resets the connection, and the
        # next request would pay for a new one (Envoy's to the gateway too).
        async for line in resp.content:
            if ttft is None and line.startswith(b"data:") and _has_text(line):
                ttft = time.perf_counter() - began
    if ttft is None:
        raise RuntimeError(f"{base_url}: no token arrived")
    return ttft


def _has_text(line: bytes) -> bool:
    """An SSE line carrying generated text (completions' `text`, chat's `content`)."""
    payload = line[len(b"data:"):].strip()
    if not payload.startswith(b"{"):
        return False
    for choice in json.loads(payload).get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def engine_ttft(stub: engine_pb2_grpc.EngineStub, ids: list[int]) -> float:
    request = engine_pb2.EngineRequest(
        request_id=f"probe-{uuid.uuid4().hex}", prompt_token_ids=ids, priority=1,
        sampling=common_pb2.SamplingParams(max_tokens=_MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    began = time.perf_counter()
    call = stub.Generate()
    await call.write(engine_pb2.EngineGenerateMessage(request=request))
    ttft = None
    async for event in call:
        if ttft is None and event.HasField("delta") and event.delta.token_ids:
            ttft = time.perf_counter() - began
        if event.HasField("finished"):
            break
    await call.done_writing()
    if ttft is None:
        raise RuntimeError("the engine sent no token")
    return ttft


async def probe(mesh: Mesh, model: str, tokenizer: Tokenizer, prompts: Prompts,
                n: int) -> dict[str, list[float]]:
    ep = mesh.endpoints
    engine_http = mesh.config.engine_config(0).http_port
    samples: dict[str, list[float]] = {"engine": [], "engine-http": [], "gateway": [], "envoy": []}
    connector = aiohttp.TCPConnector(keepalive_timeout=4)
    async with aiohttp.ClientSession(connector=connector) as session, \
            grpc.aio.insecure_channel(ep.engines[0]) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for i in range(-2, n):  # two warm-up rounds, not counted
            got = {
                "engine": await engine_ttft(stub, tokenizer.encode(prompts.text(10_000 + i)).ids),
                "engine-http": await http_ttft(session, f"http://127.0.0.1:{engine_http}", mesh.api_key, model,
                                               prompts, 15_000 + i),
                "gateway": await http_ttft(session, ep.gateway_http[0], mesh.api_key, model, prompts, 20_000 + i),
                "envoy": await http_ttft(session, ep.public_http, mesh.api_key, model, prompts, 30_000 + i),
            }
            if i >= 0:
                for point, value in got.items():
                    samples[point].append(value)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["vllm", "sim"], default="vllm")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--requests", type=int, default=40, help="requests per point")
    parser.add_argument("--context-words", type=int, default=0,
                        help="one shared context of this many words before each short question (0: none)")
    parser.add_argument("--chat", action="store_true", help="/v1/chat/completions, the context as a system message")
    ns = parser.parse_args()
    config = load_config(ROOT / "config" / "kvmesh.yaml")
    config.engines.template.vllm.kv_cache_gib = 0.25
    config.engines.http_base_port = 1      # non-zero = on; the launcher picks free ports
    prompts = Prompts(shared_context(ns.context_words), ns.chat)
    model_dir = Path(config.model(ns.model).path)
    tokenizer = Tokenizer.from_file(str((model_dir if model_dir.is_absolute() else ROOT / model_dir)
                                        / "tokenizer.json"))
    scratch_parent = ROOT / ".run" if (ROOT / ".run").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="probe-ttft-", dir=scratch_parent) as tmp:
        mesh = Mesh(config, MeshOptions(engines=1, backend=ns.backend, model=ns.model, free_ports=True,
                                        run_dir=Path(tmp)))
        mesh.start()
        try:
            samples = asyncio.run(probe(mesh, ns.model, tokenizer, prompts, ns.requests))
        finally:
            mesh.stop_all()
    p50 = {point: 1000 * statistics.median(xs) for point, xs in samples.items()}
    for point, xs in samples.items():
        print(f"{point:12s} TTFT p50 {p50[point]:6.2f} ms  mean {1000 * statistics.mean(xs):6.2f} ms  (n={len(xs)})")
    print(f"the engine's HTTP endpoint adds {p50['engine-http'] - p50['engine']:+.2f} ms to its gRPC; "
          f"gateway + scheduler add {p50['gateway'] - p50['engine']:+.2f} ms, Envoy adds "
          f"{p50['envoy'] - p50['gateway']:+.2f} ms (p50)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
