"""Mesh TLS set-up: development certificates as the roles need them, and
clear errors for a missing file. (Handshakes and role checks over real
sockets: tests/e2e/test_e2e_mesh_tls.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.config import ConfigError, MeshConfig
from services.common.mesh_tls import METHOD_ROLES, ROLES, MeshIdentity, identity_for, server_name
from services.common.proto.kvmesh.v1 import admin_pb2, engine_pb2, inference_pb2, scheduler_pb2
from services.tools.devcerts import ensure_mesh_certs


def test_dev_certificates_name_their_role_and_serve_both_ways(tmp_path: Path) -> None:
    folder = ensure_mesh_certs(tmp_path)
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    for role in ROLES:
        cert = x509.load_pem_x509_certificate((folder / f"{role}.pem").read_bytes())
        assert cert.issuer == ca.subject
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"kvmesh-{role}"
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == [server_name(role)]
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
        assert (folder / f"{role}-key.pem").stat().st_mode & 0o077 == 0  # owner-only keys


def test_dev_certificates_are_kept_while_valid(tmp_path: Path) -> None:
    first = (ensure_mesh_certs(tmp_path) / "ca.pem").read_bytes()
    assert (ensure_mesh_certs(tmp_path) / "ca.pem").read_bytes() == first
    (tmp_path / "engine-key.pem").unlink()  # broken set: made anew
    assert (ensure_mesh_certs(tmp_path) / "ca.pem").read_bytes() != first


def test_identity_errors_name_the_missing_file(tmp_path: Path) -> None:
    ensure_mesh_certs(tmp_path)
    (tmp_path / "gateway.pem").unlink()
    with pytest.raises(ConfigError, match=r"gateway.pem"):
        MeshIdentity.load(tmp_path, "gateway")
    with pytest.raises(ConfigError, match="unknown role"):
        MeshIdentity.load(tmp_path, "root")


def test_off_by_default_and_every_rpc_has_its_roles() -> None:
    assert identity_for(MeshConfig(), "gateway") is None
    assert all(roles and roles <= set(ROLES) for roles in METHOD_ROLES.values())
    # A new RPC must say who may call it, or any mesh certificate could.
    methods = {
        f"/{service.full_name}/{method.name}"
        for module in (admin_pb2, engine_pb2, inference_pb2, scheduler_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert methods == set(METHOD_ROLES)
