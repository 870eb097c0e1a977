"""Fault-injection campaign: kills, dead workers, damaged checkpoints, a full disk, failing clients, two
runs on one folder and a corrupted dataset file, each repeated over trials, with a table of the outcome.

Every trial ends with the run's ``metrics.jsonl`` and ``summary.json`` compared with an uninterrupted run of
the same config, field for field except the wall-clock fields (record keys ``seconds*``, summary keys
``wall_seconds`` and ``seconds``). A trial *survives* when the run stopped the way the policy says (one line
on stderr, the documented exit code, no traceback, no process left behind) and its resumed results equal
the uninterrupted run's: no round lost, no line duplicated, cut or changed.

Runs are tiny (scikit-learn digits, 8 clients, a small MLP, 6 rounds), so a kill trial costs ~5 s, most of it
two interpreter start-ups. Kill trials run the real ``fedskew run`` command in a subprocess and SIGKILL its
main process (as the OOM killer would), at a random instant or inside a checkpoint / ``metrics.jsonl`` write
(the forked run's ``results.write_bytes`` writes half of the chosen write, signals a file and blocks, so the
kill lands inside it whatever the machine's load). The other classes run the CLI's ``main`` in this process,
with the fault injected by replacing the algorithm or the writer.

    python benchmarks/faults.py                # the full campaign (docs/reliability.md), ~30 min here
    python benchmarks/faults.py --quick        # a few trials per class (the CI test runs this)
    python benchmarks/faults.py --trials 5     # kill trials per (class, mode)
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

if __package__ in (None, ""):  # run as a script (`python benchmarks/faults.py`): the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli_calls import cli_exit_code, one_line, run_cli  # after the path

from fedskew.algorithms.base import ALGORITHMS, LocalOutput, Payload
from fedskew.algorithms.fedavg import FedAvg
from fedskew.experiment import results, runner

MODES: dict[str, dict[str, Any]] = {
    "sequential": {"mode": "sequential", "workers": 1},
    "workers": {"mode": "sequential", "workers": 2},
    "vectorized": {"mode": "vectorized", "workers": 1},
}
ROUNDS = 6
#: summary keys that are wall-clock time or the process that wrote them (provenance: a resumed run records
#: its earlier processes), not results (record keys starting with "seconds" likewise)
SUMMARY_TIMING = ("wall_seconds", "seconds", "provenance")
#: seconds to wait for an event of a run (a write reached, a file written): only a hung run takes this long
DEADLINE = 300.0


def tiny_config(mode: str, **engine: Any) -> dict[str, Any]:
    """The campaign's run: digits, 8 clients (half sampled a round), a small MLP, 6 rounds."""
    return {
        "seed": 0,
        "rounds": ROUNDS,
        "data": {"dataset": "digits", "num_clients": 8, "partition": {"name": "dirichlet", "alpha": 0.5}},
        "model": {"name": "mlp_mpfedcl", "hidden": 64, "embed_dim": 32},
        "algorithm": {"name": "fedavg"},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "fraction": 0.5},
        "eval": {"protocol": "global", "every": 1},
        "checkpoint": {"every": 2},
        "engine": {**MODES[mode], **engine},
    }


# ---------------------------------------------------------------------------- results and their comparison
def strip_record(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith("seconds")}


def strip_summary(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in SUMMARY_TIMING}


@dataclass
class Results:
    """A folder's metrics lines (``None`` for a line that is not a whole JSON object) and summary."""

    lines: list[dict[str, Any] | None]
    summary: dict[str, Any] | None

    @classmethod
    def read(cls, out: Path) -> Results:
        lines: list[dict[str, Any] | None] = []
        metrics = out / runner.METRICS_FILE
        text = metrics.read_text() if metrics.is_file() else ""
        for line in text.splitlines(keepends=True):
            try:
                lines.append(strip_record(json.loads(line)) if line.endswith("\n") else None)
            except ValueError:
                lines.append(None)
        path = out / runner.SUMMARY_FILE
        summary = strip_summary(json.loads(path.read_text())) if path.is_file() else None
        return cls(lines, summary)


