"""Mutual TLS between the mesh's own services, and which role may call what.

With `mesh_tls.enabled`, every service process holds one identity: the mesh's
CA plus a certificate and key for its role. The scheduler, engines and
gateways then serve TLS only (gRPC and HTTP), require a client certificate
from the mesh's CA, and check the caller's role per RPC (`METHOD_ROLES`), so a
process on the network without a mesh certificate cannot place requests,
register an engine or generate on an engine behind the gateway's API keys --
and a mesh certificate of the wrong role cannot either (an engine's key
cannot call Engine.Generate on another engine).

Certificates: role = subject CN `kvmesh-<role>`; each also names
`<role>.kvmesh.internal` (DNS SAN), which clients check as the server's name
(gRPC's `ssl_target_name_override`, Envoy's SNI + SAN match, an ssl
context's `server_hostname`): a gateway dialing an engine knows it reached an
engine, wherever that engine's address points. Certificates need both server
and client auth: every service is both. `kvmesh up` generates a development
set (`services/tools/devcerts.py`, `ensure_mesh_certs`) unless
`mesh_tls.cert_dir` names a folder of your own with the same file names.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.config import ConfigError, MeshConfig
from services.common.grpc_guard import WrappingInterceptor, rebuild_handler

__all__ = [
    "DOMAIN",
    "METHOD_ROLES",
    "ROLES",
    "MeshIdentity",
    "RequirePeerRoles",
    "aio_channel",
    "identity_for",
    "mesh_cert_dir",
    "peer_role",
    "server_name",
]

ROLES = ("scheduler", "gateway", "engine", "envoy", "admin")
DOMAIN = "kvmesh.internal"
_CN_PREFIX = "kvmesh-"
REPO_ROOT = Path(__file__).resolve().parents[2]

# Who may call each RPC. Methods not listed (grpc.health, reflection) are open
# to every role of the mesh; callers without a mesh certificate never get
# past the TLS handshake. `admin` is an operator's tool (launcher probes,
# grpcurl debugging): it may read state and abort, not generate on an engine
# behind the gateway's keys and limits.
METHOD_ROLES: dict[str, frozenset[str]] = {
    "/kvmesh.v1.Scheduler/Admit": frozenset({"gateway"}),
    "/kvmesh.v1.Scheduler/AdmitMany": frozenset({"gateway"}),
    "/kvmesh.v1.Scheduler/Connect": frozenset({"engine"}),
    "/kvmesh.v1.Scheduler/GetState": frozenset({"gateway", "admin"}),
    "/kvmesh.v1.Scheduler/WatchQueueHeads": frozenset({"scheduler", "admin"}),
    # The operator's knobs; the admin token applies on top.
    **{f"/kvmesh.v1.Admin/{m}": frozenset({"admin"}) for m in (
        "DrainEngine", "UndrainEngine", "PauseClass", "ResumeClass", "SetPlacementPolicy", "GetAdminState")},
    "/kvmesh.v1.Engine/Generate": frozenset({"gateway"}),
    "/kvmesh.v1.Engine/GenerateMany": frozenset({"gateway"}),
    "/kvmesh.v1.Engine/Abort": frozenset({"gateway", "admin"}),
    "/kvmesh.v1.Engine/GetInfo": frozenset({"gateway", "scheduler", "admin"}),
    # The public API, behind Envoy; API keys still apply on top.
    "/kvmesh.v1.Inference/Chat": frozenset({"envoy", "admin"}),
    "/kvmesh.v1.Inference/Generate": frozenset({"envoy", "admin"}),
    "/kvmesh.v1.Inference/ListModels": frozenset({"envoy", "admin"}),
    "/kvmesh.v1.Inference/Tokenize": frozenset({"envoy", "admin"}),
    "/kvmesh.v1.Inference/Detokenize": frozenset({"envoy", "admin"}),
}


def server_name(role: str) -> str:
    """The DNS name a `role` certificate carries and clients verify."""
    return f"{role}.{DOMAIN}"


def common_name(role: str) -> str:
    return f"{_CN_PREFIX}{role}"


def mesh_cert_dir(config: MeshConfig) -> Path:
    """Where the mesh's certificates are: `mesh_tls.cert_dir`, or the
    development set under run_dir."""
    folder = Path(config.mesh_tls.cert_dir or Path(config.run_dir) / "mesh-tls")
    return folder if folder.is_absolute() else REPO_ROOT / folder


@dataclass(frozen=True)
class MeshIdentity:
    """One process's side of mutual TLS: the CA it trusts, its certificate
    and key, and the role they prove."""

    role: str
    ca_file: Path
    cert_file: Path
    key_file: Path

    @classmethod
    def load(cls, folder: Path, role: str) -> MeshIdentity:
        if role not in ROLES:
            raise ConfigError(f"mesh_tls: unknown role {role!r} (one of {', '.join(ROLES)})")
        identity = cls(role, folder / "ca.pem", folder / f"{role}.pem", folder / f"{role}-key.pem")
        missing = [str(p) for p in (identity.ca_file, identity.cert_file, identity.key_file) if not p.is_file()]
        if missing:
            raise ConfigError(f"mesh_tls.cert_dir: missing {', '.join(missing)}")
        return identity

    # ---- gRPC

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_file.read_bytes(), self.cert_file.read_bytes())],
            root_certificates=self.ca_file.read_bytes(),
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes(),
            private_key=self.key_file.read_bytes(),
            certificate_chain=self.cert_file.read_bytes(),
        )

    # ---- HTTP (aiohttp servers and clients)

    def server_ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca_file))
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context

    def client_ssl_context(self) -> ssl.SSLContext:
        """Verifies the server against the mesh CA; pass the server's
        `server_name(role)` as the connection's server_hostname."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.ca_file))
        context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context


