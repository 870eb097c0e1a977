"""Per-client test splits (client_test_split) and validation hold-outs (validation_split)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedskew.data.partition import apply_partition, client_test_split, validation_split
from fedskew.errors import ConfigError
from tests.partition.strategies import SETTINGS


def hist(labels: np.ndarray, c: int = 10) -> np.ndarray:
    return np.bincount(labels, minlength=c)


def test_validation_split_carves_from_train():
    parts = [np.arange(0, 10), np.arange(10, 13), np.arange(13, 14), np.arange(14, 14)]
    train, val = validation_split(parts, 0.3, seed=0)
    assert [len(v) for v in val] == [3, 1, 0, 0]  # round(0.3 n), keeping >= 1 training sample
    for p, t, v in zip(parts, train, val, strict=True):
        assert np.array_equal(np.sort(np.concatenate([t, v])), p) and not set(t) & set(v)


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    num_clients=st.integers(1, 15),
    alpha=st.sampled_from([0.05, 0.5, 5.0]),
    rule=st.sampled_from([{}, {"per_class": 5}, {"fraction": 0.2}, {"size": 30}, {"per_class": 60}]),
)
def test_test_split_matches_support_and_is_disjoint_when_flagged(seed, num_clients, alpha, rule):
    rng = np.random.default_rng(seed)
    y, y_test = rng.integers(0, 10, 2000), rng.integers(0, 10, 500)
    parts = apply_partition(
        {"name": "dirichlet", "alpha": alpha, "min_size": 0}, y, num_clients, seed, num_classes=10
    )
    tests, info = client_test_split([y[p] for p in parts], y_test, seed, num_classes=10, **rule)
    flat = np.concatenate(tests)
    for p, t in zip(parts, tests, strict=True):
        assert np.all(np.diff(t) > 0)  # sorted, no duplicate inside a client
        assert set(y_test[t]) <= set(y[p])  # never a class the client did not train on
    if info["disjoint"]:
        assert len(np.unique(flat)) == len(flat)
    shared = set(info["shared_classes"])
    for c in set(range(10)) - shared:  # classes served disjointly never overlap
        sel = flat[y_test[flat] == c]
        assert len(np.unique(sel)) == len(sel)
    if "per_class" in rule:
        m = rule["per_class"]
        for p, t in zip(parts, tests, strict=True):
            expect = np.minimum((hist(y[p]) > 0) * m, hist(y_test))
            assert np.array_equal(hist(y_test[t]), expect)


def test_fedproto_per_class_test_sets():
    # as FedProto's code: the client's classes, 40 test samples each (MNIST), disjoint across clients
    y = np.repeat(np.arange(10), 1000)
    y_test = np.repeat(np.arange(10), 1000)
    parts = apply_partition({"name": "nway_kshot", "n": 3, "stdev": 1, "k": 100}, y, 20, 1234, num_classes=10)
    tests, info = client_test_split([y[p] for p in parts], y_test, 0, per_class=40)
    assert info["disjoint"]
    for p, t in zip(parts, tests, strict=True):
        assert np.array_equal(hist(y_test[t]), (hist(y[p]) > 0) * 40)


def test_default_rule_is_proportional_and_disjoint():
    y = np.repeat(np.arange(4), [400, 300, 200, 100])
    y_test = np.repeat(np.arange(4), 100)
    parts = [np.arange(0, 400), np.arange(400, 1000)]  # client 0: class 0; client 1: classes 1-3
    tests, info = client_test_split([y[p] for p in parts], y_test, 0)
    # tightest class is 0 (100 test for 400 train): f* = 1/4 for everyone
    assert info["disjoint"] and info["fraction"] == pytest.approx(0.25)
    assert hist(y_test[tests[0]], 4).tolist() == [100, 0, 0, 0]
    assert hist(y_test[tests[1]], 4).tolist() == [0, 75, 50, 25]


def test_fraction_and_size_rules_hand_checked():
    y = np.repeat(np.arange(2), [30, 10])
    tr = [y]  # one client: 75% class 0
    y_test = np.repeat(np.arange(2), 100)
    (t,), _ = client_test_split(tr, y_test, 0, size=8)
    assert hist(y_test[t], 2).tolist() == [6, 2]
    (t,), _ = client_test_split(tr, y_test, 0, fraction=0.5)
    assert hist(y_test[t], 2).tolist() == [15, 5]


def test_overdemand_falls_back_to_independent_sampling():
    y = np.zeros(100, dtype=np.int64)
    parts = [np.arange(0, 50), np.arange(50, 100)]
    y_test = np.zeros(30, dtype=np.int64)
    tests, info = client_test_split([y[p] for p in parts], y_test, 0, per_class=20)
    assert not info["disjoint"] and info["shared_classes"] == [0]
    assert [len(t) for t in tests] == [20, 20]  # each client still gets its own 20, without duplicates
    tests, info = client_test_split([y[p] for p in parts], y_test, 0, per_class=50)
    assert [len(t) for t in tests] == [30, 30]  # capped at the pool
    tests, info = client_test_split([y[p] for p in parts], y_test, 0, per_class=10)
    assert info["disjoint"] and not set(tests[0]) & set(tests[1])


def test_test_split_with_domains_matches_domain_and_class():
    rng = np.random.default_rng(3)
    y, d = rng.integers(0, 5, 600), rng.integers(0, 3, 600)
    y_test, d_test = rng.integers(0, 5, 600), rng.integers(0, 3, 600)
    parts = apply_partition({"name": "domain"}, y, 3, 0, num_classes=5, domains=d)
    tests, _ = client_test_split(
        [y[p] for p in parts],
        y_test,
        0,
        num_classes=5,
        train_domains_per_client=[d[p] for p in parts],
        test_domains=d_test,
        per_class=3,
    )
    for i, t in enumerate(tests):
        assert set(d_test[t]) == {i}  # the client's own domain only
        assert np.array_equal(hist(y_test[t], 5), (hist(y[parts[i]], 5) > 0) * 3)


def test_test_split_rejects_two_rules():
    with pytest.raises(ConfigError, match="at most one"):
        client_test_split([np.zeros(3, np.int64)], np.zeros(3, np.int64), 0, per_class=1, size=2)
    with pytest.raises(ConfigError, match="whole"):
        client_test_split([np.zeros(3, np.int64)], np.zeros(3, np.int64), 0, per_class=1, whole=True)


def test_whole_test_split_gives_every_client_the_balanced_test_set():
    y_test = np.repeat(np.arange(4), 5)
    train = [np.array([0, 0, 1]), np.array([3]), np.array([2, 2, 2, 3])]
    parts, info = client_test_split(train, y_test, 0, whole=True)
    assert len(parts) == 3 and info["rule"] == "whole" and not info["disjoint"]
    assert all(np.array_equal(p, np.arange(20)) for p in parts)
