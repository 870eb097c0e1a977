"""Per-client test splits, FederatedData / build_federated, the partition heatmap and table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedskew.data.base import Dataset
from fedskew.data.federated import build_federated
from fedskew.data.partition import apply_partition, client_test_split
from fedskew.data.plot import partition_table, plot_partition
from fedskew.errors import ConfigError, DataError

SETTINGS = settings(max_examples=30, deadline=None)


def synthetic(
    n_train: int = 1437, n_test: int = 360, num_classes: int = 10, seed: int = 0, domains: int = 0
) -> Dataset:
    """A digits-sized dataset of labels only (1-pixel images): partitions never look at pixels."""
    rng = np.random.default_rng(seed)
    ds = Dataset(
        "synthetic",
        torch.zeros(n_train, 1, 1, 1, dtype=torch.uint8),
        torch.from_numpy(rng.integers(0, num_classes, n_train)),
        torch.zeros(n_test, 1, 1, 1, dtype=torch.uint8),
        torch.from_numpy(rng.integers(0, num_classes, n_test)),
        num_classes,
    )
    if domains:
        ds.domain_train = torch.from_numpy(rng.integers(0, domains, n_train))
        ds.domain_test = torch.from_numpy(rng.integers(0, domains, n_test))
    return ds


def hist(labels: np.ndarray, c: int = 10) -> np.ndarray:
    return np.bincount(labels, minlength=c)


# ---------------------------------------------------------------------------------------- test splits
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
    # FedProto spec §4.3: the client's classes, 40 test samples each (MNIST), disjoint across clients
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


# ---------------------------------------------------------------------------------------- builder
def test_build_federated_views_and_histograms():
    ds = synthetic()
    fd = build_federated(ds, 8, {"name": "dirichlet", "alpha": 0.5}, 0, val_fraction=0.1)
    assert fd.num_clients == 8 and len(fd.test_idx) == 8 and len(fd.val_idx) == 8
    assert all(t.dtype == torch.int64 for t in fd.train_idx + fd.test_idx + fd.val_idx)
    counts = fd.class_counts()
    assert counts.shape == (8, 10) and counts.dtype == torch.int64
    for i in range(8):
        assert torch.equal(counts[i], torch.bincount(ds.y_train[fd.train_idx[i]], minlength=10))
        assert not set(fd.train_idx[i].tolist()) & set(fd.val_idx[i].tolist())
    assert torch.equal(fd.client_sizes, counts.sum(1))
    used = torch.cat(fd.train_idx + fd.val_idx)
    assert len(used) == len(torch.unique(used)) == 1437  # per_class Dirichlet uses every sample
    assert fd.test_info["disjoint"]
    test_used = torch.cat(fd.test_idx)
    assert len(test_used) == len(torch.unique(test_used))
    owned = counts + torch.stack([torch.bincount(ds.y_train[v], minlength=10) for v in fd.val_idx])
    assert torch.all((fd.test_class_counts() > 0) <= (owned > 0))  # test support within training support


def test_build_federated_is_a_pure_function_of_the_seed():
    ds = synthetic()
    spec = {"name": "longtail", "rho": 10.0, "then": {"name": "dirichlet", "alpha": 0.3, "min_size": 5}}
    a = build_federated(ds, 6, spec, 7, test={"per_class": 3}, val_fraction=0.2)
    b = build_federated(ds, 6, dict(spec), 7, test={"per_class": 3}, val_fraction=0.2)
    c = build_federated(ds, 6, spec, 8, test={"per_class": 3}, val_fraction=0.2)
    for field in ("train_idx", "test_idx", "val_idx"):
        assert all(torch.equal(x, y) for x, y in zip(getattr(a, field), getattr(b, field), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.train_idx, c.train_idx, strict=True))
    # the validation carve never changes which samples a client owns
    d = build_federated(ds, 6, spec, 7, test={"per_class": 3})
    for i in range(6):
        own = torch.sort(torch.cat([a.train_idx[i], a.val_idx[i]])).values
        assert torch.equal(own, d.train_idx[i])
        assert torch.equal(a.test_idx[i], d.test_idx[i])


def test_build_federated_passes_domains():
    ds = synthetic(domains=3)
    fd = build_federated(ds, 6, {"name": "domain"}, 0, test={"per_class": 2})
    for i in range(6):
        assert set(ds.domain_train[fd.train_idx[i]].tolist()) == {i % 3}
        assert set(ds.domain_test[fd.test_idx[i]].tolist()) <= {i % 3}
    assert fd.summary_table()[4]["domains"] == [1]


@pytest.mark.parametrize(
    ("kwargs", "err", "needle"),
    [
        ({"partition": {"name": "dirichlet", "alpah": 0.1}}, ConfigError, "did you mean 'alpha'"),
        (
            {"partition": {"name": "iid"}, "test": {"per_klass": 4}},
            ConfigError,
            "data.test.per_klass.*per_class",
        ),
        (
            {"partition": {"name": "dirichlet", "alpha": 0.1, "min_size": 0}, "num_clients": 200},
            DataError,
            "without training samples",
        ),
        ({"partition": {"name": "iid"}, "num_clients": 0}, ConfigError, "num_clients"),
    ],
)
def test_build_federated_errors(kwargs, err, needle):
    args = {"num_clients": 5, "test": None, **kwargs}
    with pytest.raises(err, match=needle):
        build_federated(synthetic(), args["num_clients"], args["partition"], 0, test=args["test"])


# ---------------------------------------------------------------------------------------- table and plot
def test_partition_table_rows():
    fd = build_federated(synthetic(), 60, {"name": "shards"}, 0)
    rows = partition_table(fd, max_rows=10)
    assert len(rows) == 10 + 2  # 10 clients, the ellipsis, the total
    assert all(r.keys() == rows[0].keys() for r in rows)
    assert rows[5]["client"] == "…" and rows[-1]["client"] == "all"
    assert rows[-1]["train"] == "1437"
    first = fd.summary_table()[0]
    assert rows[0]["#classes"] == str(first["classes"]) and first["classes"] <= 4  # 2 label-sorted shards


def test_plot_partition_writes_png(tmp_path):
    fd = build_federated(synthetic(), 10, {"name": "dirichlet", "alpha": 0.5}, 0)
    out = plot_partition(fd, tmp_path / "sub" / "p.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 150_000
