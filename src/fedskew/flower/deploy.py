"""A one-machine Flower deployment: a SuperLink and ``engine.nodes`` SuperNodes on loopback, Flower's own
processes (``flower-superlink``, ``flower-supernode``, ``flwr run``), torn down when the block ends.

Every process starts in its own process group, so teardown (on success, failure or Ctrl-C) reaps the
SuperLink's ServerApp and the SuperNodes' ClientApp subprocesses with them. Ports are chosen free at run
time. ``FLWR_HOME`` is a private temporary folder (Flower's config, installed apps).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedskew.errors import FedskewError
from fedskew.experiment.config import Config, dump_config
from fedskew.flower.credentials import Tls, node_keys, register_keys, write_tls
from fedskew.flower.identity import NODE_IDS_KEY, format_node_ids
from fedskew.flower.logs import FLOWER_LOG, append_process_logs
from fedskew.flower.node import THREADS_KEY
from fedskew.flower.silos import DATA_ROOT_KEY
from fedskew.flower.versions import STATE_DIR_KEY
from fedskew.flower.warm import SOCKET_ENV
from fedskew.threads import resolve_threads

if TYPE_CHECKING:
    from fedskew.flower.apps import Job

#: the Flower app ``flwr run`` submits: a pyproject naming fedskew's generic apps (shipped in the package)
APP_DIR = Path(__file__).parent / "app"
START_SECONDS = 60.0
#: the folder of an output folder where a local deployment's nodes keep their clients' states
NODE_STATE_DIR = "node-state"
#: the warm launcher's socket and shim folder, in the deployment's folder
WARM_SOCKET, WARM_BIN = "warm.sock", "warm-bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_threads(nodes: int, requested: int = 0) -> int:
    """Torch threads per node when ``nodes`` nodes share this machine: ``requested`` (``engine.threads``)
    if positive, else fedskew's one thread policy (:func:`fedskew.threads.resolve_threads`): an equal share
    of the cores free now (at least one), so that nodes training at once do not oversubscribe them."""
    return resolve_threads(requested, nodes)[0]


def _bin(name: str) -> str:
    """A Flower command from this interpreter's environment (falls back to PATH)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def deployment_pids(home: Path) -> list[int]:
    """Processes whose environment names ``home`` as ``FLWR_HOME``: every process of one deployment,
    including those Flower starts in a session of their own (the SuperLink's SuperExec and ServerApp)."""
    marker = f"FLWR_HOME={home}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return [p for p in pids if p != os.getpid()]


