"""``engine.runtime=flower-simulation`` on an existing Ray cluster (``engine.ray_address`` or
``$RAY_ADDRESS``): a two-node cluster on this machine (``ray start --head`` and ``ray start --address``, one
CPU each, private temporary folders, every port chosen free, no dashboard), FedAvg and Ditto on its two
nodes giving the embedded engine's metrics within 1e-5. The cluster's processes are found by an environment
marker and killed at the end, also when a test fails (``ray stop`` would stop every Ray instance of this
user on the machine). The address resolution and its one-line errors are tested without Ray."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.flower.apps import Job
from fedskew.flower.launch import ray_init_args, simulate
from tests.test_flower import assert_same_metrics, embedded, flower_config, records

ROOT = Path(__file__).resolve().parents[1]
MARKER = "FEDSKEW_TEST_RAY_CLUSTER"  # in the environment of every process of a test cluster


def free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free ports, none in ``taken`` (which they join). Every socket stays bound until all
    are drawn: ports drawn one closed socket at a time may repeat, and Ray refuses a port given to two
    components."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port not in taken:
                ports.append(port)
                taken.add(port)
    return ports


def marked_pids(value: str) -> list[int]:
    """Processes whose environment holds ``MARKER=value``: every process a cluster started."""
    marker = f"{MARKER}={value}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


class RayCluster:
    """A Ray head and ``workers`` more nodes on this machine, one CPU each; ``address`` is the head's.
    Node ``name`` (``head``, ``worker-0``, ...) runs with ``FEDSKEW_CACHE=folder/cache-<name>``."""

    def __init__(self, workers: int = 1) -> None:
        # short: Ray's unix sockets live under the temporary folder (a path may hold at most 107 bytes)
        self.folder = Path(tempfile.mkdtemp(prefix="fsray-"))
        self.names = ["head"] + [f"worker-{i}" for i in range(workers)]
        self.taken: set[int] = set()  # every port given to a node of this cluster
        self.address = f"127.0.0.1:{free_ports(1, self.taken)[0]}"

    def start(self, name: str) -> None:
        ports = ["node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc"]
        ports += ["runtime-env-agent", "metrics-export"]
        args = [str(Path(sys.executable).parent / "ray"), "start", "--num-cpus", "1", "--num-gpus", "0"]
        args += ["--temp-dir", str(self.folder / name), "--object-store-memory", str(100 * 2**20)]
        if name == "head":
            ports += ["dashboard", "ray-client-server"]
        chosen = free_ports(len(ports), self.taken)
        args += ["--disable-usage-stats"]
        args += [a for p, n in zip(ports, chosen, strict=True) for a in (f"--{p}-port", str(n))]
        if name == "head":
            args += ["--head", "--port", self.address.rsplit(":", 1)[1], "--include-dashboard", "false"]
        else:
            args += ["--address", self.address]
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update({MARKER: str(self.folder), "FEDSKEW_CACHE": str(self.folder / f"cache-{name}")})
        done = subprocess.run(
            args, env=env, capture_output=True, text=True, timeout=180, start_new_session=True, check=False
        )
        assert done.returncode == 0, f"ray start ({name}) failed: {(done.stdout + done.stderr)[-1500:]}"

    def __enter__(self) -> RayCluster:
        try:
            for name in self.names:
                self.start(name)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """TERM every process of the cluster, KILL what is left after 2 s, delete the folder."""
        import ray

        if ray.is_initialized():  # a test that failed while connected
            ray.shutdown()
        for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            for pid in marked_pids(str(self.folder)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            end = time.monotonic() + wait
            while marked_pids(str(self.folder)) and time.monotonic() < end:
                time.sleep(0.2)
        shutil.rmtree(self.folder, ignore_errors=True)

    def node_cpus(self) -> list[float]:
        """The CPUs of the cluster's alive nodes, as its head reports them."""
        import ray

        ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
        try:
            return sorted(float(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"])
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with RayCluster(workers=1) as c:
        yield c
    assert not marked_pids(str(c.folder)), "processes of the Ray cluster survived its teardown"


def _raw(name: str, address: str | None) -> dict:
    raw = flower_config(name, rounds=2)  # 6 clients, 4 sampled a round: both nodes' clients in each round
    raw["engine"].update(runtime="flower-simulation", nodes=2, ray_address=address)
    return raw


@pytest.mark.slow
def test_simulation_on_a_two_node_ray_cluster_gives_the_embedded_metrics(cluster, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / "cache-driver"))
    # two nodes of one CPU each, and this process (the driver: the ServerApp) holds none: the two virtual
    # SuperNodes' actors (one CPU each) fill the cluster, one actor per Ray node
    assert cluster.node_cpus() == [1.0, 1.0]
    names = ["fedavg", "ditto"]
    jobs = [Job(build_config(_raw(n, cluster.address)), tmp_path / n) for n in names]
    simulate(jobs)
    for name in names:
        assert_same_metrics(
            records(tmp_path / name), embedded(_raw(name, None), tmp_path / f"embedded-{name}")
        )
    # each Ray node ran ClientApp messages: its worker processes, started with that node's FEDSKEW_CACHE,
    # loaded the digits split and cached it there (the driver's cache is a third folder)
    for name in cluster.names:
        assert list((cluster.folder / f"cache-{name}").glob("digits-*")), f"no ClientApp ran on node {name}"


# ---------------------------------------------------------------------------- the address, without Ray
@pytest.fixture
def listening() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def refusing() -> Iterator[str]:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_the_configured_address_wins_over_ray_address_and_neither_gives_a_local_ray(listening, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_init_args(None)["address"] == "local"  # never a cluster `ray start` left on this machine
    monkeypatch.setenv("RAY_ADDRESS", listening)
    assert ray_init_args(None)["address"] == listening
    monkeypatch.setenv("RAY_ADDRESS", "bad")  # not read: the config names the cluster
    assert ray_init_args(listening)["address"] == listening
    assert ray_init_args(listening)["include_dashboard"] is False


def test_an_unreachable_cluster_is_one_line_naming_the_address(refusing, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match=rf"engine.ray_address='{refusing}': no Ray cluster reachable"):
        ray_init_args(refusing)
    monkeypatch.setenv("RAY_ADDRESS", refusing)
    with pytest.raises(ConfigError, match=rf"RAY_ADDRESS='{refusing}': no Ray cluster reachable"):
        ray_init_args(None)
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.raises(ConfigError, match="RAY_ADDRESS='ray://head:10001': expected HOST:PORT"):
        ray_init_args(None)


def test_a_malformed_ray_address_is_a_config_error():
    raw = _raw("fedavg", "head-without-port")
    with pytest.raises(ConfigError, match=r"config key 'engine.ray_address': .*expected HOST:PORT"):
        build_config(raw)


def test_fedskew_run_on_an_unreachable_cluster_exits_2_with_one_line(refusing):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    args = ["run", "configs/fedavg/digits-flower.yaml", "--set", "engine.runtime=flower-simulation"]
    args += ["--set", f"engine.ray_address={refusing}", "--out", "/nonexistent/never-written"]
    done = subprocess.run(
        [sys.executable, "-m", "fedskew", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and refusing in lines[0] and "no Ray cluster reachable" in lines[0], done.stderr
