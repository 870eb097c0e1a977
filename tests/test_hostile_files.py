"""Hostile files and names (issue 51, item 4): a crafted ``checkpoint.pt`` resumed, and a server that names a
node's state folder, never make fedskew read, write or delete a file outside the folder it owns.

Each attack runs through the real path (``run_experiment(..., resume=True)``, the ``fedskew run`` CLI, a
Flower run over the loopback grid) with a sentinel file outside the run folder, and asserts the refusal is
one line and that every file in the test's folder has the bytes it had before. A crafted checkpoint carries a
recomputed digest (anyone who can write the folder can compute one: the digest guards against damage, not
forgery; ``docs/decisions.md``), so the checks behind the digest are what is tested.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context, RecordDict

from fedskew.cli import main
from fedskew.engine.states import STATES_DIR
from fedskew.errors import FedskewError
from fedskew.experiment.config import build_config, dump_config
from fedskew.experiment.runner import (
    CHECKPOINT_FILE,
    CHECKPOINT_PREV,
    DIGEST_KEY,
    LOCK_FILE,
    run_experiment,
    tree_digest,
)
from fedskew.flower.server import serve
from fedskew.flower.versions import DiskVersions, versions_of
from tests.conftest import StopRun, digits_config, stop_after
from tests.flower_loopback import LoopbackGrid
from tests.test_contract import tiny_config

Sd = dict[str, Any]


def _scaffold(rounds: int = 3) -> dict[str, Any]:
    """SCAFFOLD with a memory budget of a few control variates: most clients' states are spilled files."""
    return digits_config(
        rounds=rounds,
        algorithm={"name": "scaffold"},
        data={"dataset": "digits", "num_clients": 6, "partition": {"name": "dirichlet", "alpha": 0.5}},
        model={"name": "mlp_mpfedcl", "hidden": 16, "embed_dim": 8},
        client={"epochs": 1, "batch_size": 32, "lr": 0.05, "fraction": 1.0},  # every state read every round
        engine={"mode": "sequential", "state_memory_mb": 0.02},
        eval={"protocol": "global", "every": 3},
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-round run (of 3 configured rounds: resume has one to do) with spilled client states."""
    out = tmp_path_factory.mktemp("pristine") / "run"
    with pytest.raises(StopRun):
        run_experiment(build_config(_scaffold()), out, on_round=stop_after(2))
    assert torch.load(out / CHECKPOINT_FILE, weights_only=True)["clients"]["spilled"]  # files on disk
    return out


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (symbolic links as their target's name) with its bytes; the lock left out."""
    out: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(root))] = b"-> " + os.readlink(path).encode()
        elif path.is_file() and path.name != LOCK_FILE:
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def _world(tmp_path: Path, finished: Path) -> tuple[Path, Path]:
    """A copy of the finished run in ``tmp_path/run`` and a sentinel ``tmp_path/victim.pt`` beside it: a
    valid state file (a read of it would not fail on its content)."""
    out = tmp_path / "run"
    shutil.copytree(finished, out, symlinks=True)
    victim = tmp_path / "victim.pt"
    torch.save({"secret": torch.arange(4)}, victim)
    return out, victim


def _craft(out: Path, edit: Callable[[Sd], None], digest: bool = True) -> None:
    """Rewrite ``out``'s checkpoint through ``edit``, with a recomputed digest (what an attacker does)."""
    sd = torch.load(out / CHECKPOINT_FILE, weights_only=True)
    edit(sd)
    sd.pop(DIGEST_KEY, None)
    if digest:
        sd[DIGEST_KEY] = tree_digest(sd)
    torch.save(sd, out / CHECKPOINT_FILE)


def _refused(out: Path, match: str) -> str:
    """Resume ``out``: it must be refused with one line matching ``match``; the message."""
    with pytest.raises(FedskewError, match=match) as err:
        run_experiment(build_config(_scaffold()), out, resume=True)
    assert "\n" not in str(err.value)
    return str(err.value)


def _spill(name: object, size: object = None) -> Callable[[Sd], None]:
    def edit(sd: Sd) -> None:
        spilled = sd["clients"]["spilled"]
        cid = next(iter(spilled))
        spilled[cid] = [name, spilled[cid][1] if size is None else size]

    return edit


# ---------------------------------------------------------------------------- spilled-state file names
def _hostile_names(victim: Path) -> list[object]:
    return [
        "../victim.pt", "../../victim.pt", str(victim), f"{STATES_DIR}/../../victim.pt", "a/r1-c1.pt", "..",
        ".", "", "r1-c1.pt\x00../../victim.pt", "\x00", "r1-c1.pt/", "r1-c1.pt\n", " r1-c1.pt", "r1-c1.pt/..",
        None, 7, b"r1-c1.pt", ["r1-c1.pt"],
    ]  # fmt: skip