def identity_for(config: MeshConfig, role: str) -> MeshIdentity | None:
    """This process's identity, or None when mesh TLS is off."""
    if not config.mesh_tls.enabled:
        return None
    return MeshIdentity.load(mesh_cert_dir(config), role)


def add_port(server: grpc.aio.Server, address: str, identity: MeshIdentity | None) -> int:
    """Bind `address`: TLS with client certificates when `identity` is set."""
    if identity is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, identity.server_credentials())


def aio_channel(
    address: str, identity: MeshIdentity | None, server_role: str, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A channel to a mesh service of `server_role`: plaintext when mesh TLS
    is off, else mutual TLS that also checks the server's role."""
    if identity is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, identity.channel_credentials(), _tls_options(options, server_role))


def sync_channel(
    address: str, identity: MeshIdentity | None, server_role: str, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """`aio_channel` for blocking callers (the launcher's probes)."""
    if identity is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, identity.channel_credentials(), _tls_options(options, server_role))


def _tls_options(options: Sequence[tuple[str, Any]], server_role: str) -> list[tuple[str, Any]]:
    # The server must prove `server_role`, whatever its address resolves to.
    return [*options, ("grpc.ssl_target_name_override", server_name(server_role))]


# ---------------------------------------------------------------- server side


def peer_role(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's mesh role from its verified certificate; None without one."""
    names = context.auth_context().get("x509_common_name") or []
    for raw in names:
        name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        if name.startswith(_CN_PREFIX) and name[len(_CN_PREFIX):] in ROLES:
            return name[len(_CN_PREFIX):]
    return None


def _with_roles(handler: grpc.RpcMethodHandler, allowed: frozenset[str], method: str) -> grpc.RpcMethodHandler:
    """`handler` behind a check of the caller's role."""

    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        role = peer_role(context)
        if role not in allowed:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method} is for {', '.join(sorted(allowed))} certificates; the caller's is "
                f"{role or 'not a kvmesh role'}",
            )
        return request

    return rebuild_handler(handler, check, handler.request_deserializer)


class RequirePeerRoles(WrappingInterceptor):
    """Aborts calls from roles `METHOD_ROLES` does not allow (PERMISSION_DENIED).
    Installed by `make_server` on TLS servers only."""

    def __init__(self, roles: dict[str, frozenset[str]] | None = None) -> None:
        super().__init__()
        self._roles = METHOD_ROLES if roles is None else roles

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        allowed = self._roles.get(method)
        return handler if allowed is None else _with_roles(handler, allowed, method)
