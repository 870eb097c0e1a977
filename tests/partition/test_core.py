"""Every scheme: structural properties (hypothesis), dispatch errors, config-validatable signatures."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedskew.data.base import PARTITIONERS
from fedskew.data.partition import RESERVED
from fedskew.errors import ConfigError, DataError
from tests.partition.strategies import FEASIBLE, SETTINGS, balanced, problems, run


@SETTINGS
@given(problem=problems(), spec=st.sampled_from(FEASIBLE))
def test_disjoint_sorted_in_bounds_and_deterministic(problem, spec):
    labels, num_classes, num_clients, seed, domains = problem
    fn = PARTITIONERS.get(spec["name"])
    opts = {k: v for k, v in spec.items() if k != "name"}
    parts = fn(labels, num_clients, seed, num_classes=num_classes, domains=domains, **opts)
    assert len(parts) == num_clients
    flat = np.concatenate(parts)
    assert all(p.dtype == np.int64 for p in parts)
    assert all(np.all(np.diff(p) > 0) for p in parts)  # sorted, no duplicates
    assert len(np.unique(flat)) == len(flat)  # disjoint
    assert flat.size == 0 or (flat.min() >= 0 and flat.max() < len(labels))
    again = fn(labels, num_clients, seed, num_classes=num_classes, domains=domains, **opts)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@pytest.mark.parametrize(
    ("spec", "n_clients", "needle"),
    [
        ({"name": "iid"}, 301, "exceeds the 300 samples"),
        ({"name": "nway_kshot", "n": 6, "stdev": 0}, 4, "num_classes-1=4"),
        ({"name": "nway_kshot", "n": 3, "k": 50}, 20, "more samples of a class"),
        ({"name": "dirichlet", "min_size": 61}, 5, "exceeds 300 samples"),
        ({"name": "dirichlet", "alpha": 0.01, "min_size": 20, "max_retries": 5}, 10, "in 5 tries"),
        ({"name": "dirichlet", "mode": "per_client", "min_size": 70}, 5, "below min_size=70"),
        ({"name": "shards", "shards_per_client": 4}, 100, "exceed the 300 samples"),
        ({"name": "classes_per_client", "k": 6}, 3, "k=6"),
        ({"name": "longtail", "n_max": 61}, 3, "lower n_max"),
        ({"name": "domain"}, 3, "domain tags"),
    ],
)
def test_infeasible_requests_raise_data_error(spec, n_clients, needle):
    labels = balanced(5, 60, 10)
    with pytest.raises(DataError, match=needle.replace("[", r"\[")):
        run(spec, labels, n_clients, num_classes=5)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"name": "dirichlet", "alpah": 0.5}, "data.partition.alpah.*did you mean 'alpha'"),
        ({"name": "dirichlet", "mode": "per_klass"}, "did you mean 'per_class'"),
        ({"name": "diriclet"}, "did you mean 'dirichlet'"),
        ({"alpha": 0.5}, "data.partition.name' is required"),
        ({"name": "longtail", "then": {"name": "iid", "sigma": 1}}, "data.partition.then.sigma"),
        ({"name": "dirichlet", "domains": None}, "unknown option"),
        ({"name": "nway_kshot", "shot_noise": "mnist_code", "stdev": 1}, "empty for stdev=1"),
        ({"name": "quantity", "distribution": "zipf"}, "valid: lognormal, powerlaw, dirichlet"),
    ],
)
def test_bad_options_raise_config_error(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        run(spec, balanced(5, 60, 12), 3)


def test_signatures_are_config_validatable():
    for name in PARTITIONERS.names():
        params = list(inspect.signature(PARTITIONERS.get(name)).parameters.values())
        assert [p.name for p in params[:3]] == ["labels", "num_clients", "seed"], name
        for p in params[3:]:
            assert p.kind is p.KEYWORD_ONLY, (name, p.name)
            assert p.default is not p.empty or p.name == "num_classes", (name, p.name)
        assert {p.name for p in params} >= RESERVED, name
    assert {
        "iid",
        "dirichlet",
        "shards",
        "classes_per_client",
        "nway_kshot",
        "longtail",
        "quantity",
        "domain",
    } <= set(PARTITIONERS.names())
