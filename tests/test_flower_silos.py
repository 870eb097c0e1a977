"""Node-local data (``data.source: nodes``): each node reads only its own image folder, as one client or as
k clients split locally; the nodes' label spaces and input shapes are checked before any training, and a
mismatch is one line naming the node. Through fedskew's Flower apps in process (messages round-tripped
through Flower's wire format, tests/flower_loopback.py) the ServerApp, which holds no sample, reports the
embedded engine's metrics on the same folders joined (a domain-like natural partition) within 1e-5. The
real SuperLink + SuperNode deployment of the same is in tests/test_flower_deployment.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from fedskew.data.nodes import NodeManifest, check_manifests
from fedskew.errors import ConfigError, DataError
from fedskew.experiment.build import build_data
from fedskew.experiment.config import build_config
from fedskew.flower.server import serve
from tests.flower_loopback import LoopbackGrid
from tests.silo_folders import LABELS, MIXES, write_silos
from tests.test_flower import ServerKilled, assert_same_metrics, embedded, records


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The three silos' folders and a fourth, the server's (all ten classes, disjoint images)."""
    return write_silos(tmp_path_factory.mktemp("silos"), (*MIXES, tuple(range(10))))


@pytest.fixture(scope="module")
def silos(folders: list[Path]) -> list[Path]:
    return folders[:3]


def silo_config(
    roots: list[Path], algorithm: str = "fedavg", clients: int = 1, **data: Any
) -> dict[str, Any]:
    """Three silos of tests/silo_folders.py, one label space declared, 2 rounds of a small MLP."""
    return {
        "seed": 3,
        "rounds": 2,
        "data": {
            "dataset": "imagefolder",
            "options": {"path": "digits"},
            "source": "nodes",
            "nodes": {"roots": [str(r) for r in roots], "classes": LABELS, "clients": clients},
            **data,
        },
        "model": {"name": "mlp_mpfedcl"},
        "algorithm": {"name": algorithm},
        "client": {"epochs": 1, "batch_size": 16, "lr": 0.05},
        "eval": {"protocol": "global"},
        "engine": {"nodes": len(roots), "mode": "sequential"},
        "checkpoint": {"every": 1},
    }


def silo_grid(roots: list[Path]) -> LoopbackGrid:
    """A loopback grid whose node ``i`` has ``roots[i]`` as its own data root (node config ``data-root``)."""
    grid = LoopbackGrid(len(roots))
    for context, root in zip(grid.contexts.values(), roots, strict=True):
        context.node_config["data-root"] = str(root)
    return grid


def on_silos(
    raw: dict[str, Any], out: Path, grid: LoopbackGrid | None = None, resume: bool = False
) -> list[dict[str, Any]]:
    """``raw`` through the Flower apps, each node given its own data root in its node config and the
    server's config naming no data root at all (``data.nodes.roots`` emptied: the deployment form)."""
    grid = grid or silo_grid(raw["data"]["nodes"]["roots"])
    served = {**raw, "data": {**raw["data"], "nodes": {**raw["data"]["nodes"], "roots": []}}}
    cfg = build_config({**served, "engine": {**raw["engine"], "runtime": "flower-deployment"}})
    serve(grid, cfg, out, resume=resume, force=False)
    return records(out)


def test_nodes_are_clients_of_their_own_folders_joined_as_a_natural_partition(silos):
    data = build_data(build_config(silo_config(silos)))
    assert data.num_clients == 3 and data.dataset.class_names == LABELS
    counts = data.class_counts()
    for i, mix in enumerate(MIXES):  # each client holds exactly its silo's classes, 24 images each
        assert counts[i].nonzero().flatten().tolist() == list(mix)
        assert set(counts[i][list(mix)].tolist()) == {24}
        assert torch.unique(data.dataset.domain_train[data.train_idx[i]]).tolist() == [i]
        assert len(data.test_idx[i]) == 8 * len(mix)  # a one-client node is tested on its whole test set
    two = build_data(
        build_config(silo_config(silos, clients=2, partition={"name": "dirichlet", "alpha": 0.5}))
    )
    assert two.num_clients == 6
    sizes = two.client_sizes.view(3, 2).sum(1)  # each node's samples split over its two clients, no more
    assert sizes.tolist() == [24 * len(m) for m in MIXES]


