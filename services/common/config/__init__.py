"""All of kvmesh's configuration: typed dataclasses, loaded from one YAML file.

The mesh config is one document; `kvmesh up` hands the same file to every
child process, and each service reads its own section. Every field says its
default, its bounds and why, where it is declared:

    mesh.py         the document (MeshConfig), models, mesh TLS, Envoy
    deadlines.py    deadlines learned from live p95 latency (queue wait, stall, generation)
    network.py      keepalive of every hop, lease fencing (silent partitions)
    engines.py      engines: the template engine, its simulator and vLLM
    scheduler.py    scheduler: aging, admission limits, placement, queues
    spares.py       scheduler.spares: warm spares per model, promotion and return
    peers.py        scheduler.peers: the other scheduler replicas, priority across them
    scaling.py      scheduler.scaling: the engines each model needs (autoscaling)
    gateway.py      gateway and its API keys
    response_cache.py  the gateway's response cache (embedded or Redis)
    responses.py    the Responses API's store (TTL, size bounds)
    batch.py        the Batch API: its database, file size bound, runner
    tracing.py      OpenTelemetry traces: OTLP endpoint, sampling
    alerts.py       alert thresholds (rendered into the rule files, read by no service)
    errors.py       ConfigError
    addresses.py    host:port addresses (DNS names, IPv4, [IPv6]): split and join
    loader.py       load_config: YAML -> dataclasses (type phase), then
    validation.py   validate_config: bounds and cross-setting rules (bounds phase)

Loading runs both phases once; unknown keys are errors, and every error
names the full setting path ("scheduler.aging.p2_seconds") so a mistyped
setting can never be silently ignored. After load, components trust their
config and check none of it again. They check only what the config cannot
know, at start-up: plugin and policy names, known only to the scheduler's
registries when it builds its policies, and files on disk (tokenizer files,
mesh TLS certificates, sim profiles). A config built in code (tests) skips
the bounds phase unless it calls `validate_config`.
"""

from __future__ import annotations

from .alerts import AlertsConfig
from .batch import BatchConfig
from .deadlines import DeadlineBounds, DeadlinesConfig
from .engines import EngineConfig, EnginesConfig, SimCostConfig, VllmConfig
from .errors import ConfigError
from .gateway import ApiKeyConfig, GatewayConfig
from .loader import config_from_dict, load_config
from .mesh import TOOL_PARSERS, EnvoyConfig, MeshConfig, MeshTlsConfig, ModelConfig
from .network import FencingConfig, NetworkConfig
from .peers import PeersConfig
from .response_cache import ResponseCacheConfig
from .responses import ResponsesConfig
from .scaling import ScalingConfig
from .scheduler import AdminKeyConfig, AgingConfig, PolicyProfileConfig, SchedulerConfig
from .spares import SparesConfig
from .tracing import TracingConfig
from .validation import api_key_digest, validate_config

__all__ = [
    "TOOL_PARSERS",
    "AdminKeyConfig",
    "AgingConfig",
    "AlertsConfig",
    "ApiKeyConfig",
    "BatchConfig",
    "ConfigError",
    "DeadlineBounds",
    "DeadlinesConfig",
    "EngineConfig",
    "EnginesConfig",
    "EnvoyConfig",
    "FencingConfig",
    "GatewayConfig",
    "MeshConfig",
    "MeshTlsConfig",
    "ModelConfig",
    "NetworkConfig",
    "PeersConfig",
    "PolicyProfileConfig",
    "ResponseCacheConfig",
    "ResponsesConfig",
    "ScalingConfig",
    "SchedulerConfig",
    "SimCostConfig",
    "SparesConfig",
    "TracingConfig",
    "VllmConfig",
    "api_key_digest",
    "config_from_dict",
    "load_config",
    "validate_config",
]
