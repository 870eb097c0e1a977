"""A Flower node's data cached on its disk (fedskew.flower.node_cache): keyed by config, data root and node
index; a corrupt or foreign file is rebuilt, never trusted; the runtime built from the cached data trains
to the same upload and holds the same evaluation splits as one built from the full partition."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from fedskew.algorithms.base import RoundInfo
from fedskew.engine.assembly import initial_server
from fedskew.engine.client import train_client
from fedskew.experiment.build import build_data
from fedskew.experiment.config import build_config, dump_config
from fedskew.flower.node import NodeRuntime, build_node
from fedskew.flower.node_cache import cache_key, compact, node_data, read
from tests.test_contract import tiny_config

NODES = 3


def _cfg(**client: float):
    raw = tiny_config("fedprox")
    raw["engine"]["nodes"] = NODES
    raw["data"]["val_fraction"] = 0.2  # the cache must carry validation rows too
    raw["client"].update(client)
    return build_config(raw)


def _owned(index: int):
    return lambda data: [c for c in range(data.num_clients) if c % NODES == index]


class Builds:
    """A builder of the full partition that counts its calls."""

    def __init__(self, cfg) -> None:
        self.cfg, self.calls = cfg, 0

    def __call__(self):
        self.calls += 1
        return build_data(self.cfg)


def test_the_key_changes_with_the_config_the_data_root_and_the_node():
    text = dump_config(_cfg())
    key = cache_key(text, "/data", 1)
    assert cache_key(text, "/data", 1) == key
    assert cache_key(dump_config(_cfg(lr=0.07)), "/data", 1) != key
    assert cache_key(text, "/other", 1) != key
    assert cache_key(text, "/data", 2) != key


def test_a_second_process_reads_the_data_instead_of_building_it(tmp_path):
    cfg = _cfg()
    builds = Builds(cfg)
    first, was_read = node_data(builds, _owned(1), "k", tmp_path)
    assert (builds.calls, was_read) == (1, False)
    second, was_read = node_data(builds, _owned(1), "k", tmp_path)
    assert (builds.calls, was_read) == (1, True)
    assert torch.equal(second.dataset.x_train, first.dataset.x_train)
    assert torch.equal(second.class_counts(), first.class_counts())


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "another key", "garbage"])
def test_a_corrupt_or_foreign_file_is_rebuilt_and_rewritten(damage, tmp_path):
    cfg = _cfg()
    builds = Builds(cfg)
    node_data(builds, _owned(0), "k", tmp_path)
    path = tmp_path / "k.pt"
    blob = bytearray(path.read_bytes())
    if damage == "flip a byte":
        blob[len(blob) // 2] ^= 0xFF
        path.write_bytes(bytes(blob))
    elif damage == "truncate":
        path.write_bytes(bytes(blob[: len(blob) // 2]))
    elif damage == "another key":
        node_data(builds, _owned(0), "other", tmp_path)
        path.write_bytes((tmp_path / "other.pt").read_bytes())  # a valid file, for another key
    else:
        path.write_bytes(b"not a cache file")
    calls = builds.calls
    assert read(path, "k") is None
    _, was_read = node_data(builds, _owned(0), "k", tmp_path)
    assert (builds.calls, was_read) == (calls + 1, False)
    assert read(path, "k") is not None  # rewritten


def test_data_that_is_not_tensors_and_plain_values_is_built_but_not_cached(tmp_path):
    cfg = _cfg()

    def build():
        data = build_data(cfg)
        ds = dataclasses.replace(data.dataset, meta={"where": Path("/somewhere")})
        return dataclasses.replace(data, dataset=ds)

    data, was_read = node_data(build, _owned(0), "k", tmp_path)
    assert not was_read and data.num_clients == cfg.data.num_clients
    assert not (tmp_path / "k.pt").exists()


def _upload(node: NodeRuntime, cid: int) -> dict[str, torch.Tensor]:
    alg, seed = node.rt.algorithm, node.cfg.seed
    torch.manual_seed(0)
    payload = alg.broadcast(initial_server(alg, node.rt.models, seed), RoundInfo(1, cid, seed))
    outcome = train_client(node.rt, cid, 1, payload, node.rt.initial_state(cid))
    assert outcome.upload is not None
    return outcome.upload.payload.arrays


@pytest.mark.parametrize("index", [0, 2])
def test_a_runtime_from_cached_data_trains_and_evaluates_as_one_from_the_full_partition(index, tmp_path):
    cfg = _cfg()
    node_data(Builds(cfg), _owned(index), "k", tmp_path)  # written by a first process
    cached, was_read = node_data(Builds(cfg), _owned(index), "k", tmp_path)
    assert was_read
    built, loaded = build_node(cfg, index), build_node(cfg, index, cached)
    assert loaded.owned == built.owned == [c for c in range(cfg.data.num_clients) if c % NODES == index]
    for cid in built.owned:
        a, b = built.splits[cid], loaded.splits[cid]
        for x, y in ((a.x_test, b.x_test), (a.y_test, b.y_test), (a.x_val, b.x_val), (a.y_val, b.y_val)):
            assert torch.equal(x, y)
        assert built.rt.data.size(cid) == loaded.rt.data.size(cid) > 0
        ua, ub = _upload(built, cid), _upload(loaded, cid)
        assert ua.keys() == ub.keys()
        for k in ua:
            torch.testing.assert_close(ua[k], ub[k], rtol=1e-6, atol=1e-7)
    assert torch.equal(built.rt.data.class_counts, loaded.rt.data.class_counts)


def test_compact_keeps_only_the_nodes_rows_but_every_clients_histogram():
    cfg = _cfg()
    data = build_data(cfg)
    small = compact(data, [1, 4])
    sizes = [len(data.train_idx[c]) + len(data.val_idx[c]) for c in (1, 4)]
    assert len(small.dataset.y_train) == sum(sizes)
    kept = [len(t) if c in (1, 4) else 0 for c, t in enumerate(data.train_idx)]
    assert [len(t) for t in small.train_idx] == kept
    assert torch.equal(small.class_counts(), data.class_counts())
    for c in (1, 4):
        assert torch.equal(small.dataset.x_train[small.train_idx[c]], data.dataset.x_train[data.train_idx[c]])
        assert torch.equal(small.dataset.x_test[small.test_idx[c]], data.dataset.x_test[data.test_idx[c]])
        assert torch.equal(small.dataset.y_train[small.val_idx[c]], data.dataset.y_train[data.val_idx[c]])


def test_an_unwritable_cache_folder_only_disables_the_cache(tmp_path):
    cfg = _cfg()
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    builds = Builds(cfg)
    for _ in range(2):
        data, was_read = node_data(builds, _owned(0), "k", blocker)
        assert not was_read and data.num_clients == cfg.data.num_clients
    assert builds.calls == 2


def test_a_local_deployment_shares_the_cores_and_a_node_applies_its_threads(tmp_path, monkeypatch):
    from flwr.app import Context, RecordDict

    from fedskew.flower.deploy import node_threads
    from fedskew.flower.node import timed_node_runtime

    monkeypatch.setattr("fedskew.threads.busy_cores", lambda *a: 0.0)  # a quiet machine (fedskew/threads.py)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert node_threads(1) == len(os.sched_getaffinity(0))
    assert node_threads(10_000) == 1
    assert node_threads(10_000, requested=3) == 3  # engine.threads pins it
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path))
    before = torch.get_num_threads()
    node_config = {"partition-id": 1, "threads": 1}
    context = Context(run_id=1, node_id=1, node_config=node_config, state=RecordDict(), run_config={})
    try:
        node, _ = timed_node_runtime({"config": dump_config(_cfg())}, context)
        assert torch.get_num_threads() == 1 and node.owned == [1, 4]
    finally:
        torch.set_num_threads(before)
