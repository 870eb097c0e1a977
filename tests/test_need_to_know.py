"""Class counts on a need-to-know basis (issue 51, item 6): a node's algorithm context holds only what its
method declares its client-side hooks read (``Algorithm.federation_counts``: ``own``, ``sizes``,
``classes``); the federation record a node is sent carries only that; and no method reads more than it
declares: every registered method's client trains bit-identically from the masked context and the full
one, while a method declaring less than it reads is caught."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

pytest.importorskip("flwr")

from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms.base import RoundInfo
from fedskew.engine.assembly import ClientMeta
from fedskew.engine.client import train_client
from fedskew.engine.evaluation import load_eval_weights, score
from fedskew.engine.need_to_know import LEVELS, covers, node_view
from fedskew.errors import ConfigError, FedskewError
from fedskew.experiment.build import algorithm_of, build_data
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from fedskew.flower.node import build_node
from fedskew.flower.silos import federation_from, federation_record, node_federation, record_level
from fedskew.testing import fingerprint
from tests.flower_loopback import LoopbackGrid
from tests.silo_folders import write_silos
from tests.test_contract import NAMES, tiny_config
from tests.test_flower import assert_same_metrics, embedded
from tests.test_flower_silos import on_silos, silo_config


def hand_meta() -> ClientMeta:
    counts = torch.tensor([[3, 0, 1], [0, 5, 0], [2, 2, 2]])
    return ClientMeta(num_clients=3, num_classes=3, in_shape=(1, 2), class_counts=counts)


# ---------------------------------------------------------------- the view
def test_each_level_discloses_what_it_names_and_no_more():
    meta = hand_meta()
    own = node_view(meta, [1], "own")
    assert own.class_counts.tolist() == [[0, 0, 0], [0, 5, 0], [0, 0, 0]]
    assert own.client_sizes.tolist() == [0, 5, 0]
    sizes = node_view(meta, [1], "sizes")
    assert sizes.class_counts.tolist() == [[0, 0, 0], [0, 5, 0], [0, 0, 0]]
    assert sizes.client_sizes.tolist() == [4, 5, 6]
    full = node_view(meta, [1], "classes")
    assert full.class_counts.tolist() == meta.class_counts.tolist() and full.client_sizes.tolist() == [
        4,
        5,
        6,
    ]
    assert node_view(meta, [0, 2], "own").client_sizes.tolist() == [4, 0, 6]
    assert node_view(meta, [], "own").client_sizes.tolist() == [0, 0, 0]  # a node owning no client
    assert meta.class_counts.tolist() == [[3, 0, 1], [0, 5, 0], [2, 2, 2]]  # the server's meta untouched
    assert (own.num_clients, own.num_classes, own.in_shape) == (3, 3, (1, 2))
    assert [covers(a, b) for a in LEVELS for b in LEVELS] == [
        True, False, False, True, True, False, True, True, True,
    ]  # fmt: skip


def test_an_unknown_level_or_a_foreign_client_is_one_line():
    with pytest.raises(ConfigError, match=r"federation_counts='all': allowed levels are own, sizes, classes"):
        node_view(hand_meta(), [0], "all")
    with pytest.raises(FedskewError, match=r"clients \[3, -1\]|clients \[-1, 3\]") as err:
        node_view(hand_meta(), [0, 3, -1], "own")
    assert "\n" not in str(err.value)


def test_every_built_in_method_declares_a_level_and_only_fedgen_and_fedent_more_than_their_own():
    declared = {n: ALGORITHMS.get(n).federation_counts for n in NAMES}
    assert set(declared.values()) <= set(LEVELS)
    assert {n: v for n, v in declared.items() if v != "own"} == {"fedgen": "classes", "fedent": "sizes"}


# ---------------------------------------------------------------- the record a node is sent
@pytest.mark.parametrize("need", LEVELS)
def test_a_nodes_record_carries_its_view_only_and_reads_back_as_it(need):
    meta = hand_meta()
    record = federation_record(meta, [1], need)
    back = federation_from(record)
    assert back is not None and record_level(record) == need
    view = node_view(meta, [1], need)
    assert torch.equal(back.class_counts, view.class_counts) and torch.equal(
        back.client_sizes, view.client_sizes
    )
    rows = {"own": [1], "sizes": [1], "classes": [0, 1, 2]}[need]
    assert record["fed_rows"] == rows and len(record["fed_counts"]) == 3 * len(rows)
    assert ("fed_sizes" in record) == (need == "sizes")


def test_a_record_without_rows_or_level_is_the_whole_federation():
    legacy = {
        "fed_classes": 3,
        "fed_shape": [1, 2],
        "fed_counts": hand_meta().class_counts.flatten().tolist(),
    }
    back = federation_from(legacy)
    assert back is not None and record_level(legacy) == "classes"
    assert back.class_counts.tolist() == hand_meta().class_counts.tolist()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"fed_rows": [1, 7]}, "not distinct clients"),
        ({"fed_rows": [1, 1]}, "not distinct clients"),
        ({"fed_rows": [-1, 2]}, "not distinct clients"),
        ({"fed_counts": [0, 1, 0]}, "3 count rows for 2 clients|1 count rows for 2 clients"),
        ({"fed_counts": [0, -4, 0, 1, 1, 1]}, "negative counts"),
        ({"fed_sizes": [1, 2]}, "2 sizes for 3 clients"),
        ({"fed_counts": [10**30, 0, 0, 0, 0, 0]}, "malformed"),
        ({"fed_counts": ["x"] * 6}, "malformed"),
        ({"fed_shape": "none"}, "malformed"),
    ],
)
def test_a_crafted_record_is_refused_in_one_line(change, problem):
    record = {**federation_record(hand_meta(), [0, 2], "sizes"), **change}
    with pytest.raises(FedskewError, match=problem) as err:
        federation_from(record)
    assert "\n" not in str(err.value) and "federation record" in str(err.value)


# ---------------------------------------------------------------- the node builds from its view
def node_config(name: str) -> Any:
    raw = tiny_config(name, rounds=1)
    raw["engine"]["nodes"] = 3
    return build_config(raw)


@pytest.mark.parametrize(("name", "need"), [("fedavg", "own"), ("fedent", "sizes"), ("fedgen", "classes")])
def test_a_partition_node_builds_its_context_from_its_declared_view(name, need):
    cfg = node_config(name)
    node = build_node(cfg, 1)
    ctx = node.rt.algorithm.ctx
    full = node.rt.data.class_counts  # the partition node computed every histogram: the context holds less
    view = node_view(ClientMeta(6, 10, (64,), full), node.owned, need)
    assert node.owned == [1, 4] and torch.equal(ctx.class_counts, view.class_counts)
    assert torch.equal(ctx.client_sizes, view.client_sizes)
    others = [c for c in range(6) if c not in node.owned]
    assert bool(ctx.class_counts[others].any()) == (need == "classes")
    assert bool(ctx.client_sizes[others].any()) == (need != "own")


def test_a_node_masks_a_record_disclosing_more_and_refuses_one_disclosing_less(tmp_path):
    roots = write_silos(tmp_path, per_class=6)
    raw = silo_config(roots, "fedavg", clients=2, partition={"name": "dirichlet", "alpha": 0.5})
    cfg = build_config(raw)
    meta = ClientMeta.of(build_data(cfg))
    node = build_node(cfg, 1, str(roots[1]), federation_from(federation_record(meta)), None, "classes")
    assert torch.equal(node.rt.algorithm.ctx.class_counts, node_view(meta, [2, 3], "own").class_counts)
    gen = build_config({**raw, "algorithm": {"name": "fedgen"}})
    own = node_federation(meta, gen, 1, "own")
    with pytest.raises(FedskewError, match="discloses 'own' counts; fedgen needs 'classes'") as err:
        build_node(gen, 1, str(roots[1]), federation_from(own), None, record_level(own))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="fed_need='everything': allowed levels are own, sizes, classes"):
        build_node(gen, 1, str(roots[1]), federation_from(own), None, "everything")


# ---------------------------------------------------------------- no method reads more than it declares
def client_side(name: str) -> tuple[Any, Any]:
    """A round-2 client of ``name`` trained and evaluated twice from the same inputs: with the full context
    (the embedded run's algorithm) and with the view of a node owning that client alone (the method's
    declared level): fingerprints."""
    cfg = build_config(tiny_config(name, rounds=2))
    sim = build_simulation(cfg)
    try:
        sim.run_round()
        rt, alg, r = sim.executor.runtime, sim.algorithm, 2
        cid = int(sim.schedule[r - 1][0])
        ctx = alg.ctx
        meta = ClientMeta(ctx.num_clients, ctx.num_classes, ctx.in_shape, ctx.class_counts, ctx.assets)
        masked_alg, models = algorithm_of(cfg, node_view(meta, [cid], type(alg).federation_counts))
        masked = dataclasses.replace(rt, algorithm=masked_alg, models=models)
        payload, state = alg.broadcast(sim.server, RoundInfo(r, cid, sim.seed)), sim.client_state(cid)
        prints = []
        for runtime in (rt, masked):
            torch.manual_seed(0)
            out = train_client(runtime, cid, r, payload, state)
            assert out.upload is not None and out.state is not None
            model = runtime.models.model_for(cid)
            info = RoundInfo(r, cid, sim.seed)
            load_eval_weights(runtime.algorithm, model, payload, out.state, info, lambda: rt.data.view(cid))
            view = rt.data.view(cid)
            with torch.no_grad():
                s = score(runtime.algorithm, model, payload, out.state, view.x, view.y, 64, lambda x: x)
            seen = fingerprint(runtime.initial_state(cid)), fingerprint((s.correct, s.loss))
            prints.append((fingerprint(out.upload), fingerprint(out.state), repr(float(out.loss)), seen))
        return prints[0], prints[1]
    finally:
        sim.close()


@pytest.mark.parametrize("name", NAMES)
def test_no_method_reads_undeclared_counts_on_the_client_side(name):
    full, masked = client_side(name)
    assert full == masked, f"{name} reads federation counts beyond federation_counts on the client side"


@pytest.mark.parametrize(("name", "less"), [("fedgen", "sizes"), ("fedent", "own")])
def test_declaring_less_than_a_method_reads_is_caught(name, less, monkeypatch):
    """The check above can fail: FedGen's label prior and FedEnt's θ_i change the upload when the node's
    view lacks them, so each declaration is the least its method needs."""
    monkeypatch.setattr(ALGORITHMS.get(name), "federation_counts", less)
    full, masked = client_side(name)
    assert full[0] != masked[0]


# ---------------------------------------------------------------- end to end, through the Flower apps
class Recording(LoopbackGrid):
    """A loopback grid noting, per node index, the job records its node was sent."""

    def __init__(self, nodes: int) -> None:
        super().__init__(nodes)
        self.jobs: dict[int, list[dict[str, Any]]] = {}

    def push_messages(self, messages):  # type: ignore[no-untyped-def, override]
        messages = list(messages)
        for msg in messages:
            context = self.contexts.get(msg.metadata.dst_node_id)
            if context is not None and "job" in msg.content.config_records:
                index = int(context.node_config["partition-id"])
                self.jobs.setdefault(index, []).append(dict(msg.content.config_records["job"]))
        return super().push_messages(messages)


@pytest.mark.parametrize(("name", "need"), [("fedavg", "own"), ("fedent", "sizes"), ("fedgen", "classes")])
def test_each_node_is_sent_only_its_declared_view_and_the_run_is_the_embedded_one(name, need, tmp_path):
    roots = write_silos(tmp_path / "silos", per_class=8)
    raw = silo_config(roots, name, clients=2, partition={"name": "dirichlet", "alpha": 0.5})
    grid = Recording(3)
    for context, root in zip(grid.contexts.values(), roots, strict=True):
        context.node_config["data-root"] = str(root)
    got = on_silos(raw, tmp_path / "flower", grid)
    assert_same_metrics(got, embedded(raw, tmp_path / "embedded"))
    for index, jobs in grid.jobs.items():
        carrying = [j for j in jobs if "fed_counts" in j]
        assert carrying and all(j.get("fed_need") == need for j in carrying), index
        for job in carrying:
            view = federation_from(job)
            assert view is not None
            others = [c for c in range(6) if c // 2 != index]
            assert bool(view.class_counts[others].any()) == (need == "classes"), index
            assert bool(view.client_sizes[others].any()) == (need != "own"), index


def test_a_plugin_declaring_an_unknown_level_is_refused_when_its_config_is_built():
    """Checked with the config, in every runtime (an embedded run never builds a node's view)."""
    from fedskew.algorithms.base import ALGORITHMS
    from fedskew.algorithms.fedavg import FedAvg
    from fedskew.errors import ConfigError
    from fedskew.experiment.config import build_config
    from tests.test_contract import tiny_config

    class Everything(FedAvg):
        federation_counts = "all"

    with ALGORITHMS.replaced("_everything", Everything), pytest.raises(ConfigError) as err:
        build_config(tiny_config("fedavg") | {"algorithm": {"name": "_everything"}})
    assert str(err.value) == (
        "algorithm '_everything': federation_counts='all': allowed levels are own, sizes, classes"
    )