def losses(got: Results, ref: Results) -> tuple[int, int]:
    """``(rounds lost, metrics altered)`` of ``got`` against the reference: rounds missing, and lines cut,
    duplicated or changed (a summary that differs counts as one altered)."""
    want = {r["round"]: r for r in ref.lines if r is not None}
    seen: dict[int, int] = {}
    altered = 0
    for r in got.lines:
        if r is None or r.get("round") not in want or r != want[r["round"]]:
            altered += 1
            continue
        seen[r["round"]] = seen.get(r["round"], 0) + 1
    altered += sum(n - 1 for n in seen.values()) + (got.summary != ref.summary)
    return len(want.keys() - seen.keys()), altered


@dataclass
class Row:
    fault: str
    mode: str
    trials: int = 0
    survived: int = 0
    tracebacks: int = 0
    rounds_lost: int = 0
    altered: int = 0
    notes: list[str] = field(default_factory=list)

    def add(self, ok: bool, traceback: bool = False, lost: int = 0, altered: int = 0, note: str = "") -> None:
        self.trials += 1
        self.survived += ok and not traceback and not lost and not altered
        self.tracebacks += traceback
        self.rounds_lost += lost
        self.altered += altered
        if note and not (ok and not traceback and not lost and not altered):
            self.notes.append(note)


