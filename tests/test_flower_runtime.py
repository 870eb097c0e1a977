"""fedskew on Flower's real runtimes: the simulation runtime (Ray) and a loopback deployment (SuperLink and
SuperNode processes, ``flwr run``) give the embedded engine's metrics within 1e-5. Slow: Flower starts Ray,
or a ServerApp process and a ClientApp process per node and message. Ports are chosen free at run time and
every process group is reaped, also when a test fails."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from fedskew.experiment.config import build_config
from fedskew.flower.apps import Job
from fedskew.flower.deploy import LocalDeployment, Tls
from fedskew.flower.launch import simulate
from tests.test_flower import assert_same_metrics, embedded, flower_config, records

pytestmark = [pytest.mark.slow, pytest.mark.flower_runtime]
ROOT = Path(__file__).resolve().parents[1]
#: the issue's list: FedAvg, SCAFFOLD, FedProto with heterogeneous models, FedPer, MP-FedCL, FedSKC, FedEnt
LISTED = ["fedavg", "scaffold", "fedproto", "fedper", "mpfedcl", "fedskc", "fedent"]


def _job(name: str, out: Path, runtime: str, rounds: int = 2) -> Job:
    raw = flower_config(name, rounds=rounds)
    raw["engine"]["runtime"] = runtime
    return Job(build_config(raw), out)


def test_simulation_runtime_gives_the_embedded_metrics(tmp_path):
    jobs = [_job(n, tmp_path / f"sim-{n}", "flower-simulation") for n in LISTED]
    simulate(jobs)  # one Ray start-up for all of them
    for name, job in zip(LISTED, jobs, strict=True):
        assert_same_metrics(
            records(Path(str(job.out))), embedded(flower_config(name), tmp_path / f"emb-{name}")
        )


def _fedskew_run(args: list[str], out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable,
        "-m",
        "fedskew",
        "run",
        "configs/fedavg/digits-flower.yaml",
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        assert proc.wait(timeout=900) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_flower_config_runs_a_loopback_deployment_with_the_embedded_summary(tmp_path):
    _fedskew_run(["--set", "rounds=2"], tmp_path / "flower")
    _fedskew_run(["--set", "rounds=2", "--set", "engine.runtime=embedded"], tmp_path / "embedded")
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("flower", "embedded"))
    assert a["final"] == pytest.approx(b["final"], abs=1e-5)
    assert (a["bytes_up"], a["bytes_down"], a["rounds"]) == (b["bytes_up"], b["bytes_down"], b["rounds"])
    assert_same_metrics(records(tmp_path / "flower"), records(tmp_path / "embedded"))


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


def test_tls_and_supernode_authentication_refuse_an_unregistered_node(tmp_path):
    """Also the deployment check of personal state: FedProto's heterogeneous local models live, train and
    are evaluated on the nodes (one deployment serves both checks: each costs many process start-ups)."""
    tls = write_tls(tmp_path)
    keys = {i: write_node_key(tmp_path, f"node{i}") for i in range(4)}
    registered = [keys[i].with_name(f"node{i}.pub") for i in range(3)]  # node key 3 is not registered
    job = _job("fedproto", tmp_path / "out", "flower-deployment", rounds=1)
    node_keys = {i: keys[i] for i in range(3)}
    with LocalDeployment(3, tls=tls, node_keys=node_keys, registered=registered) as dep:
        intruder = dep.start_node(0, name="intruder", key=keys[3])  # claims node 0's clients
        dep.run([job])
        refused = dep.tail("intruder", 400)
        assert intruder.poll() != 0  # still retrying (None) or given up (exit 1 or Flower's 305)
        assert "SuperNode ID" not in refused and "Connection attempt failed" in refused
        assert all("SuperNode ID" in dep.tail(f"supernode-{i}", 400) for i in range(3))
    reference = embedded(flower_config("fedproto", rounds=1), tmp_path / "emb")
    assert_same_metrics(records(tmp_path / "out"), reference)
