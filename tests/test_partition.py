"""Partitioners: structural properties (hypothesis), exact counts where a scheme promises them, errors."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedskew.data.base import PARTITIONERS
from fedskew.data.partition import RESERVED, apply_partition, validation_split
from fedskew.errors import ConfigError, DataError

SETTINGS = settings(max_examples=30, deadline=None)

#: schemes with parameters that are feasible for every draw of ``problems`` below
FEASIBLE = [
    {"name": "iid"},
    {"name": "iid", "unbalanced_sigma": 1.0},
    {"name": "quantity", "min_size": 1},
    {"name": "quantity", "distribution": "powerlaw", "exponent": 2.0, "min_size": 2},
    {"name": "quantity", "distribution": "dirichlet", "beta": 0.3, "min_size": 1},
    {"name": "dirichlet", "alpha": 0.3, "min_size": 0},
    {"name": "dirichlet", "alpha": 0.1, "min_size": 1, "mode": "per_client"},
    {"name": "shards"},
    {"name": "classes_per_client", "k": 2},
    {"name": "nway_kshot", "n": 3, "stdev": 1, "k": 2},
    {"name": "longtail", "rho": 10.0},
    {"name": "longtail", "rho": 5.0, "then": {"name": "dirichlet", "alpha": 0.5, "min_size": 0}},
    {"name": "domain"},
    {"name": "domain", "label_skew": {"name": "dirichlet", "alpha": 0.5, "min_size": 0}, "max_per_class": 3},
]


def balanced(num_classes: int, per_class: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(num_classes * per_class) % num_classes)


@st.composite
def problems(draw: st.DrawFn) -> tuple[np.ndarray, int, int, int, np.ndarray]:
    """(labels, num_classes, num_clients, seed, domains) with at least 3N samples per class."""
    num_classes = draw(st.integers(4, 10))
    num_clients = draw(st.integers(1, 12))
    per_class = draw(st.integers(3 * num_clients, 3 * num_clients + 40))
    seed = draw(st.integers(0, 2**31 - 1))
    labels = balanced(num_classes, per_class, seed)
    n_dom = draw(st.integers(1, min(3, num_clients)))
    domains = np.random.default_rng(seed + 1).permutation(np.arange(len(labels)) % n_dom)
    return labels, num_classes, num_clients, seed, domains


def run(spec: dict, labels: np.ndarray, n_clients: int, seed: int = 0, **kw) -> list[np.ndarray]:
    num_classes = kw.pop("num_classes", int(labels.max()) + 1)
    return apply_partition(spec, labels, n_clients, seed, num_classes=num_classes, **kw)


# ---------------------------------------------------------------------------------------- properties
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


@SETTINGS
@given(problem=problems(), alpha=st.sampled_from([0.1, 0.5, 2.0]), min_size=st.integers(1, 3))
def test_dirichlet_min_size_honoured_and_every_sample_used(problem, alpha, min_size):
    labels, _, num_clients, seed, _ = problem
    try:
        parts = run({"name": "dirichlet", "alpha": alpha, "min_size": min_size}, labels, num_clients, seed)
    except DataError as err:  # allowed only as the documented retry failure
        assert "min_size" in str(err)
        return
    assert min(len(p) for p in parts) >= min_size
    assert sum(len(p) for p in parts) == len(labels)  # per_class mode uses every sample


@SETTINGS
@given(problem=problems(), k=st.integers(1, 4))
def test_classes_per_client_exact_k_and_all_classes_covered(problem, k):
    labels, num_classes, num_clients, seed, _ = problem
    parts = run({"name": "classes_per_client", "k": k}, labels, num_clients, seed)
    held = [np.unique(labels[p]) for p in parts]
    assert all(len(h) == k for h in held)
    holders = np.bincount(np.concatenate(held), minlength=num_classes)
    assert holders.max() - holders.min() <= 1  # balanced: each class held by floor or ceil of N*k/C
    if num_clients * k >= num_classes:
        assert np.all(holders > 0)
    # a class is split equally (+-1) among its holders
    for c in range(num_classes):
        got = [int((labels[p] == c).sum()) for p in parts if (labels[p] == c).any()]
        assert not got or max(got) - min(got) <= 1


@SETTINGS
@given(
    problem=problems(),
    n=st.integers(2, 4),
    stdev=st.integers(0, 2),
    noise=st.sampled_from(["uniform", "none"]),
)
def test_nway_kshot_ranges(problem, n, stdev, noise):
    labels, num_classes, num_clients, seed, _ = problem
    k = 3
    spec = {"name": "nway_kshot", "n": n, "stdev": stdev, "k": k, "shot_noise": noise}
    lo, hi = max(2, n - stdev), min(num_classes - 1, n + stdev)
    if lo > hi:  # FedProto clips n_i to [2, C-1]
        with pytest.raises(DataError, match="no valid class count"):
            run(spec, labels, num_clients, seed)
        return
    try:
        parts = run(spec, labels, num_clients, seed)
    except DataError as err:
        assert "more samples of a class" in str(err)
        return
    for p in parts:
        classes, counts = np.unique(labels[p], return_counts=True)
        assert lo <= len(classes) <= hi
        assert len(set(counts.tolist())) == 1  # k_i samples of every class of client i
        if noise == "none" or stdev == 0:
            assert counts[0] == k
        else:
            assert k - stdev + 1 <= counts[0] <= k + stdev


@SETTINGS
@given(problem=problems(), rho=st.sampled_from([1.0, 2.0, 10.0, 100.0]))
def test_longtail_profile(problem, rho):
    labels, num_classes, num_clients, seed, _ = problem
    parts = run({"name": "longtail", "rho": rho}, labels, num_clients, seed)
    kept = np.bincount(labels[np.concatenate(parts)], minlength=num_classes)
    n_max = np.bincount(labels).min()
    c = np.arange(num_classes)
    assert np.array_equal(kept, (n_max * (1.0 / rho) ** (c / (num_classes - 1))).astype(np.int64))


# ---------------------------------------------------------------------------------------- hand-checked
def test_longtail_hand_checked_profile():
    labels = balanced(3, 100, 0)
    parts = run({"name": "longtail", "rho": 4.0}, labels, 2)
    assert np.bincount(labels[np.concatenate(parts)]).tolist() == [100, 50, 25]  # 100·4^(-c/2)


def test_longtail_then_dirichlet_keeps_profile_and_skews():
    labels = balanced(10, 600, 1)
    spec = {"name": "longtail", "rho": 10.0, "then": {"name": "dirichlet", "alpha": 0.1, "min_size": 5}}
    parts = run(spec, labels, 10)
    kept = np.bincount(labels[np.concatenate(parts)], minlength=10)
    assert kept[0] == 600 and kept[-1] == 60
    assert np.mean([len(np.unique(labels[p])) for p in parts]) < 8  # label skew inside the long tail


def test_shards_mcmahan_layout():
    # 10 classes x 30 samples, 5 clients x 2 shards: 10 shards of 30 = one whole class each
    labels = balanced(10, 30, 2)
    parts = run({"name": "shards", "shards_per_client": 2}, labels, 5)
    for p in parts:
        classes, counts = np.unique(labels[p], return_counts=True)
        assert len(classes) == 2 and counts.tolist() == [30, 30]
    assert sum(len(p) for p in parts) == 300


def test_iid_balanced_sizes_and_class_mix():
    labels = balanced(10, 500, 3)
    parts = run({"name": "iid"}, labels, 7)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 5000
    hist = np.stack([np.bincount(labels[p], minlength=10) / len(p) for p in parts])
    assert np.abs(hist - 0.1).max() < 0.04


def test_quantity_sizes_skewed_with_min_size():
    labels = balanced(10, 300, 4)
    parts = run({"name": "quantity", "sigma": 2.0, "min_size": 25}, labels, 20)
    sizes = np.array([len(p) for p in parts])
    assert sizes.sum() == 3000 and sizes.min() >= 25
    assert sizes.max() > 4 * np.median(sizes)  # heavy tail


def test_dirichlet_large_alpha_approaches_iid():
    labels = balanced(10, 400, 5)
    for mode in ("per_class", "per_client"):
        parts = run({"name": "dirichlet", "alpha": 1e4, "mode": mode}, labels, 5)
        hist = np.stack([np.bincount(labels[p], minlength=10) / len(p) for p in parts])
        assert np.abs(hist - 0.1).max() < 0.02, mode


def test_dirichlet_small_alpha_concentrates_classes():
    labels = balanced(10, 400, 6)
    for mode in ("per_class", "per_client"):
        parts = run({"name": "dirichlet", "alpha": 0.05, "mode": mode, "min_size": 1}, labels, 20)
        top = np.mean([np.bincount(labels[p]).max() / len(p) for p in parts])
        assert top > 0.6, mode  # the dominant class holds most of a typical client


def test_dirichlet_per_client_equal_sizes_without_replacement():
    labels = np.random.default_rng(7).integers(0, 10, 1003)
    parts = run({"name": "dirichlet", "alpha": 0.1, "mode": "per_client"}, labels, 10)
    assert [len(p) for p in parts] == [100] * 10  # 3 samples left unused


def test_dirichlet_seeds_differ():
    labels = balanced(10, 100, 8)
    a = run({"name": "dirichlet", "alpha": 0.5}, labels, 5, seed=0)
    b = run({"name": "dirichlet", "alpha": 0.5}, labels, 5, seed=1)
    assert not all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_domain_one_domain_per_client_and_cap():
    labels = balanced(5, 60, 9)
    domains = np.random.default_rng(9).permutation(np.arange(300) % 3)
    parts = run({"name": "domain", "max_per_class": 4}, labels, 6, domains=domains)
    for i, p in enumerate(parts):
        assert np.unique(domains[p]).tolist() == [i % 3]  # client i holds domain i mod D
        assert np.bincount(labels[p]).max() <= 4
    parts = run(
        {"name": "domain", "label_skew": {"name": "classes_per_client", "k": 1}}, labels, 3, domains=domains
    )
    assert all(len(np.unique(labels[p])) == 1 for p in parts)


def test_validation_split_carves_from_train():
    parts = [np.arange(0, 10), np.arange(10, 13), np.arange(13, 14), np.arange(14, 14)]
    train, val = validation_split(parts, 0.3, seed=0)
    assert [len(v) for v in val] == [3, 1, 0, 0]  # round(0.3 n), keeping >= 1 training sample
    for p, t, v in zip(parts, train, val, strict=True):
        assert np.array_equal(np.sort(np.concatenate([t, v])), p) and not set(t) & set(v)


# ---------------------------------------------------------------------------------------- errors
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


def test_domain_needs_enough_clients():
    labels = balanced(5, 60, 11)
    with pytest.raises(DataError, match="2 clients for 3 domains"):
        run({"name": "domain"}, labels, 2, domains=np.arange(300) % 3)


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