@pytest.mark.parametrize(
    ("algorithm", "protocol", "clients", "central"),
    [
        ("fedavg", "global", 1, False),
        ("ditto", "personalized", 1, True),
        ("fedavg", "personalized", 2, False),
        ("fedper", "personalized", 1, False),
    ],
)
def test_the_server_without_data_reports_the_embedded_metrics_of_the_joined_folders(
    folders, silos, tmp_path, algorithm, protocol, clients, central
):
    raw = silo_config(silos, algorithm, clients)
    raw["eval"]["protocol"] = protocol
    raw["data"]["val_fraction"] = 0.2
    if central:  # the server is given a test set of its own: scored centrally beside the nodes' metrics
        raw["data"]["nodes"]["server_root"] = str(folders[3])
    got = on_silos(raw, tmp_path / "flower")
    assert_same_metrics(got, embedded(raw, tmp_path / "embedded"))
    assert got[-1]["accuracy"] > 0.3  # it learned from the nodes' data (10 classes: chance is 0.1)
    assert ("central_accuracy" in got[-1]) == central


def test_a_node_outside_the_declared_label_space_fails_before_training_naming_it(silos, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(silos[2], odd)
    (odd / "digits" / "train" / "9").rename(odd / "digits" / "train" / "nine")
    raw = silo_config([silos[0], silos[1], odd])
    with pytest.raises(
        DataError, match=r"^node 2 \(data root .*odd\): classes \['nine'\] are not in the label"
    ):
        on_silos(raw, tmp_path / "out")
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    undeclared = silo_config(silos)
    undeclared["data"]["nodes"]["classes"] = None
    with pytest.raises(
        DataError, match=r"^node 1 \(data root .*silo1\) has the label space .*missing \['0', '1', '2'\]"
    ):
        build_data(build_config(undeclared))


def _manifest(
    index: int, classes: tuple[str, ...], shape: tuple[int, ...], counts: list[int]
) -> NodeManifest:
    return NodeManifest(index, f"root{index}", classes, shape, torch.tensor([counts]), (1,), (0,), 1)


def test_manifests_must_agree_on_shape_and_hold_samples():
    ab = ("a", "b")
    check_manifests([_manifest(0, ab, (1, 8, 8), [3, 0]), _manifest(1, ab, (1, 8, 8), [0, 2])], 1)
    with pytest.raises(
        DataError, match=r"^node 1 \(root1\) has inputs of shape \(3, 8, 8\), node 0 \(1, 8, 8\)"
    ):
        check_manifests([_manifest(0, ab, (1, 8, 8), [3, 0]), _manifest(1, ab, (3, 8, 8), [1, 1])], 1)
    with pytest.raises(DataError, match=r"^node 1 \(root1\) has no training samples"):
        check_manifests([_manifest(0, ab, (1, 8, 8), [3, 0]), _manifest(1, ab, (1, 8, 8), [0, 0])], 1)


def test_node_source_configs_fail_in_one_line(silos):
    with pytest.raises(ConfigError, match=r"data.num_clients.*engine.nodes x data.nodes.clients = 3"):
        build_config({**silo_config(silos), "data": {**silo_config(silos)["data"], "num_clients": 4}})
    raw = silo_config(silos)
    raw["data"]["nodes"]["roots"] = []
    with pytest.raises(ConfigError, match="data.nodes.roots' is required on engine.runtime=embedded"):
        build_config(raw)
    raw = silo_config(silos[:2])
    raw["engine"]["nodes"] = 3
    with pytest.raises(ConfigError, match="2 data roots for engine.nodes=3"):
        build_config(raw)


def test_a_crashed_server_resumes_the_silos_run_from_its_checkpoint(silos, tmp_path):
    """Ditto's personal models live on the nodes; the server dies during round 3 and is resumed from its
    round-2 checkpoint (it asks the nodes for their manifests again): the uninterrupted run's metrics."""
    raw = silo_config(silos, "ditto")
    raw["rounds"], raw["eval"]["protocol"] = 3, "personalized"
    reference = embedded(raw, tmp_path / "e")
    out, grid = tmp_path / "f", silo_grid(silos)
    original = grid.pull_messages

    def pull(ids):
        if (out / "metrics.jsonl").exists() and len(records(out)) == 2:  # round 3 is running
            raise ServerKilled
        return original(ids)

    grid.pull_messages = pull  # type: ignore[method-assign]
    with pytest.raises(ServerKilled):
        on_silos(raw, out, grid)
    grid.pull_messages = original  # type: ignore[method-assign]
    assert_same_metrics(on_silos(raw, out, grid, resume=True), reference)
