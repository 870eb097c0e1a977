"""TLS files and SuperNode keys for the Flower deployment tests (generated with ``cryptography``)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from fedskew.flower.deploy import Tls


def write_tls(folder: Path) -> Tls:
    """A CA and a SuperLink certificate for 127.0.0.1 signed by it (PEM files in ``folder``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = {
        "not_valid_before": now - datetime.timedelta(minutes=5),
        "not_valid_after": now + datetime.timedelta(days=1),
    }

    def build(subject: str, issuer: str, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        b = x509.CertificateBuilder().subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        )
        b = b.issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])).public_key(public)
        b = b.serial_number(x509.random_serial_number())
        return b.not_valid_before(valid["not_valid_before"]).not_valid_after(valid["not_valid_after"])

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("fedskew test CA", "fedskew test CA", ca_key.public_key())
    ca = ca.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(
        ca_key, hashes.SHA256()
    )
    san = x509.SubjectAlternativeName(
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    )
    cert = build("127.0.0.1", "fedskew test CA", key.public_key()).add_extension(san, critical=False)
    cert = cert.sign(ca_key, hashes.SHA256())
    tls = Tls(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    tls.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    tls.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pkcs8, none = serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    tls.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, pkcs8, none))
    return tls


def write_node_key(folder: Path, name: str) -> Path:
    """A SuperNode's P-384 key pair in OpenSSH format: ``folder/name`` and ``folder/name.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    ssh = serialization.PrivateFormat.OpenSSH
    (folder / name).write_bytes(
        key.private_bytes(serialization.Encoding.PEM, ssh, serialization.NoEncryption())
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    (folder / f"{name}.pub").write_bytes(public)
    return folder / name
