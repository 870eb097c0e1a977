"""PFLlib's protocol as named options (issue 52 item 6): FedAvgCNN, the pat / dir partitions, the merged
train+test pool split 75/25 inside every client, and its config key ``data.split``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fedskew.data.base import Dataset, load_dataset
from fedskew.data.merged import build_merged
from fedskew.data.partition import apply_partition, merged_client_split, share_split
from fedskew.errors import ConfigError, DataError
from fedskew.experiment.build import build_data
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import run_experiment
from fedskew.models import MODELS, count_parameters
from tests.conftest import data_root, digits_config, requires_data


def balanced_labels(num_classes: int = 10, per_class: int = 350) -> np.ndarray:
    return np.random.default_rng(7).permutation(np.arange(num_classes * per_class) % num_classes)


# ------------------------------------------------------------------------------------------------ model
def test_fedavg_cnn_has_pfllibs_parameter_count_shape_and_head():
    model = MODELS.get("fedavg_cnn")((1, 28, 28), 10)
    # conv 1->32 5x5, conv 32->64 5x5, FC 64*4*4=1024 -> 512, FC 512 -> 10, all with biases
    by_hand = (1 * 32 * 25 + 32) + (32 * 64 * 25 + 64) + (1024 * 512 + 512) + (512 * 10 + 10)
    assert count_parameters(model) == by_hand == 582_026
    x = torch.randn(4, 1, 28, 28)
    assert model(x).shape == (4, 10)
    assert model.features(x).shape == (4, 512) and model.embed_dim == 512
    head = [n for n, _ in model.named_parameters() if model.is_head(n)]
    assert head == ["classifier.weight", "classifier.bias"]  # PFLlib's head: model.fc alone
    # CIFAR-sized input: PFLlib's dim=1600 flatten
    cifar = MODELS.get("fedavg_cnn")((3, 32, 32), 10)
    assert count_parameters(cifar) == (3 * 32 * 25 + 32) + (32 * 64 * 25 + 64) + (1600 * 512 + 512) + 5130


@pytest.mark.parametrize(
    ("shape", "opts", "needle"),
    [
        ((1, 8, 8), {}, r"fedavg_cnn' cannot take inputs of shape \(1, 8, 8\)"),
        ((784,), {}, r"needs 3-d inputs"),
        ((1, 28, 28), {"hiden": 10}, r"unknown option 'hiden'"),
        ((1, 28, 28), {"hidden": 0}, r"'hidden'"),
    ],
)
def test_fedavg_cnn_rejects_bad_inputs_and_options(shape, opts, needle):
    with pytest.raises(ConfigError, match=needle):
        MODELS.get("fedavg_cnn")(shape, 10, **opts)


# ------------------------------------------------------------------------------------------- partitions
def test_pat_uses_every_sample_once_and_assigns_classes_in_pfllib_order():
    y = balanced_labels()
    parts = apply_partition({"name": "pfllib_pat"}, y, 20, 3, num_classes=10)
    flat = np.concatenate(parts)
    assert np.array_equal(np.sort(flat), np.arange(len(y)))  # every sample, once
    for i, p in enumerate(parts):  # 20 clients, 2 per client: clients 4j..4j+3 hold classes 2j, 2j+1
        assert set(np.unique(y[p]).tolist()) == {2 * (i // 4), 2 * (i // 4) + 1}
    sizes = [len(p) for p in parts]
    assert len(set(sizes)) > 1  # unbalanced by default (PFLlib's Fashion-MNIST benchmark)
    balanced = apply_partition({"name": "pfllib_pat", "balance": True}, y, 20, 3, num_classes=10)
    assert {int(sum(y[p] == c)) for p in balanced for c in np.unique(y[p])} == {87, 89}  # 350 = 3·87 + 89


def test_pfllib_partitions_are_deterministic_by_seed_and_partition_seed_fixes_them():
    y = balanced_labels()
    for spec in ({"name": "pfllib_pat"}, {"name": "pfllib_dir"}):
        a, b = (apply_partition(spec, y, 20, 5, num_classes=10) for _ in range(2))
        assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
        c = apply_partition(spec, y, 20, 6, num_classes=10)
        assert not all(np.array_equal(p, q) for p, q in zip(a, c, strict=True))
        fixed = {**spec, "partition_seed": 5}
        d = apply_partition(fixed, y, 20, 999, num_classes=10)  # the run seed no longer matters
        assert all(np.array_equal(p, q) for p, q in zip(a, d, strict=True))


def test_dir_gives_every_client_least_samples_and_uses_every_sample():
    y = balanced_labels()
    parts = apply_partition({"name": "pfllib_dir", "alpha": 0.1}, y, 20, 0, num_classes=10)
    assert min(len(p) for p in parts) >= 40
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(y)))
    assert np.mean([len(np.unique(y[p])) for p in parts]) < 6  # Dir(0.1): few classes per client


@pytest.mark.parametrize(
    ("spec", "error", "needle"),
    [
        ({"name": "pfllib_dir", "alpha": 0.001, "max_retries": 2}, DataError, r"no draw gave every client"),
        ({"name": "pfllib_dir", "alpha": 0.0}, ConfigError, r"alpha must be > 0"),
        (
            {"name": "pfllib_pat", "classes_per_client": 11},
            DataError,
            r"classes_per_client must be in \[1, 10\]",
        ),
        ({"name": "pfllib_pat", "partition_seed": 2**32}, ConfigError, r"must be in \[0, 2\*\*32\)"),
        ({"name": "pfllib_pat", "clases_per_client": 2}, ConfigError, r"did you mean 'classes_per_client'"),
    ],
)
def test_pfllib_partitions_refuse_infeasible_or_misspelt_requests(spec, error, needle):
    with pytest.raises(error, match=needle):
        apply_partition(spec, balanced_labels(), 20, 0, num_classes=10)
    if error is ConfigError and "partition_seed" not in spec and "alpha" not in spec:  # merged path too
        with pytest.raises(error, match=needle):
            merged_client_split(spec, balanced_labels(), 20, 0, num_classes=10, train_share=0.75)


# ------------------------------------------------------------------------------------------------ split
def test_share_split_rounds_as_pfllib_and_stays_inside_each_client():
    parts = [np.arange(0, 7), np.arange(7, 47), np.arange(47, 148)]
    train, test = share_split(parts, 0.75, np.random.RandomState(0))
    for p, tr, te in zip(parts, train, test, strict=True):
        assert len(tr) == math.floor(0.75 * len(p)) and len(te) == len(p) - len(tr)  # 5/2, 30/10, 75/26
        assert not set(tr) & set(te) and np.array_equal(np.sort(np.concatenate([tr, te])), p)


def test_share_split_equals_scikit_learns_train_test_split_on_the_same_stream():
    sklearn = pytest.importorskip("sklearn.model_selection")
    parts = [np.array([9, 3, 5, 1, 7, 11, 2]), np.arange(100, 143)]
    train, test = share_split(parts, 0.75, np.random.RandomState(4))
    rs = np.random.RandomState(4)
    for p, tr, te in zip(parts, train, test, strict=True):
        ref_tr, ref_te = sklearn.train_test_split(p, train_size=0.75, shuffle=True, random_state=rs)
        assert np.array_equal(np.sort(ref_tr), tr) and np.array_equal(np.sort(ref_te), te)


def test_share_split_refuses_a_client_it_would_leave_without_training_data():
    with pytest.raises(DataError, match=r"client 1 has 1 samples, so train_share=0.75 leaves it no training"):
        share_split([np.arange(10), np.array([10])], 0.75, np.random.RandomState(0))


def _pool_dataset(n_train: int = 600, n_test: int = 100) -> Dataset:
    """A tiny image set whose pixel (0, 0, 0) / 256 + pixel (0, 0, 1) is the sample's pool row."""
    n = n_train + n_test
    rows = torch.arange(n)
    x = torch.zeros(n, 1, 12, 12, dtype=torch.uint8)
    x[:, 0, 0, 0], x[:, 0, 0, 1] = (rows // 256).to(torch.uint8), (rows % 256).to(torch.uint8)
    y = torch.from_numpy(np.random.default_rng(1).permutation(np.arange(n) % 10))
    return Dataset("pool", x[:n_train], y[:n_train], x[n_train:], y[n_train:], 10)


def _row_ids(x: torch.Tensor) -> np.ndarray:
    return (x[:, 0, 0, 0].long() * 256 + x[:, 0, 0, 1].long()).numpy()


def test_merged_pool_uses_each_sample_once_and_cuts_test_sets_from_the_clients_own_samples():
    ds = _pool_dataset()
    fed = build_merged(ds, 5, {"name": "pfllib_dir", "least_samples": 20}, 0, val_fraction=0.2)
    new = fed.dataset
    seen: list[np.ndarray] = []
    for i in range(5):
        tr = _row_ids(new.x_train[fed.train_idx[i]])
        va = _row_ids(new.x_train[fed.val_idx[i]])
        te = _row_ids(new.x_test[fed.test_idx[i]])
        n = len(tr) + len(va) + len(te)
        assert len(te) == n - math.floor(0.75 * n)  # the test share of all the client's samples
        assert len(va) == round(0.2 * (len(tr) + len(va)))  # validation from the training share only
        assert not (set(tr) | set(va)) & set(te)  # disjoint train / test per client
        seen += [tr, va, te]
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(700))  # the merged pool, each once
    # the global test set is exactly the union of the clients' test sets (PFLlib's global-model accuracy)
    assert len(new.y_test) == sum(len(t) for t in fed.test_idx)
    assert fed.test_info["disjoint"] and new.meta["split"] == {"merged": True, "train_share": 0.75}