def test_a_crafted_spilled_state_name_is_refused_and_touches_no_file(tmp_path, finished):
    """Every name that is not one the run writes (``r<round>-c<client>.pt``) is refused at load, before any
    file is opened: the sentinel beside the run and every file of the run keep their bytes."""
    out, victim = _world(tmp_path, finished)
    for name in _hostile_names(victim):
        _craft(out, _spill(name))
        before = _files(tmp_path)
        _refused(out, r"client-state file .* not a name this run writes .*refusing")
        assert _files(tmp_path) == before, name


def test_an_honest_checkpoint_still_resumes_exactly_and_keeps_the_sentinel(tmp_path, finished):
    """The control: the untouched copy resumes to the end, and only the run's own folder changes."""
    out, victim = _world(tmp_path, finished)
    secret = victim.read_bytes()
    run_experiment(build_config(_scaffold()), out, resume=True)
    assert torch.load(out / CHECKPOINT_FILE, weights_only=True)["round"] == 3
    assert victim.read_bytes() == secret and sorted(p.name for p in tmp_path.iterdir()) == [
        "run",
        "victim.pt",
    ]


def test_a_spilled_name_of_another_file_in_the_folder_with_a_wrong_size_is_one_line(tmp_path, finished):
    """A well-formed name with a size that does not match (or a negative / huge one) reads nothing wrong."""
    out, _ = _world(tmp_path, finished)
    for size in (-1, 10**15, 0):
        _craft(out, _spill_size(size))
        with pytest.raises(FedskewError, match="state file .* missing or damaged") as err:
            run_experiment(build_config(_scaffold()), out, resume=True)
        assert "\n" not in str(err.value)


def _spill_size(size: int) -> Callable[[Sd], None]:
    def edit(sd: Sd) -> None:
        for entry in sd["clients"]["spilled"].values():
            entry[1] = size

    return edit


def test_a_symlinked_state_file_is_not_followed(tmp_path, finished):
    """A spilled file replaced by a link to a file outside (what a crafted folder can hold): refused, one
    line; the link's target keeps its bytes."""
    out, victim = _world(tmp_path, finished)
    sd = torch.load(out / CHECKPOINT_FILE, weights_only=True)
    for name, _ in sd["clients"]["spilled"].values():
        (out / STATES_DIR / name).unlink()
        (out / STATES_DIR / name).symlink_to(victim)
    _craft(out, _spill_size(victim.stat().st_size))
    secret = victim.read_bytes()
    with pytest.raises(FedskewError, match="state file .* missing or damaged") as err:
        run_experiment(build_config(_scaffold()), out, resume=True)
    assert "\n" not in str(err.value) and victim.read_bytes() == secret


def test_a_symlinked_states_folder_is_refused_on_resume_and_unlinked_by_force(tmp_path, finished):
    """``client-states`` as a link to another folder: a resume would spill into it and, two checkpoints on,
    delete the files there that look like state files. Resume refuses it (one line); ``--force`` removes the
    link, never what it points to."""
    out, _ = _world(tmp_path, finished)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / STATES_DIR, elsewhere)
    (elsewhere / "r0-c99.pt").write_bytes(b"not the run's")
    (out / STATES_DIR).symlink_to(elsewhere, target_is_directory=True)
    before = _files(tmp_path)
    _refused(out, f"'{STATES_DIR}' .* symbolic link")
    assert _files(tmp_path) == before
    kept = _files(elsewhere)
    run_experiment(build_config(_scaffold(rounds=1)), out, force=True)
    assert _files(elsewhere) == kept and not (out / STATES_DIR).is_symlink()


# ---------------------------------------------------------------------------- the checkpoint's layout
LAYOUTS: dict[str, Callable[[Sd], None]] = {
    "spilled entry not a pair": lambda sd: sd["clients"]["spilled"].update({0: "r1-c1.pt"}),
    "client id not a number": lambda sd: sd["clients"]["spilled"].update({"../x": ["r1-c1.pt", 1]}),
    "legacy layout, foreign keys": lambda sd: sd.update(clients={"../victim": {}}),
    "round not a number": lambda sd: sd.update(round="../victim"),
    "history not a list": lambda sd: sd.update(history="../victim"),
    "server not a dict": lambda sd: sd.update(server=["../victim"]),
}


@pytest.mark.parametrize("what", list(LAYOUTS))
def test_a_crafted_checkpoint_layout_is_one_line_never_a_traceback(tmp_path, finished, what):
    out, _ = _world(tmp_path, finished)
    _craft(out, LAYOUTS[what])
    before = _files(tmp_path)
    _refused(out, "checkpoint")
    assert _files(tmp_path) == before