# ---------------------------------------------------------------------------- forked runs (kills)
class Forked:
    """``fedskew <argv>`` run by the CLI's ``main`` in a forked child, in its own session (so its workers
    share its process group): the real command without an interpreter start-up per trial. The subset of
    :class:`subprocess.Popen` the trials use; stderr is collected in a file."""

    def __init__(
        self, argv: list[str], errfile: Path, env: dict[str, str], setup: Callable[[], None] | None = None
    ) -> None:
        self.errfile, self.returncode = errfile, None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code: Any = 1
            try:
                os.setsid()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.environ.update(env)
                if setup is not None:  # a fault injected into this child only
                    setup()
                err = os.open(errfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(err, 2)
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                # the parent's sys.stderr may be a capture (pytest): the child writes to the real fd 2
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
                code = cli_exit_code(argv)
            finally:
                with contextlib.suppress(Exception):
                    sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
        self.pid = pid

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired("fedskew", timeout or 0.0)
            time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[None, str]:
        self.wait(timeout)
        return None, self.errfile.read_text(errors="replace")


class Campaign:
    """One campaign's working folder, reference results and table."""

    def __init__(self, work: Path, rng: random.Random) -> None:
        torch.set_num_threads(1)  # every run forks from here: one thread, so float sums are bit-identical
        self.work, self.rng = work, rng
        self.rows: dict[tuple[str, str], Row] = {}
        self.refs: dict[str, Results] = {}
        self.durations: dict[str, float] = {}
        self.count = 0

    def row(self, fault: str, mode: str) -> Row:
        return self.rows.setdefault((fault, mode), Row(fault, mode))

    def folder(self, name: str) -> Path:
        self.count += 1
        return self.work / f"{self.count:04d}-{name}"

    def config_file(self, mode: str) -> Path:
        path = self.work / f"config-{mode}.yaml"
        if not path.exists():
            path.write_text(yaml.safe_dump(tiny_config(mode)))
        return path

    def start(
        self, mode: str, out: Path, *args: str, setup: Callable[[], None] | None = None, **env: str
    ) -> Forked:
        argv = ["run", str(self.config_file(mode)), "--out", str(out), *args]
        self.count += 1
        return Forked(argv, self.work / f"stderr-{self.count}.txt", env, setup)

    def reference(self, mode: str) -> Results:
        """The uninterrupted run of ``mode`` (a subprocess, as the trials are); its wall time is noted."""
        if mode not in self.refs:
            out = self.work / f"reference-{mode}"
            t0 = time.perf_counter()
            proc = self.start(mode, out)
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"reference run ({mode}) failed: {err}")
            self.durations[mode] = time.perf_counter() - t0
            self.refs[mode] = Results.read(out)
        return self.refs[mode]

    def resume(self, mode: str, out: Path) -> tuple[int, str]:
        proc = self.start(mode, out, "--resume")
        _, err = proc.communicate(timeout=300)
        return proc.returncode, err

    def settle_kill(self, row: Row, mode: str, proc: Forked, out: Path, note: str) -> None:
        """After SIGKILL of ``proc``: no process of its group left, ``--resume`` exits 0 with the same
        results as the reference."""
        proc.kill()
        _, killed_err = proc.communicate()
        orphans = _group_alive(proc.pid)
        code, err = self.resume(mode, out)
        lost, altered = losses(Results.read(out), self.reference(mode))
        ok = code == 0 and not orphans
        tb = "Traceback" in killed_err + err
        note = f"{note}: exit {code}, orphans {orphans}, {killed_err[-300:]} {err[-300:]}"
        row.add(ok, tb, lost, altered, note)

    # ------------------------------------------------------------------ kill trials
    def kill_random(self, mode: str) -> None:
        """SIGKILL at a random instant of the run (start-up, training, aggregation, evaluation, writes)."""
        ref_time = self.durations[mode]
        out = self.folder(f"kill-{mode}")
        delay = self.rng.uniform(0.4, 1.0) * ref_time
        proc = self.start(mode, out)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=delay)
        self.settle_kill(self.row("SIGKILL, random instant", mode), mode, proc, out, f"delay {delay:.2f}s")

    def kill_in_write(self, mode: str, what: str) -> None:
        """SIGKILL inside the n-th checkpoint write (``checkpoint``) or ``metrics.jsonl`` append."""
        out = self.folder(f"kill-{what}-{mode}")
        target = self.rng.randint(1, 3 if what == "checkpoint" else ROUNDS)
        inside = out.with_name(out.name + ".inside")
        proc = self.start(mode, out, setup=block_inside_write(WRITTEN[what], target, inside))
        landed = wait_for_file(inside, proc)
        row = self.row(f"SIGKILL inside a {what} write", mode)
        self.settle_kill(row, mode, proc, out, f"target {target}, landed {landed}")
        if not landed:  # the run ended before the write it was to be killed in: not the fault asked for
            row.survived -= 1
            row.notes.append(f"{what} write {target} never reached (exit {proc.returncode})")

    def kill_worker(self) -> None:
        """SIGKILL one worker process mid-round: the round runs again on new workers, the run finishes."""
        out = self.folder("kill-worker")
        proc = self.start("workers", out)
        row = self.row("worker process SIGKILLed mid-round", "workers")
        victim, deadline = None, time.time() + 120
        after = self.rng.uniform(0.0, 0.6)
        while victim is None and proc.poll() is None and time.time() < deadline:
            kids = _children(proc.pid)
            if kids:
                time.sleep(after)
                victim = self.rng.choice(kids)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
            time.sleep(0.01)
        try:
            _, err = proc.communicate(timeout=120)
            hung = False
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            hung = True
        code = proc.returncode
        if code != 0 and not hung:  # failed twice with its one-line message: --resume continues exactly
            code, err2 = self.resume("workers", out)
            err += err2
        lost, altered = losses(Results.read(out), self.reference("workers"))
        row.add(code == 0 and not hung and victim is not None, "Traceback" in err, lost, altered, err[-300:])

    def two_processes(self, mode: str) -> None:
        """A second run on the folder of a running one is refused (exit 2, one line); after the first is
        SIGKILLed its lock is gone and ``--resume`` finishes the run."""
        out = self.folder(f"lock-{mode}")
        inside = out.with_name(out.name + ".inside")  # the first run holds the folder inside its first append
        first = self.start(mode, out, setup=block_inside_write(WRITTEN["metrics"], 1, inside))
        wait_for_file(inside, first)
        second = self.start(mode, out, "--resume")
        _, err = second.communicate(timeout=120)
        refused = (
            second.returncode == 2
            and "in use by another fedskew process" in err
            and len(err.splitlines()) == 1
        )
        running = first.poll() is None
        row = self.row("second process on the same --out", mode)
        if not running:  # the first run must still hold the folder (its writes are slowed down)
            _, err1 = first.communicate()
            row.add(False, "Traceback" in err1, note=f"first run ended early: {err1[-300:]}")
            return
        self.settle_kill(row, mode, first, out, f"second: exit {second.returncode} {err.strip()}")
        if not refused:
            row.survived -= row.survived > 0
            row.notes.append(f"not refused: {err.strip()}")


