"""The rules the contract states (src/fedskew/algorithms/base.py), checked for every registered algorithm in
every engine mode it claims, so a new method is covered without edits:

* ``start_local`` and ``init_scratch`` leave the model's weights alone;
* no hook changes the algorithm object, except the caches it declares in ``working_buffers``;
* no client hook mutates its step's payload or state, in the sequential and the vectorized path (nor does
  ``adapt_for_eval``, which the personalized evaluation of every round runs);
* a federation with clients that have no training data and clients that have no test data runs, under
  every evaluation protocol the algorithm supports, with every upload accepted and the empty clients left
  out of the per-client accuracy.
"""

from __future__ import annotations

import math

import pytest

from fedskew.algorithms import ALGORITHMS
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_data, build_simulation
from fedskew.testing import checked
from tests.test_contract import NAMES, tiny_config


def modes_of(name: str) -> list[str]:
    return ["sequential", "vectorized"] if ALGORITHMS.get(name).vectorizable else ["sequential"]


def protocols_of(name: str) -> list[str]:
    cls = ALGORITHMS.get(name)
    return ["personalized"] if cls.requires_personalized_eval else ["global", "personalized"]


@pytest.mark.parametrize(("name", "mode"), [(n, m) for n in NAMES for m in modes_of(n)])
def test_client_hooks_keep_the_rules(name, mode, caplog):
    cls = ALGORITHMS.get(name)
    with ALGORITHMS.replaced(name, checked(cls)):
        sim = build_simulation(build_config(tiny_config(name, rounds=2, mode=mode)))
        with caplog.at_level("WARNING", logger="fedskew.engine"):
            for _ in range(2):  # round 2 sees real prototypes, control variates, personal state ...
                assert sim.run_round().record["rejected"] == 0
    assert sim.executor is not None and sim.executor.name == mode
    assert "sequentially" not in caplog.text  # the vectorized path really ran the checked hooks


#: 12 digits clients, Dirichlet(0.02), seed 1: client 2 has no training (and no test) data, client 6 has
#: four training samples and no test data
EMPTY = {"num_clients": 12, "partition": {"name": "dirichlet", "alpha": 0.02, "min_size": 0}}


def empty_client_config(name: str, protocol: str, mode: str) -> dict:
    cfg = tiny_config(name, rounds=2, mode=mode)
    cfg["seed"] = 1
    cfg["data"].update(EMPTY)
    cfg["client"]["fraction"] = 1.0
    cfg["eval"] = {"protocol": protocol, "every": 1}
    return cfg


def test_the_empty_client_federation_has_empty_clients():
    data = build_data(build_config(empty_client_config("fedavg", "global", "sequential")))
    train = [len(t) for t in data.train_idx]
    test = [len(t) for t in data.test_idx]
    assert train[2] == 0 and test[2] == 0  # no data at all
    assert train[6] > 0 and test[6] == 0  # trains, cannot be tested


@pytest.mark.parametrize(
    ("name", "protocol", "mode"), [(n, p, m) for n in NAMES for p in protocols_of(n) for m in modes_of(n)]
)
def test_clients_without_training_or_test_data_take_part(name, protocol, mode):
    sim = build_simulation(build_config(empty_client_config(name, protocol, mode)))
    for _ in range(2):
        record = sim.run_round().record
        assert record["rejected"] == 0 and math.isfinite(record["accuracy"]) and math.isfinite(record["loss"])
        assert math.isfinite(record["train_loss"]) or record["round_bytes_up"] == 0
        if protocol == "personalized":  # the clients without test data have no accuracy, the others do
            clients = record["accuracy_clients"]
            assert clients[2] is None and clients[6] is None
            assert all(a is not None for c, a in enumerate(clients) if c not in (2, 6))