def write_flower_config(home: Path, port: int, tls: Tls | None) -> None:
    """The ``flwr`` CLI's config in ``home``: the local SuperLink, over TLS when ``tls`` is given."""
    conn: dict[str, Any] = {"address": f"127.0.0.1:{port}"}
    if tls is None:
        conn["insecure"] = True
    else:
        conn["root-certificates"] = str(tls.ca)
    lines = ["[superlink]", 'default = "local"', "", "[superlink.local]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in conn.items()]
    (home / "config.toml").write_text("\n".join(lines) + "\n")


@dataclass
class LocalDeployment:
    """SuperLink + SuperNodes on loopback; use as a context manager, then :meth:`run` experiments on it.

    ``node_config``: extra node-config values per node index (e.g. ``data-root``; ``threads`` overrides
    ``threads``: torch threads per node, 0 for :func:`node_threads`). Secure by default: without ``tls`` and
    ``node_keys`` the deployment makes both for itself (:mod:`fedskew.flower.credentials`); ``insecure=True``
    runs Flower's ``--insecure`` without node authentication. ``tls``: serve over TLS with these files.
    ``node_keys``: the private key (OpenSSH, NIST curve) each node index authenticates with; with any, the
    SuperLink runs with ``--enable-supernode-auth`` and registers the public keys in ``registered``
    (``registered[i]``: node ``i``'s), and every run binds node ``i`` to the id its key got (``node_ids``).
    ``state_root``: where node ``i`` keeps its clients' states (``state_root/i``; default: the temporary
    folder). ``warm``: ClientApp processes are forked from one process that has imported Flower,
    torch and fedskew already (:mod:`fedskew.flower.warm`). ``log_file``: the processes' output goes there."""

    nodes: int
    tls: Tls | None = None
    node_keys: dict[int, Path] = field(default_factory=dict)
    registered: list[Path] = field(default_factory=list)
    node_ids: dict[int, int] = field(default_factory=dict)  # node index -> its key's Flower node id
    node_config: dict[int, dict[str, str]] = field(default_factory=dict)
    home: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fedskew-flower-")))
    state_root: Path | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    port: int = 0
    warm: bool = True
    threads: int = 0  # decided once when the deployment starts, before any process of ours loads the cores
    log_file: Path | None = None
    insecure: bool = False  # engine.insecure: Flower's --insecure, no node authentication

    # ------------------------------------------------------------------ processes
    def env(self) -> dict[str, str]:
        # SuperExec polls for ServerApp / ClientApp tasks every second by default
        env = dict(os.environ, FLWR_HOME=str(self.home), PYTHONUNBUFFERED="1")
        env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1")
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        if self.warm:  # the SuperExecs find the warm flwr-clientapp shim first
            env["PATH"] = f"{self.home / WARM_BIN}{os.pathsep}{env['PATH']}"
            env[SOCKET_ENV] = str(self.home / WARM_SOCKET)
        return env

    def start_warm(self) -> None:
        """Start the zygote the ClientApp processes are forked from; wait until it listens."""
        proc = self.spawn(
            "warm",
            [
                sys.executable,
                "-m",
                "fedskew.flower.warm",
                str(self.home / WARM_SOCKET),
                str(self.home / WARM_BIN),
            ],
        )
        end = time.monotonic() + START_SECONDS
        while not (self.home / WARM_SOCKET).exists():
            if proc.poll() is not None or time.monotonic() > end:
                raise FedskewError(f"the warm ClientApp launcher did not start: {self.tail('warm')}")
            time.sleep(0.05)

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.home / f"{name}.log", "ab")  # noqa: SIM115 (owned by the process)
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start_node(
        self, index: int, name: str | None = None, key: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Start (or restart) SuperNode ``index`` (process ``name``, default ``supernode-<index>``),
        authenticating with ``key`` (default: ``node_keys[index]``, if any)."""
        cfg = {
            "partition-id": str(index),
            "num-partitions": str(self.nodes),
            STATE_DIR_KEY: str((self.state_root or self.home / "node-state") / str(index)),
            THREADS_KEY: str(self.threads or node_threads(self.nodes)),
            **self.node_config.get(index, {}),
        }
        pairs = " ".join(f"{k}={v}" if v.isdigit() else f"{k}={json.dumps(v)}" for k, v in cfg.items())
        args = [_bin("flower-supernode"), "--superlink", f"127.0.0.1:{self.port}", "--port", str(free_port())]
        args += ["--insecure"] if self.tls is None else ["--root-certificates", str(self.tls.ca)]
        key = key or self.node_keys.get(index)
        if key is not None:
            args += ["--auth-supernode-private-key", str(key)]
        return self.spawn(name or f"supernode-{index}", [*args, "--node-config", pairs])

    def kill(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Signal a process's whole group (the process and everything it started)."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if not self.insecure:  # secure by default: what was not given is made for this deployment
            self.tls = self.tls or write_tls(self.home / "tls")
            if not self.node_keys:
                self.node_keys, self.registered = node_keys(self.home / "keys", self.nodes)
        self.threads = node_threads(self.nodes, self.threads)
        self.port = free_port()
        write_flower_config(self.home, self.port, self.tls)
        args = [_bin("flower-superlink"), "--host", "127.0.0.1", "--port", str(self.port)]
        args.append("--disable-runtime-dependency-installation")
        if self.tls is None:
            args.append("--insecure")
        else:
            args += ["--ssl-ca-certfile", str(self.tls.ca), "--ssl-certfile", str(self.tls.cert)]
            args += ["--ssl-keyfile", str(self.tls.key)]
        if self.node_keys:
            args.append("--enable-supernode-auth")
        self.spawn("superlink", args)
        if self.warm:
            self.start_warm()
        self.wait_port()
        ids = register_keys(self.registered, [_bin("flwr"), "supernode", "register"], self.env())
        self.node_ids = {i: node for i, node in enumerate(ids) if i < self.nodes}
        for index in range(self.nodes):
            self.start_node(index)

    def close(self) -> None:
        """Stop every process group (TERM, then KILL after 5 s), reap them, delete the temporary folder."""
        names = list(self.procs)
        for name in names:
            self.kill(name)
        deadline = time.monotonic() + 5
        for name in names:
            proc = self.procs[name]
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(name, signal.SIGKILL)
                proc.wait()
            self.kill(name, signal.SIGKILL)  # stragglers left in the group
        for pid in deployment_pids(self.home):  # processes Flower detached from our groups
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.procs.clear()
        if self.log_file is not None:
            append_process_logs([(p.stem, p) for p in sorted(self.home.glob("*.log"))], self.log_file)
        shutil.rmtree(self.home, ignore_errors=True)

    def wait_port(self) -> None:
        end = time.monotonic() + START_SECONDS
        while time.monotonic() < end:
            if self.procs["superlink"].poll() is not None:
                raise FedskewError(f"flower-superlink exited: {self.tail('superlink')}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        raise FedskewError("flower-superlink did not start within 60 s")

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.home / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------ the flwr CLI
    def flwr(self, args: list[str], timeout: float | None = 120) -> str:
        done = subprocess.run(
            [_bin("flwr"), *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise FedskewError(
                f"flwr {' '.join(args[:2])} failed: {(done.stdout + done.stderr).strip()[-600:]}"
            )
        return done.stdout

    def submit(self, jobs: list[Job]) -> int:
        """Start ``jobs`` as one Flower run (``flwr run``; they run in turn); returns the run id."""
        paths, outs = [], []
        for job in jobs:
            path = self.home / f"config-{time.monotonic_ns()}.yaml"
            path.write_text(dump_config(job.cfg))
            paths.append(str(path))
            outs.append(str(Path(job.out or self.home / f"out-{time.monotonic_ns()}").resolve()))
        resume, force = jobs[0].resume, jobs[0].force
        overrides = f"config={json.dumps(';'.join(paths))} out={json.dumps(';'.join(outs))} "
        overrides += f"resume={str(resume).lower()} force={str(force).lower()}"
        overrides += f" {NODE_IDS_KEY}={json.dumps(format_node_ids(self.node_ids))}"
        text = self.flwr(["run", str(APP_DIR), "local", "--run-config", overrides, "--format", "json"])
        return int(json.loads(text[text.index("{") :])["run-id"])

    def stop(self, run_id: int) -> None:
        """``flwr stop``: mark the run stopped now. A run whose ServerApp died is otherwise marked failed only
        when its heartbeat lapses (about a minute), and until then the nodes hold the run's last message."""
        self.flwr(["stop", str(run_id), "local"])

    def status(self, run_id: int) -> tuple[str, str]:
        """``(status, details)`` of a run, asked through Flower's Control API client."""
        from flwr.cli.flower_config import read_superlink_connection
        from flwr.cli.utils import init_http_client_from_connection
        from flwr.common.serde import run_from_proto
        from flwr.proto.control_pb2 import ListRunsRequest

        saved = os.environ.get("FLWR_HOME")
        os.environ["FLWR_HOME"] = str(self.home)
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # Flower prints "Using SuperLink: ..." each time
                connection = read_superlink_connection("local")
                client = init_http_client_from_connection(connection)
            try:
                res = client.ListRuns(ListRunsRequest(run_id=run_id))
            finally:
                client.close()
        finally:
            if saved is None:
                os.environ.pop("FLWR_HOME", None)
            else:
                os.environ["FLWR_HOME"] = saved
        st = run_from_proto(next(iter(res.run_dict.values()))).status
        full = f"{st.status}:{st.sub_status}" if st.sub_status else st.status
        return full, st.details

    def wait(self, run_id: int, timeout: float | None = None, poll: float = 1.0) -> None:
        """Block until the run finished; raise unless it completed."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            status, details = self.status(run_id)
            if status.startswith("finished"):
                if status != "finished:completed":
                    raise FedskewError(f"Flower run {run_id} {status}: {details}")
                return
            if self.procs["superlink"].poll() is not None:
                raise FedskewError(f"flower-superlink exited during run {run_id}")
            if end is not None and time.monotonic() > end:
                raise FedskewError(f"Flower run {run_id} did not finish within {timeout} s")
            time.sleep(poll)

    def run(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """Run ``jobs`` to the end on this deployment (in turn, one Flower run); their summaries."""
        self.wait(self.submit(jobs))
        return [dict(json.loads((Path(str(j.out)) / "summary.json").read_text())) for j in jobs]


def run_deployment(cfg: Config, out: str | Path | None, resume: bool, force: bool) -> dict[str, Any]:
    """``engine.runtime=flower-deployment`` on this machine: deploy, run ``cfg``, tear down."""
    from fedskew.flower.apps import Job

    with tempfile.TemporaryDirectory(prefix="fedskew-run-") as scratch:
        target = Path(out) if out is not None else Path(scratch) / "out"
        states = target / NODE_STATE_DIR  # kept with the results, so that --resume finds the client states
        if force:
            shutil.rmtree(states, ignore_errors=True)
        roots = dict(enumerate(cfg.data.nodes.roots)) if cfg.data.source == "nodes" else {}
        own = {i: {DATA_ROOT_KEY: str(Path(root).expanduser().resolve())} for i, root in roots.items()}
        deployment = LocalDeployment(
            cfg.engine.nodes, state_root=states, node_config=own, threads=cfg.engine.threads,
            insecure=cfg.engine.insecure,
        )  # fmt: skip
        deployment.log_file = target / FLOWER_LOG  # Flower's processes' output beside the results
        with deployment as dep:
            return dep.run([Job(cfg, target, resume, force)])[0]
