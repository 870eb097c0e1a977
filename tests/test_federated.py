"""FederatedData / build_federated, the partition heatmap and table (test splits: tests/partition)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings

from fedskew.data.base import Dataset
from fedskew.data.federated import build_federated
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
            {"partition": {"name": "dirichlet", "alpha": 0.1, "min_size": 1}, "num_clients": 2000},
            DataError,
            "exceeds",
        ),
        ({"partition": {"name": "iid"}, "num_clients": 0}, ConfigError, "num_clients"),
    ],
)
def test_build_federated_errors(kwargs, err, needle):
    args = {"num_clients": 5, "test": None, **kwargs}
    with pytest.raises(err, match=needle):
        build_federated(synthetic(), args["num_clients"], args["partition"], 0, test=args["test"])


def test_min_size_zero_keeps_clients_without_data():
    """Cross-device scale: an explicit ``min_size: 0`` keeps clients that hold no sample (instead of the
    error a partition that leaves clients empty raises otherwise); every sample still has one owner."""
    ds = synthetic()
    fd = build_federated(ds, 400, {"name": "dirichlet", "alpha": 0.1, "min_size": 0}, 0)
    sizes = [len(p) for p in fd.train_idx]
    assert min(sizes) == 0 and sum(sizes) == len(ds.y_train)
    owners = torch.cat(fd.train_idx)
    assert torch.equal(torch.sort(owners).values, torch.arange(len(ds.y_train)))


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
