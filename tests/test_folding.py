"""FedAvg's mean folded as uploads arrive (``engine.fold_uploads``): the same bits as the held-list mean, in
this process and across worker processes, with a rejected client falling back to the unfolded round."""

from __future__ import annotations

import torch
from benchmarks.faults import faulty_fedavg

from fedskew.algorithms.base import ALGORITHMS, Payload, Upload, sample_weights, weighted_average
from fedskew.engine.fold_workers import interleaved_shares
from fedskew.engine.folding import Folder, MeanFold, folds_uploads
from fedskew.engine.types import ClientOutcome
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation
from tests.conftest import digits_config


def _state(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(7, 5, generator=g),
        "b": torch.randn(5, generator=g).double(),
        "num_batches_tracked": torch.randint(0, 50, (), generator=g),
    }


def _outcome(cid: int, n: int, state: dict[str, torch.Tensor]) -> ClientOutcome:
    out = ClientOutcome(cid=cid, bytes_down=0)
    out.accept(Upload(cid, n, Payload(arrays={f"model.{k}": v for k, v in state.items()}, config={"c": 1.0})))
    return out


def _uploads(counts: list[int]) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(len(counts))
    cids = [10 + 3 * i for i in range(len(counts))]
    return cids, [_state(g) for _ in counts]


def _held_mean(cids, states, counts) -> dict[str, torch.Tensor]:
    ups = [
        Upload(c, n, Payload(arrays={f"model.{k}": v for k, v in s.items()}))
        for c, s, n in zip(cids, states, counts, strict=True)
    ]
    return weighted_average([u.payload.arrays for u in ups], sample_weights(ups))  # by array name


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_the_fold_is_the_held_mean_bit_for_bit_in_any_arrival_order():
    for counts in ([5, 1, 9, 3, 0, 7], [0, 0, 0], [4]):
        cids, states = _uploads(counts)
        want = _held_mean(cids, states, counts)
        for order in (range(len(cids)), reversed(range(len(cids)))):  # arrivals out of order are held
            folder = Folder(MeanFold.plan(cids, counts))
            receipts = [folder.add(_outcome(cids[i], counts[i], states[i]), i) for i in order]
            assert _bit_equal(folder.mean(), want), counts
            assert all(r.upload.payload.arrays == {} for r in receipts)
            assert all(r.upload.payload.config == {"c": 1.0} for r in receipts)
            assert {r.bytes_up for r in receipts} == {7 * 5 * 4 + 5 * 8 + 8 + 8}  # traffic kept


def test_a_rejected_or_miscounted_client_abandons_the_fold():
    cids, states = _uploads([3, 4, 5])
    folder = Folder(MeanFold.plan(cids, [3, 4, 5]))
    folder.add(_outcome(cids[0], 3, states[0]), 0)
    rejected = ClientOutcome(cid=cids[1], bytes_down=0)
    assert folder.add(rejected, 1) is rejected and not folder.valid and folder.mean() is None
    folder = Folder(MeanFold.plan(cids, [3, 4, 5]))
    folder.add(_outcome(cids[0], 2, states[0]), 0)  # planned 3 samples
    assert folder.mean() is None
    assert MeanFold.plan([1, 1], [2, 2]) is None  # a client sampled twice has no single weight


def test_interleaved_shares_partition_the_round_in_order_with_balanced_costs():
    costs = [float(c) for c in torch.randint(1, 50, (101,), generator=torch.Generator().manual_seed(3))]
    for n in (1, 2, 3, 7):
        shares = interleaved_shares(costs, n)
        assert sorted(i for s in shares for i in s) == list(range(len(costs)))
        assert all(s == sorted(s) for s in shares)
        loads = [sum(costs[i] for i in s) for s in shares]
        assert max(loads) - min(loads) <= max(costs)
    assert interleaved_shares([1.0], 4) == [[0]]


def test_declared_mean_methods_are_folded():
    folded = [n for n in ALGORITHMS.names() if folds_uploads(ALGORITHMS.get(n).__new__(ALGORITHMS.get(n)))]
    means = {"fedavg", "fedprox", "moon", "fedper", "ditto", "fedavgm", "fedadam", "scaffold", "fednova"}
    assert means <= set(folded)
    assert not {"fedproto", "qfedavg", "local", "fedfomo", "fedent"} & set(folded)


def _cfg(alg: str = "fedavg", **engine) -> dict:
    return digits_config(
        rounds=3,
        algorithm={"name": alg},
        data={"dataset": "digits", "num_clients": 9, "partition": {"name": "dirichlet", "alpha": 0.5}},
        model={"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
        client={"epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.5, "fraction": 0.8},
        engine={"mode": "sequential", "workers": 1, **engine},
    )


def _run(cfg: dict, rounds: int = 3) -> tuple[list[dict], dict[str, torch.Tensor]]:
    sim = build_simulation(build_config(cfg))
    try:
        records = [sim.run_round().record for _ in range(rounds)]
        return records, sim.server["weights"]
    finally:
        sim.close()


def _strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in records]


def test_folded_and_held_runs_agree_bit_for_bit_in_process_and_in_workers():
    for engine in ({"workers": 1}, {"workers": 2}):
        for alg in ("fedavg", "ditto"):  # ditto: clients with state take fixed shares in the workers
            held = _run(_cfg(alg, fold_uploads=False, **engine))
            folded = _run(_cfg(alg, **engine))
            assert _strip(folded[0]) == _strip(held[0]), (alg, engine)
            assert _bit_equal(folded[1], held[1]), (alg, engine)


def test_a_rejected_client_trains_the_round_again_unfolded():
    for workers in (1, 2):
        with faulty_fedavg("nan", {1, 4}, round_=2):
            held = _run(_cfg(on_client_error="drop", fold_uploads=False, workers=workers))
            folded = _run(_cfg(on_client_error="drop", workers=workers))
        assert _strip(folded[0]) == _strip(held[0]) and _bit_equal(folded[1], held[1])
        assert folded[0][1]["rejected"] >= 1
