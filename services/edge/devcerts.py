"""Development TLS certificates for Envoy's public listener.

    python -m services.edge.devcerts [--out .run/tls]

Writes a local CA (ca.pem, ca-key.pem) and a server certificate signed by it
(server.pem, server-key.pem) for localhost, 127.0.0.1 and ::1. Clients trust
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

__all__ = ["DEFAULT_DIR", "DevCerts", "ensure_dev_certs", "main"]

# Relative to the repository root: under the default run_dir, gitignored.
DEFAULT_DIR = ".run/tls"
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


def _still_valid(certs: DevCerts) -> bool:
    try:
        ca = x509.load_pem_x509_certificate(certs.ca.read_bytes())
        server = x509.load_pem_x509_certificate(certs.cert_chain.read_bytes())
        certs.private_key.read_bytes()
    except (OSError, ValueError):
        return False
    soon = datetime.datetime.now(datetime.UTC) + _RENEW_BEFORE
    return ca.not_valid_after_utc > soon and server.not_valid_after_utc > soon and server.issuer == ca.subject


def _write_private(path: Path, data: bytes) -> None:
    """Key files readable by their owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def ensure_dev_certs(folder: str | Path) -> DevCerts:
    """The dev CA and server certificate in `folder`, created when missing,
    broken or about to expire."""
    folder = Path(folder)
    certs = _files(folder)
    if _still_valid(certs):
        return certs
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=_VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvmesh development CA")])
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
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in _NAMES]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in _IPS]
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write_private(folder / "ca-key.pem", _key_pem(ca_key))
    certs.ca.write_bytes(ca.public_bytes(pem))
    _write_private(certs.private_key, _key_pem(key))
    # The chain Envoy serves: the server certificate, then the CA.
    certs.cert_chain.write_bytes(server.public_bytes(pem) + ca.public_bytes(pem))
    return certs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.edge.devcerts", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_DIR, help=f"folder (default {DEFAULT_DIR})")
    ns = parser.parse_args(argv)
    certs = ensure_dev_certs(ns.out)
    print(f"dev CA {certs.ca}; server certificate {certs.cert_chain}, key {certs.private_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
