"""Small pieces every part of the Envoy rendering uses: the `@type` key,
Duration and socket-address encodings, and the names of the two gateway
clusters and the batch service's (the routes point at them, the clusters
module defines them).

Every helper returns a fresh object: PyYAML writes an object met twice as an
anchor and alias, so sharing (or not) a dict changes the rendered bytes.
"""

from __future__ import annotations

from typing import Any

__all__ = ['BATCH_CLUSTER', 'GRPC_CLUSTER', 'HTTP_CLUSTER', 'TYPE', 'seconds', 'socket_address']

GRPC_CLUSTER = "gateway_grpc"
HTTP_CLUSTER = "gateway_http"
BATCH_CLUSTER = "batch_http"
TYPE = "@type"


def seconds(value: float) -> str:
    """Protobuf Duration in YAML ("2s", "0.5s")."""
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}
