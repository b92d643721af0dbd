"""The mesh document: its top-level settings (block hashing, run folder,
models, mesh TLS, Envoy) and one field per service section.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .alerts import AlertsConfig
from .batch import BatchConfig
from .deadlines import DeadlinesConfig
from .engines import EngineConfig, EnginesConfig
from .errors import ConfigError
from .gateway import GatewayConfig
from .network import FencingConfig, NetworkConfig
from .responses import ResponsesConfig
from .scheduler import SchedulerConfig
from .tracing import TracingConfig

__all__ = ["TOOL_PARSERS", "EnvoyConfig", "MeshConfig", "MeshTlsConfig", "ModelConfig", "ResumeConfig"]

# Tool-call output formats a model may name in `models[].tool_parser`; the
# services/common/tool_calling/parsers.py implements one parser for each.
TOOL_PARSERS = ("hermes", "json")


@dataclass
class ModelConfig:
    """A model the mesh serves. The gateway loads its tokenizer and chat
    template from `path`; engines load the weights from the same directory."""

    # Name clients put in "model". Required, and unique among `models`.
    name: str = ""
    # Local Hugging Face directory (config.json, tokenizer, weights). Relative
    # paths are relative to the repository root. No hub downloads, ever.
    path: str = ""
    # Longest prompt + completion in tokens; 0 = take it from config.json.
    # Bounds: >= 0.
    max_model_len: int = 0
    # How the model writes a tool call, so the gateway can parse it out of
    # the text (services/common/tool_calling/parsers.py; vLLM's `--tool-call-parser`
    # names): "hermes" = `<tool_call>{"name": ..., "arguments": {...}}
    # </tool_call>` blocks (Qwen2.5, Hermes, and kvmesh's generic tool
    # prompt for templates without tool support, e.g. SmolLM2's); "json" =
    # the bare JSON object `{"name": ..., "arguments": {...}}` or a JSON
    # array of them (the generic prompt then asks for that). One of
    # TOOL_PARSERS. Default hermes: the format most tool-trained open models
    # and vLLM's reference parser use.
    tool_parser: str = "hermes"
    # The model's revision as the response cache keys it (an answer cached
    # for one revision is never served for another). Empty = a hash of the
    # model directory's files (names, sizes, the small files' contents and
    # each weight file's first and last MiB), computed by the gateway at
    # start (services/gateway/response_cache/revision.py). Set it (e.g. the
    # hub commit) when gateways and engines read different copies.
    revision: str = ""


@dataclass
class EnvoyConfig:
    """The edge proxy `kvmesh up` starts in front of the gateways."""

    listen_host: str = "127.0.0.1"
    # Listener and admin ports, 0 .. 65535.
    port: int = 8080
    admin_port: int = 9901
    # Distinct per concurrent Envoy on one machine (shared memory id). >= 0.
    base_id: int = 0
    # Topology YAML rendered by envoy/render.py; relative to the repo root.
    topology: str = "envoy/topology.yaml"


# ---------------------------------------------------------------- mesh TLS


@dataclass
class MeshTlsConfig:
    """Mutual TLS between the mesh's own services: the scheduler,
    engines and gateways serve TLS only and accept only peers holding a
    certificate from the mesh's CA, and each RPC only from the roles that
    need it (`services/common/mesh_tls.py`). Off by default: one machine's
    loopback-only mesh has no network between its services. Turn it on
    before binding any service to an address other machines can reach."""

    enabled: bool = False
    # Folder with ca.pem and <role>.pem + <role>-key.pem for each role
    # (scheduler, gateway, engine, envoy, admin), relative to the repo root.
    # Empty = `kvmesh up` generates a development set in <run_dir>/mesh-tls
    # (its own CA, never the public listener's). Certificates of your own:
    # CN kvmesh-<role>, DNS SAN <role>.kvmesh.internal, both client and
    # server auth -- see the module's docstring.
    cert_dir: str = ""


# ---------------------------------------------------------------- resume


@dataclass
class ResumeConfig:
    """Stream resumption after a gateway is lost (README "Resuming a
    stream"). A generation whose gateway vanished -- its engine call and its
    Admit stream broke without a polite cancel -- is kept DETACHED: the
    engine keeps generating and buffering it, the scheduler keeps its lease
    (capacity stays accounted; fencing still sees it leased there), so a
    client re-sending the request with `Last-Event-ID` through any gateway
    continues it. Read by the engines and the scheduler (one value for both)."""

    # How long a detached generation waits for its client to resume it before
    # it is cancelled (KV freed, lease released); 0 = never detach (cancel at
    # once, as before). Bounds: >= 0. 15 s: a browser's EventSource retries
    # after ~3 s and a client library within a few seconds; a detected
    # partition (keepalive, ~15 s) may then take as long again to resume.
    grace_seconds: float = 15.0


# ---------------------------------------------------------------- mesh


@dataclass
class MeshConfig:
    """The whole mesh: shared settings, then one section per service."""

    # Tokens per block of the shared prefix-hash space. > 0. Engines' block
    # sizes must be multiples of it; 16 matches vLLM's GPU block size.
    hash_block_tokens: int = 16
    # Scratch folder for logs, rendered configs and caches (vLLM's too).
    run_dir: str = ".run"
    models: list[ModelConfig] = field(default_factory=list)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    envoy: EnvoyConfig = field(default_factory=EnvoyConfig)
    mesh_tls: MeshTlsConfig = field(default_factory=MeshTlsConfig)
    # Keepalive of every hop, and lease fencing (network.py).
    network: NetworkConfig = field(default_factory=NetworkConfig)
    fencing: FencingConfig = field(default_factory=FencingConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    deadlines: DeadlinesConfig = field(default_factory=DeadlinesConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    # The Batch API's database and runner (batch.py).
    batch: BatchConfig = field(default_factory=BatchConfig)
    # OpenTelemetry traces (tracing.py); off unless an endpoint is set.
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # Alert thresholds, rendered into the rule files (alerts.py).
    alerts: AlertsConfig = field(default_factory=AlertsConfig)

    def engine_config(self, index: int) -> EngineConfig:
        """Engine `index` as `kvmesh up` starts it: the template with its own
        id and ports."""
        engine = dataclasses.replace(self.engines.template)
        engine.engine_id = f"engine-{index}"
        engine.backend = self.engines.backend
        engine.port = self.engines.base_port + index
        engine.metrics_port = (
            self.engines.metrics_base_port + index if self.engines.metrics_base_port else 0
        )
        engine.http_port = self.engines.http_base_port + index if self.engines.http_base_port else 0
        if not engine.model and self.models:
            engine.model = self.models[0].name
        return engine

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        raise ConfigError(f"models: no model named {name!r}")