# ---------------------------------------------------------------------------- the digest
def test_a_checkpoint_without_its_digest_is_refused(tmp_path, finished):
    """The digest is mandatory: without it a checkpoint cannot be told from a damaged one (every checkpoint
    fedskew has written carries one)."""
    out, _ = _world(tmp_path, finished)
    _craft(out, lambda sd: None, digest=False)
    msg = _refused(out, f"has no content digest .*{DIGEST_KEY}")
    assert str(out / CHECKPOINT_FILE) in msg and CHECKPOINT_PREV in msg  # names the file and the way out


@pytest.mark.parametrize("digest", ["0" * 64, "", None, 5])
def test_a_checkpoint_with_a_wrong_or_odd_digest_is_refused(tmp_path, finished, digest):
    out, _ = _world(tmp_path, finished)
    sd = torch.load(out / CHECKPOINT_FILE, weights_only=True)
    sd[DIGEST_KEY] = digest if digest is not None else torch.zeros(2)
    torch.save(sd, out / CHECKPOINT_FILE)
    _refused(out, "truncated or corrupted|no content digest")


def test_the_cli_exits_2_with_one_line_on_a_crafted_checkpoint(tmp_path, finished, monkeypatch, capsys):
    out, _ = _world(tmp_path, finished)
    _craft(out, _spill("../victim.pt"))
    (tmp_path / "cfg.yaml").write_text(dump_config(build_config(_scaffold())))
    monkeypatch.setattr(
        sys, "argv", ["fedskew", "run", str(tmp_path / "cfg.yaml"), "--out", str(out), "--resume"]
    )
    with pytest.raises(SystemExit) as info:
        main()
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(
        "error: the checkpoint names a client-state file '../victim.pt'"
    )
    assert err.count("\n") == 1


# ---------------------------------------------------------------------------- the node's state folder
HOSTILE_EXPERIMENTS = ["../../x", "/abs", "a/b", "..", ".", "x\x00y", "x/..", "-rf", "x\n", "a" * 300]


@pytest.mark.parametrize("experiment", HOSTILE_EXPERIMENTS)
def test_a_node_refuses_a_server_supplied_experiment_name_that_is_not_one_folder(tmp_path, experiment):
    root = tmp_path / "states"
    node = Context(
        run_id=1, node_id=5, node_config={"state-dir": str(root)}, state=RecordDict(), run_config={}
    )
    with pytest.raises(FedskewError, match="state folder .* refusing") as err:
        versions_of(node, experiment)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing made, not even the root


@pytest.mark.parametrize("experiment", ["", "3f2a9c0d1e4b5a6c7d8e", "exp-a", "run_1.v2"])
def test_an_honest_experiment_name_is_one_folder_inside_the_state_dir(tmp_path, experiment):
    root = tmp_path / "states"
    node = Context(
        run_id=1, node_id=5, node_config={"state-dir": str(root)}, state=RecordDict(), run_config={}
    )
    store = versions_of(node, experiment)
    assert isinstance(store, DiskVersions)
    store.put(2, 1, b"v")
    assert store.folder.resolve().parent == root.resolve()
    assert all(p.resolve().is_relative_to(root.resolve()) for p in tmp_path.rglob("*"))


def test_a_hostile_server_cannot_make_a_node_write_or_delete_outside_its_state_dir(tmp_path, caplog):
    """The whole path: a server whose train messages name the experiment ``../../victim``, where a node
    would write its clients' state versions and delete older ones (``<folder>/<cid>/<version>.pt``). Every
    node refuses (a failed client under ``engine.on_client_error``); the victim folder keeps its files."""
    victim = tmp_path / "victim" / "0"
    victim.mkdir(parents=True)
    (victim / "0.pt").write_bytes(b"the victim's")
    grid = LoopbackGrid(3)
    for i, context in enumerate(grid.contexts.values()):
        context.node_config["state-dir"] = str(tmp_path / f"node{i}" / "states")
    original = grid.push_messages

    def hostile(messages):  # type: ignore[no-untyped-def]
        messages = list(messages)
        for msg in messages:
            if "job" in msg.content:
                msg.content["job"]["experiment"] = "../../victim"
        return original(messages)

    grid.push_messages = hostile  # type: ignore[method-assign]
    raw = tiny_config("scaffold", rounds=1)
    raw["engine"].update(nodes=3, on_client_error="drop", runtime="flower-simulation")
    before = _files(tmp_path)
    summary = serve(grid, build_config(raw), tmp_path / "out", resume=False, force=False)
    assert summary["skipped_rounds"] == [1] and summary["status"] == "failed"  # every client refused
    assert "names this node's state folder '../../victim', not a single folder name" in caplog.text
    after = _files(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out/")} == before
    assert not any(k.startswith("node") for k in after)  # not even inside the state-dirs