def test_merged_pool_is_deterministic_by_seed():
    ds = _pool_dataset()
    a, b, c = (build_merged(ds, 5, {"name": "pfllib_pat"}, s) for s in (3, 3, 4))
    assert all(torch.equal(p, q) for p, q in zip(a.test_idx, b.test_idx, strict=True))
    assert torch.equal(a.dataset.x_test, b.dataset.x_test)
    assert not torch.equal(a.dataset.x_test, c.dataset.x_test)


def test_merged_pool_with_a_fedskew_partition_splits_on_its_own_stream():
    ds = _pool_dataset()
    fed = build_merged(ds, 4, {"name": "dirichlet", "alpha": 0.5}, 2)
    sizes = [len(t) + len(s) for t, s in zip(fed.train_idx, fed.test_idx, strict=True)]
    assert sum(sizes) == 700 and all(
        len(s) == n - math.floor(0.75 * n) for s, n in zip(fed.test_idx, sizes, strict=True)
    )


# ----------------------------------------------------------------------------------------------- config
def _merged_config(**data) -> dict:
    cfg = digits_config(rounds=1)
    cfg["data"] = {
        "dataset": "digits",
        "num_clients": 5,
        "partition": {"name": "pfllib_pat", "least_samples": 10},
        "split": {"merged": True, "train_share": 0.75},
        **data,
    }
    return cfg


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"test": {"per_class": 5}}, r"config key 'data.test' cannot be combined with data.split.merged"),
        ({"shots": 4}, r"config key 'data.shots' cannot be combined with data.split.merged"),
        ({"train_limit": 100}, r"config key 'data.train_limit' cannot be combined"),
        ({"split": {"merged": True, "train_share": 1.0}}, r"data.split.train_share"),
        ({"split": {"merged": True, "train_shares": 0.5}}, r"data.split.train_shares"),
    ],
)
def test_merged_split_config_errors_are_one_line(data, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        build_config(_merged_config(**data))
    assert "\n" not in str(err.value)


def test_without_split_the_recorded_config_is_unchanged():
    assert "split" not in build_config(digits_config()).to_dict()["data"]
    assert build_config(_merged_config()).to_dict()["data"]["split"] == {"merged": True, "train_share": 0.75}


def test_a_run_on_the_merged_pool_scores_each_client_on_its_own_test_split(tmp_path):
    cfg = build_config(_merged_config(), ["eval.protocol=personalized"])
    fed = build_data(cfg)
    pool = 1797  # sklearn digits
    n = [len(t) + len(s) for t, s in zip(fed.train_idx, fed.test_idx, strict=True)]
    assert sum(n) == pool and [len(t) for t in fed.test_idx] == [k - math.floor(0.75 * k) for k in n]
    run_experiment(cfg, tmp_path)
    final = json.loads((tmp_path / "summary.json").read_text())["final"]
    assert len(final["accuracy_clients"]) == 5 and 0.0 <= final["accuracy_weighted"] <= 1.0


# ----------------------------------------------------------------------------- PFLlib's own clients
#: client sizes of PFLlib's generator on Fashion-MNIST (seed 1, 20 clients), clients 0-5, computed by running
#: PFLlib's dataset/utils/dataset_utils.py (commit d832e76) separate_data + split_data on the merged labels
PFLLIB_SIZES = {
    "pfllib_pat": [2316, 1300, 2293, 8091, 2059, 1002],
    "pfllib_dir": [82, 320, 875, 2603, 1455, 5473],
}
PFLLIB_CLIENT0 = {"pfllib_pat": (1737, 579), "pfllib_dir": (61, 21)}


@requires_data
@pytest.mark.parametrize("scheme", ["pfllib_pat", "pfllib_dir"])
def test_fashion_mnist_clients_are_pfllibs(scheme):
    ds = load_dataset("fashion_mnist", data_root(), download=False)
    y = np.concatenate([ds.y_train.numpy(), ds.y_test.numpy()]).astype(np.int64)
    train, test = merged_client_split({"name": scheme}, y, 20, 1, num_classes=10, train_share=0.75)
    assert [len(a) + len(b) for a, b in zip(train, test, strict=True)][:6] == PFLLIB_SIZES[scheme]
    assert (len(train[0]), len(test[0])) == PFLLIB_CLIENT0[scheme]