#: the results file each kill-inside-a-write class targets (a checkpoint is written to a temporary name)
WRITTEN = {"checkpoint": runner.CHECKPOINT_FILE + ".tmp", "metrics": runner.METRICS_FILE}


def block_inside_write(name: str, target: int, inside: Path) -> Callable[[], None]:
    """A child's setup: its ``target``-th write to a file named ``name`` writes half its bytes, creates
    ``inside`` and blocks until the process is killed, so a kill lands inside that write on any machine."""

    def setup() -> None:
        write, seen = results.write_bytes, 0

        def half_then_block(fh: Any, data: bytes) -> None:
            nonlocal seen
            if Path(getattr(fh, "name", "")).name == name:
                seen += 1
                if seen == target:
                    write(fh, data[: len(data) // 2])
                    fh.flush()
                    inside.touch()
                    while True:
                        time.sleep(1.0)
            write(fh, data)

        results.write_bytes = (
            half_then_block  # the one writer of results files (results.write_atomic, appends)
        )

    return setup


def wait_for_file(path: Path, proc: Forked) -> bool:
    """Whether ``path`` appeared while ``proc`` still ran (``False``: it exited first, or hung)."""
    end = time.monotonic() + DEADLINE
    while not path.exists() and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.01)
    return path.exists() and proc.poll() is None


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _group_alive(pgid: int, wait: float = 60.0) -> bool:
    """Whether a process of group ``pgid`` is still alive ``wait`` seconds after its leader died (the kernel
    ends them at once; the wait only has to outlast a loaded machine's scheduling)."""
    deadline = time.time() + wait
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.05)
    return True


# ---------------------------------------------------------------------------- in-process runs
class Faulty(FedAvg):
    """FedAvg whose ``victims`` fail in round ``round_``: ``kind`` is raise, nan, inf or explode (weights
    x 1e39, which overflows float32 to Inf)."""

    kind, round_, victims = "raise", 3, frozenset[int]()

    def finish_local(self, step, result):  # type: ignore[no-untyped-def]
        out = super().finish_local(step, result)
        if step.info.round != self.round_ or step.client.cid not in self.victims:
            return out
        if self.kind == "raise":
            raise RuntimeError("injected client failure")
        factor = {"nan": float("nan"), "inf": float("inf"), "explode": 1e39}[self.kind]
        arrays = {k: v * factor if v.is_floating_point() else v for k, v in out.upload.arrays.items()}
        return LocalOutput(Payload(arrays=arrays, config=out.upload.config), out.state)


@contextlib.contextmanager
def faulty_fedavg(kind: str, victims: set[int], round_: int = 3) -> Iterator[None]:
    cls = type("FaultyFedAvg", (Faulty,), {"kind": kind, "victims": frozenset(victims), "round_": round_})
    with ALGORITHMS.replaced("fedavg", cls):
        yield


