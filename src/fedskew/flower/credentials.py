"""Credentials a local deployment makes for itself: TLS for the SuperLink and a key per SuperNode.

``engine.runtime=flower-deployment`` is secure by default (issue 51):
:class:`fedskew.flower.deploy.LocalDeployment` serves over TLS with a CA and a 127.0.0.1 certificate made
for the run, and every SuperNode authenticates with its own key pair (registered with the SuperLink before
the nodes start); ``engine.insecure: true`` is the only way back to Flower's ``--insecure``. The files live
in the deployment's temporary home and are deleted with it. Generated with ``cryptography`` (a dependency
of Flower): ECDSA P-256 for TLS, P-384 OpenSSH keys for the nodes (what ``flower-supernode
--auth-supernode-private-key`` reads).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from fedskew.errors import FedskewError

__all__ = ["Tls", "node_keys", "register_keys", "write_node_key", "write_tls"]


@dataclass
class Tls:
    """TLS files: the CA certificate everyone trusts, the SuperLink's certificate (for 127.0.0.1) and key."""

    ca: Path
    cert: Path
    key: Path


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
    ca_builder = build("fedskew run CA", "fedskew run CA", ca_key.public_key())
    ca = ca_builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(
        ca_key, hashes.SHA256()
    )
    san = x509.SubjectAlternativeName(
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    )
    leaf = build("127.0.0.1", "fedskew run CA", key.public_key()).add_extension(san, critical=False)
    cert = leaf.sign(ca_key, hashes.SHA256())
    folder.mkdir(parents=True, exist_ok=True)
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


def node_keys(folder: Path, nodes: int) -> tuple[dict[int, Path], list[Path]]:
    """A key pair per node index in ``folder``: the private keys by index, the public keys to register."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = {i: write_node_key(folder, f"node-{i}") for i in range(nodes)}
    return keys, [key.with_name(f"{key.name}.pub") for key in keys.values()]


def register_keys(
    public: list[Path], command: list[str], env: dict[str, str], timeout: float = 120
) -> list[int]:
    """Register the nodes' ``public`` keys with the SuperLink (``command``: ``flwr supernode register``), all
    at once (each ``flwr`` call spends seconds starting up, which would add up per node); the Flower node id
    the SuperLink assigned to each key, in order (SuperNode authentication ties the id to the key:
    :mod:`fedskew.flower.identity`)."""
    out = subprocess.PIPE
    calls = [
        subprocess.Popen(
            [*command, str(key), "local", "--format", "json"], env=env, stdout=out, stderr=out, text=True
        )
        for key in public
    ]
    ids = []
    for call in calls:
        said, err = call.communicate(timeout=timeout)
        if call.returncode != 0:
            raise FedskewError(f"flwr supernode register failed: {(said + err).strip()[-600:]}")
        try:
            ids.append(int(json.loads(said[said.index("{") :])["node-id"]))
        except (ValueError, KeyError) as why:
            raise FedskewError(f"flwr supernode register: no node id in its answer ({why})") from None
    return ids
