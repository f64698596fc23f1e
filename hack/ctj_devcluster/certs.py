"""The cluster's PKI: one CA, serving certificates, client certificates, the SA key pair.

Kubernetes authenticates every component by a client certificate whose CN is the user and
whose O fields are the groups (``system:masters`` for the admin, ``system:node:<name>`` in
``system:nodes`` for a node). Making real certificates, rather than turning authentication
off, is what lets the tests see the RBAC and Node-authorizer decisions a real cluster makes.
EC P-256 keys keep generation fast (a few milliseconds each).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=7)


@dataclass(frozen=True, slots=True)
class CertPair:
    """Paths of a PEM certificate and its unencrypted PEM key."""

    cert: Path
    key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(common_name: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


class CertificateAuthority:
    """A self-signed CA that issues the cluster's leaf certificates into ``directory``."""

    def __init__(self, directory: Path, common_name: str = "ctj-devcluster-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        subject = _name(common_name)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.pair = CertPair(directory / "ca.crt", directory / "ca.key")
        self.pair.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))
        _write_key(self._key, self.pair.key)

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        orgs: tuple[str, ...] = (),
        server: bool = False,
        client: bool = False,
        dns_names: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
    ) -> CertPair:
        """Writes ``<name>.crt``/``<name>.key`` signed by this CA and returns their paths."""
        if not (server or client):
            raise ValueError(f"{name}: a certificate must be for a server, a client or both")
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, orgs))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = CertPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, pair.key)
        return pair


def write_service_account_keys(directory: Path) -> CertPair:
    """The key pair the API server signs and verifies service-account tokens with
    (``cert`` holds the public key, PEM, as --service-account-key-file takes it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    pair = CertPair(directory / "sa.pub", directory / "sa.key")
    _write_key(key, pair.key)
    pair.cert.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pair