class InProcess:
    """The fault classes run through the CLI's ``main`` in this process."""

    def __init__(self, campaign: Campaign) -> None:
        self.c = campaign

    def run(self, mode: str, out: Path, *args: str, **engine: Any) -> tuple[Any, str]:
        cfg = self.c.work / f"config-{mode}-{'-'.join(f'{k}={v}' for k, v in engine.items())}.yaml"
        cfg.write_text(yaml.safe_dump(tiny_config(mode, **engine)))
        return run_cli("run", str(cfg), "--out", str(out), *args)

    def interrupted(self, mode: str, at_round: int) -> Path:
        """A folder whose run stopped after ``at_round`` rounds (checkpoint written on the way out)."""
        out = self.c.folder(f"stopped-{mode}")

        class Stop(Faulty):
            kind, round_, victims = "raise", at_round + 1, frozenset(range(8))

        with ALGORITHMS.replaced("fedavg", Stop):
            code, err = self.run(mode, out, on_client_error="fail")
        assert code == 1, err
        return out

    def corrupted_checkpoint(self, mode: str) -> None:
        """Truncate checkpoint.pt or flip one of its bytes: one line naming the file and the previous
        checkpoint; after deleting it, ``--resume`` continues from the previous one to the same results."""
        row = self.c.row("truncated / corrupted checkpoint", mode)
        out = self.interrupted(mode, self.c.rng.randint(3, ROUNDS - 1))
        path = out / runner.CHECKPOINT_FILE
        data = bytearray(path.read_bytes())
        if self.c.rng.random() < 0.5:
            data = data[: self.c.rng.randrange(len(data))]
        else:
            data[self.c.rng.randrange(len(data))] ^= 1 << self.c.rng.randrange(8)
        path.write_bytes(bytes(data))
        code, err = self.run(mode, out, "--resume", on_client_error="fail")
        named = str(path) in err and runner.CHECKPOINT_PREV in err
        path.unlink()
        code2, err2 = self.run(mode, out, "--resume", on_client_error="fail")
        lost, altered = losses(Results.read(out), self.c.reference(mode))
        # a flipped bit in zip padding leaves the content whole: it loads and resumes (results compared)
        ok = (code == 0 or (code == 2 and one_line(err) and named)) and code2 == 0
        row.add(ok, "Traceback" in err + err2, lost, altered, f"{code} {err.strip()} / {code2} {err2[-300:]}")

    def disk_full(self, mode: str) -> None:
        """ENOSPC at a random write (checkpoint, metrics, config, summary), after a random part of it: one
        line, exit 1, every file as before; ``--resume`` with space back gives the same results."""
        row = self.c.row("disk full (ENOSPC) in a write", mode)
        out = self.c.folder(f"enospc-{mode}")
        fail_at = self.c.rng.randint(
            1, 3 + ROUNDS + ROUNDS // 2
        )  # config, metrics, lines, checkpoints, summary
        calls, real = [0], results.write_bytes
        snapshot: dict[str, bytes] = {}

        def full_disk(fh: Any, data: bytes) -> None:
            calls[0] += 1
            if calls[0] == fail_at:
                done = [p for p in out.iterdir() if p.is_file() and p.suffix != ".tmp"]  # not the one written
                snapshot.update({p.name: p.read_bytes() for p in done})
                fh.write(data[: self.c.rng.randrange(len(data) + 1)])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fh, data)

        results.write_bytes = full_disk
        try:
            code, err = self.run(mode, out, on_client_error="fail")
        finally:
            results.write_bytes = real
        after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
        # the interrupt checkpoint may replace checkpoint.pt (and move it to .prev); the rest is untouched
        kept = all(after.get(k) == v for k, v in snapshot.items() if not k.startswith("checkpoint"))
        kept = kept and not any(k.endswith(".tmp") for k in after)
        code2, err2 = self.run(mode, out, "--resume", on_client_error="fail")
        lost, altered = losses(Results.read(out), self.c.reference(mode))
        expected = code == 1 and one_line(err) and "disk is full" in err
        if not snapshot:  # fewer writes than fail_at: the run finished, not a trial of this class
            expected = code == 0
        ok = expected and kept and code2 == 0
        row.add(
            ok,
            "Traceback" in err + err2,
            lost,
            altered,
            f"call {fail_at}: {code} {err[-200:]} / {err2[-200:]}",
        )

    def client_fault(self, mode: str, kind: str, policy: str) -> None:
        """A client raising / uploading NaN, Inf or an exploding update in round 3. ``drop``: the run
        finishes, round 3 counts the rejected clients, every metric is finite. ``fail``: exit 1 with one
        line naming the round, nothing of round 3 committed: ``--resume`` with a healthy client gives the
        reference results."""
        row = self.c.row(f"client {kind}", f"{mode}, {policy}")
        out = self.c.folder(f"client-{kind}-{policy}-{mode}")
        victims = {self.c.rng.randrange(8) for _ in range(3)}
        with faulty_fedavg(kind, victims):
            code, err = self.run(mode, out, on_client_error=policy)
        sampled = _sampled(out, 3)
        hit = victims & sampled
        if policy == "drop":
            lines = Results.read(out).lines
            rec = next((r for r in lines if r and r["round"] == 3), {})
            finite = all(r and all(v is not None for v in r.values()) for r in lines)
            ok = code == 0 and rec.get("rejected") == len(hit) and finite and len(lines) == ROUNDS
            row.add(ok, "Traceback" in err, note=f"{code} {rec.get('rejected')} vs {hit} {err[-200:]}")
            return
        expected = (code == 1 and one_line(err) and "round 3" in err) if hit else code == 0
        code2, err2 = self.run(mode, out, "--resume", on_client_error=policy)
        lost, altered = losses(Results.read(out), self.c.reference(mode)) if hit else (0, 0)
        row.add(
            expected and code2 == 0, "Traceback" in err + err2, lost, altered, f"{code} {err} / {err2[-200:]}"
        )

    def all_rejected(self, mode: str) -> None:
        """Every client of round 3 rejected (drop): round 3 is recorded as skipped, its server state is round
        2's (same accuracy and loss), and the run goes on."""
        row = self.c.row("every client of a round rejected", mode)
        out = self.c.folder(f"skipped-{mode}")
        with faulty_fedavg(self.c.rng.choice(["raise", "nan", "inf", "explode"]), set(range(8))):
            code, err = self.run(mode, out, on_client_error="drop")
        lines = [r for r in Results.read(out).lines if r]
        summary = json.loads((out / runner.SUMMARY_FILE).read_text()) if code == 0 else {}
        r2, r3 = lines[1], lines[2]
        ok = (
            code == 0
            and r3.get("skipped") is True
            and "skipped" not in r2
            and (r3["accuracy"], r3["loss"]) == (r2["accuracy"], r2["loss"])
            and summary.get("skipped_rounds") == [3]
        )
        row.add(ok, "Traceback" in err, note=f"{code} {r3} {err[-200:]}")

    def corrupted_dataset(self) -> None:
        """A byte of an MNIST file flipped: exit 2 with one line naming the file and the fix."""
        src = Path(os.environ.get("FEDSKEW_DATA", "")) / "mnist"
        if not src.is_dir():
            return
        row = self.c.row("corrupted dataset file", "-")
        root = self.c.folder("data")
        shutil.copytree(src, root / "mnist")
        victim = self.c.rng.choice(sorted((root / "mnist").glob("*.gz")))
        data = bytearray(victim.read_bytes())
        data[self.c.rng.randrange(len(data))] ^= 0x55
        victim.write_bytes(bytes(data))
        cfg = {**tiny_config("sequential"), "data": {"dataset": "mnist", "root": str(root), "num_clients": 8}}
        path = root / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        code, err = run_cli("run", str(path), "--out", str(root / "out"))
        ok = code == 2 and one_line(err) and str(victim) in err and "delete it" in err
        row.add(ok, "Traceback" in err, note=err[-300:])


