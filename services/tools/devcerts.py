"""Development TLS certificates: Envoy's public listener, and the mesh's own
services when `mesh_tls` is on.

    python -m services.tools.devcerts [--out .run/tls]
    python -m services.tools.devcerts --mesh [--out .run/mesh-tls]

Public listener: a local CA (ca.pem, ca-key.pem) and a server certificate
signed by it (server.pem, server-key.pem) for localhost, 127.0.0.1 and ::1.
Mesh (`ensure_mesh_certs`): a second, separate CA and one certificate per
role of `services/common/mesh_tls.py` (<role>.pem, <role>-key.pem), client
and server auth, CN kvmesh-<role>, DNS <role>.kvmesh.internal. Clients trust
ca.pem explicitly (grpc `root_certificates`, curl `--cacert`, an ssl context's
`cafile`); nothing is installed system-wide. Existing files are kept while
they are valid for at least another day, so a running client keeps trusting
the same CA across `kvmesh up` restarts.

For one machine only: the CA key lies next to the certificates, unencrypted.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.mesh_tls import ROLES, common_name, server_name

__all__ = ["DEFAULT_DIR", "DevCerts", "ensure_dev_certs", "ensure_mesh_certs", "main"]

# Relative to the repository root: under the default run_dir, gitignored.
DEFAULT_DIR = ".run/tls"
MESH_DIR = ".run/mesh-tls"
_NAMES = ("localhost",)
_IPS = ("127.0.0.1", "::1")
# Short enough that a leaked dev CA soon stops mattering.
_VALID_DAYS = 90
_RENEW_BEFORE = datetime.timedelta(days=1)


@dataclass(frozen=True)
class DevCerts:
    ca: Path
    cert_chain: Path
    private_key: Path


def _files(folder: Path) -> DevCerts:
    return DevCerts(folder / "ca.pem", folder / "server.pem", folder / "server-key.pem")


def _still_valid(ca_file: Path, leaves: list[tuple[Path, Path]]) -> bool:
    """The CA and every (certificate, key) pair readable, issued by that CA,
    and valid for at least `_RENEW_BEFORE` more."""
    try:
        ca = x509.load_pem_x509_certificate(ca_file.read_bytes())
        certs = [x509.load_pem_x509_certificate(cert.read_bytes()) for cert, _ in leaves]
        for _, key in leaves:
            key.read_bytes()
    except (OSError, ValueError):
        return False
    soon = datetime.datetime.now(datetime.UTC) + _RENEW_BEFORE
    return ca.not_valid_after_utc > soon and all(
        cert.not_valid_after_utc > soon and cert.issuer == ca.subject for cert in certs
    )


def _write_private(path: Path, data: bytes) -> None:
    """Key files readable by their owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _new_ca(name: str, until: datetime.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca


def _issue(
    ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, common_name: str,
    sans: list[x509.GeneralName], usages: list[x509.ObjectIdentifier], until: datetime.datetime,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def ensure_dev_certs(folder: str | Path) -> DevCerts:
    """The dev CA and server certificate in `folder`, created when missing,
    broken or about to expire."""
    folder = Path(folder)
    certs = _files(folder)
    if _still_valid(certs.ca, [(certs.cert_chain, certs.private_key)]):
        return certs
    folder.mkdir(parents=True, exist_ok=True)
    until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=_VALID_DAYS)
    ca_key, ca = _new_ca("kvmesh development CA", until)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in _NAMES]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in _IPS]
    key, server = _issue(ca_key, ca, "localhost", sans, [ExtendedKeyUsageOID.SERVER_AUTH], until)
    pem = serialization.Encoding.PEM
    _write_private(folder / "ca-key.pem", _key_pem(ca_key))
    certs.ca.write_bytes(ca.public_bytes(pem))
    _write_private(certs.private_key, _key_pem(key))
    # The chain Envoy serves: the server certificate, then the CA.
    certs.cert_chain.write_bytes(server.public_bytes(pem) + ca.public_bytes(pem))
    return certs


def ensure_mesh_certs(folder: str | Path) -> Path:
    """The mesh's dev CA and one certificate per role in `folder`, created
    when missing, broken or about to expire. Returns the folder."""
    folder = Path(folder)
    if _still_valid(folder / "ca.pem", [(folder / f"{r}.pem", folder / f"{r}-key.pem") for r in ROLES]):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    until = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=_VALID_DAYS)
    ca_key, ca = _new_ca("kvmesh development mesh CA", until)
    pem = serialization.Encoding.PEM
    _write_private(folder / "ca-key.pem", _key_pem(ca_key))
    (folder / "ca.pem").write_bytes(ca.public_bytes(pem))
    for role in ROLES:
        key, cert = _issue(
            ca_key, ca, common_name(role), [x509.DNSName(server_name(role))],
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], until,
        )
        _write_private(folder / f"{role}-key.pem", _key_pem(key))
        (folder / f"{role}.pem").write_bytes(cert.public_bytes(pem))
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.tools.devcerts", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help=f"folder (default {DEFAULT_DIR}, with --mesh {MESH_DIR})")
    parser.add_argument("--mesh", action="store_true", help="the mesh's CA and per-role certificates instead")
    ns = parser.parse_args(argv)
    if ns.mesh:
        folder = ensure_mesh_certs(ns.out or MESH_DIR)
        print(f"mesh CA {folder / 'ca.pem'}; certificates for {', '.join(ROLES)} in {folder}")
        return 0
    certs = ensure_dev_certs(ns.out or DEFAULT_DIR)
    print(f"dev CA {certs.ca}; server certificate {certs.cert_chain}, key {certs.private_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