def _sampled(out: Path, round_: int) -> set[int]:
    from fedskew.engine.sampling import sampling_schedule

    cfg = yaml.safe_load((out / runner.CONFIG_FILE).read_text())
    sched = sampling_schedule(
        cfg["data"]["num_clients"], cfg["client"]["fraction"], cfg["rounds"], cfg["seed"]
    )
    return set(sched[round_ - 1].tolist())


# ---------------------------------------------------------------------------- the campaign
def run_campaign(trials: int, quick: bool, seed: int = 0, log: Callable[[str], None] = print) -> list[Row]:
    """Every fault class; ``trials`` kill trials per (class, mode). Returns the table's rows."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="fedskew-faults-") as tmp:
        c = Campaign(Path(tmp), rng)
        for mode in MODES:
            c.reference(mode)
        log(f"references: {', '.join(f'{m} {t:.1f} s' for m, t in c.durations.items())}")
        ip = InProcess(c)
        kill_plan, local = (_quick_plan if quick else _full_plan)(c, ip, trials)
        for i, trial in enumerate(kill_plan + local, 1):
            trial()
            if i % 10 == 0:
                log(f"{i}/{len(kill_plan) + len(local)} trials")
        return list(c.rows.values())


Plan = tuple[list[Callable[[], None]], list[Callable[[], None]]]
KINDS = ("raise", "nan", "inf", "explode")


def _full_plan(c: Campaign, ip: InProcess, trials: int) -> Plan:
    """``trials`` random kills per mode, a third as many inside checkpoint and metrics writes, worker kills;
    every in-process class in every mode."""
    kills: list[Callable[[], None]] = []
    for mode in MODES:
        kills += [lambda m=mode: c.kill_random(m)] * trials
        kills += [lambda m=mode: c.kill_in_write(m, "checkpoint")] * max(1, trials // 3)
        kills += [lambda m=mode: c.kill_in_write(m, "metrics")] * max(1, trials // 3)
        kills.append(lambda m=mode: c.two_processes(m))
    kills += [c.kill_worker] * max(2, trials // 2)
    local: list[Callable[[], None]] = []
    other = max(2, trials // 6)
    for mode in MODES:
        local += [lambda m=mode: ip.corrupted_checkpoint(m)] * other
        local += [lambda m=mode: ip.disk_full(m)] * other * 2
        local += [lambda m=mode: ip.all_rejected(m)]
        for kind in KINDS:
            for policy in ("drop", "fail"):
                local += [lambda m=mode, k=kind, p=policy: ip.client_fault(m, k, p)]
    local.append(ip.corrupted_dataset)
    return kills, local


def _quick_plan(c: Campaign, ip: InProcess, trials: int) -> Plan:
    """Every class ``trials`` times, the modes taken in turn (the CI test)."""
    modes = list(MODES) * (8 * trials)
    kills: list[Callable[[], None]] = []
    local: list[Callable[[], None]] = []
    for i in range(trials):
        kills += [lambda m=m: c.kill_random(m) for m in MODES]
        kills += [
            lambda m=modes[i]: c.kill_in_write(m, "checkpoint"),
            lambda m=modes[i + 1]: c.kill_in_write(m, "metrics"),
        ]
        kills += [c.kill_worker, lambda m=modes[i + 2]: c.two_processes(m)]
        local += [lambda m=modes[i]: ip.corrupted_checkpoint(m), lambda m=modes[i + 1]: ip.disk_full(m)]
        local += [lambda m=modes[i + 2]: ip.all_rejected(m)]
        for j, (kind, policy) in enumerate((k, p) for k in KINDS for p in ("drop", "fail")):
            local.append(lambda m=modes[i + j], k=kind, p=policy: ip.client_fault(m, k, p))
    local.append(ip.corrupted_dataset)
    return kills, local


def table(rows: list[Row]) -> str:
    head = "| fault | mode | trials | survived | tracebacks | rounds lost | metrics altered |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    total = Row("**total**", "")
    for r in [*rows, total]:
        cells = [r.fault, r.mode, r.trials, r.survived, r.tracebacks, r.rounds_lost, r.altered]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        if r is not total:
            total.trials += r.trials
            total.survived += r.survived
            total.tracebacks += r.tracebacks
            total.rounds_lost += r.rounds_lost
            total.altered += r.altered
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=None, help="kill trials per (class, mode)")
    ap.add_argument("--quick", action="store_true", help="a few trials per class (CI)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fuzz", type=int, default=None, help="fuzzed configs (default 1000, --quick 100)")
    args = ap.parse_args()
    trials = args.trials if args.trials is not None else (1 if args.quick else 20)
    t0 = time.perf_counter()
    rows = run_campaign(trials, args.quick, args.seed)
    from benchmarks.fuzz_config import fuzz_campaign

    fuzz = fuzz_campaign(args.fuzz if args.fuzz is not None else (100 if args.quick else 1000))
    print(table(rows))
    print()
    print(fuzz.table())
    print(f"\n{time.perf_counter() - t0:.0f} s")
    for r in rows:
        for n in r.notes:
            print(f"FAILED {r.fault} [{r.mode}]: {n}")
    bad = sum(r.trials - r.survived for r in rows) + fuzz.failures
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
