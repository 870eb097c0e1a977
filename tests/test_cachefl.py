"""CacheFL (Yi et al. 2025) and its baselines: the cache's math, what is trained and sent, and a synthetic
"CLIP-like feature world" run end to end through the ``features`` backbone.

The feature world: N unit class prototypes; text features = prototype + noise (moderate zero-shot
accuracy); real image features = prototype + a shared direction + noise; generated images' features =
prototype + a fixed "style" shift + noise (the generator's domain gap). Everything is unit-normalised.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fedskew.algorithms.base import ALGORITHMS, Context, Payload, RoundInfo, Upload, model_arrays
from fedskew.algorithms.cachefl import affinity, cache_gradient, cache_logits
from fedskew.algorithms.vision_language import zero_shot_logits
from fedskew.data.base import DATASETS, Dataset
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_simulation, run_experiment
from fedskew.settings import ClientSection

N, C, K, SHOTS, TEST_PER_CLASS = 10, 32, 16, 16, 60


def unit(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, dim=-1)


def feature_world(seed: int = 0) -> dict[str, torch.Tensor]:
    """CLIP-like: every image feature shares one direction, every text feature another (the modality gap),
    so zero-shot class margins are small, as CLIP's; the generated images carry a style shift."""
    g = torch.Generator().manual_seed(seed)
    protos = unit(torch.randn(N, C, generator=g))
    shared, shared_text, style = (unit(torch.randn(C, generator=g)) for _ in range(3))

    def draw(labels: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        noise = 1.5 * torch.randn(len(labels), C, generator=g) / math.sqrt(C)
        return unit(protos[labels] + shared + shift + noise)

    train_y = torch.arange(N).repeat_interleave(SHOTS)
    test_y = torch.arange(N).repeat_interleave(TEST_PER_CLASS)
    return {
        "train": draw(train_y, torch.zeros(C)),
        "test": draw(test_y, torch.zeros(C)),
        "synthetic": draw(torch.arange(N).repeat_interleave(K), 0.7 * style),
        "text": unit(0.2 * protos + shared_text + 0.3 * torch.randn(N, C, generator=g) / math.sqrt(C)),
        "train_y": train_y,
        "test_y": test_y,
    }


@pytest.fixture(scope="module")
def world_file(tmp_path_factory) -> Path:
    world = feature_world()
    path = tmp_path_factory.mktemp("world") / "world.pt"
    torch.save({k: world[k] for k in ("train", "test", "synthetic", "text")}, path)
    return path


def _world_dataset(root: Path | None = None) -> Dataset:
    world = feature_world()
    return Dataset(
        "feature_world",
        torch.zeros(len(world["train_y"]), 1, 4, 4, dtype=torch.uint8),
        world["train_y"],
        torch.zeros(len(world["test_y"]), 1, 4, 4, dtype=torch.uint8),
        world["test_y"],
        N,
        classes=[f"class_{c}" for c in range(N)],
    )


@pytest.fixture
def world_dataset():
    with DATASETS.replaced("feature_world", _world_dataset):
        yield


PARTITIONS = {
    "iid": {"name": "iid"},
    "dir": {"name": "dirichlet", "alpha": 0.1, "min_size": 1},
    "pat": {"name": "shards", "shards_per_client": 1},  # sorted labels, 16 per shard: one class each
}


def _merge(base: dict, over: dict) -> dict:
    return {k: _merge(base.get(k, {}), v) if isinstance(v, dict) else v for k, v in over.items()} | {
        k: v for k, v in base.items() if k not in over
    }


def world_config(world_file: Path, algorithm: str, partition: str = "iid", **over) -> dict:
    cfg = {
        "seed": 0,
        "rounds": 20,
        "data": {
            "dataset": "feature_world",
            "num_clients": 10,
            "partition": PARTITIONS[partition],
            "vision_language": {
                "backbone": {"name": "features", "options": {"path": str(world_file)}},
                "generator": {"name": "procedural"},
                "shots": K,
                "cache": False,
            },
        },
        "model": {"name": "identity"},
        "algorithm": {"name": algorithm, "alpha": 1.0, "beta": 5.0},
        # batches of 8: several local steps, so the partitions differ (one full-batch step per client
        # would make the n_k-weighted average exactly the centralised gradient step, whatever the
        # partition); lr 0.5: the literal 1e-3 barely moves W1 in 20 rounds (untrained accuracy here)
        "client": {"epochs": 1, "batch_size": 8, "lr": 0.5},
        "engine": {"mode": "sequential"},
        "checkpoint": {"every": 0},
    }
    for key, value in over.items():
        cfg[key] = _merge(cfg.get(key, {}), value) if isinstance(value, dict) else value
    if algorithm == "zeroshot":
        cfg["algorithm"] = {"name": "zeroshot"}
    return cfg


# ------------------------------------------------------------------------------------------ the math
def random_cache(seed: int = 0, b: int = 5):
    g = torch.Generator().manual_seed(seed)
    f = unit(torch.randn(b, C, generator=g))
    text = unit(torch.randn(N, C, generator=g))
    keys = unit(torch.randn(N * K, C, generator=g))
    labels = torch.arange(N).repeat_interleave(K)
    values = F.one_hot(labels, N).float()
    y = torch.randint(0, N, (b,), generator=g)
    return f, text, keys, values, labels, y


def vl_context(keys: torch.Tensor, labels: torch.Tensor, text: torch.Tensor) -> Context:
    return Context(
        num_clients=3,
        num_classes=N,
        in_shape=(C,),
        device=torch.device("cpu"),
        client=ClientSection(epochs=1, batch_size=4, lr=0.1),
        client_sizes=torch.tensor([2, 3, 5]),
        class_counts=torch.ones(3, N, dtype=torch.int64),
        rounds=2,
        seed=0,
        build_model=lambda cid: torch.nn.Identity(),
        assets={"cache_x": keys, "cache_y": labels, "text": text},
    )


def test_shapes_of_the_cache_and_its_logits():
    f, text, keys, _values, labels, _ = random_cache()
    alg = ALGORITHMS.get("cachefl")(ALGORITHMS.get("cachefl").Params(), vl_context(keys, labels, text))
    head = alg.prepare_model(torch.nn.Identity())
    state = head.state_dict()
    assert tuple(state["keys"].shape) == (N * K, C)  # W1ᵀ: one key per synthetic image
    assert tuple(state["values"].shape) == (N * K, N)  # W2ᵀ
    assert torch.equal(state["values"].sum(1), torch.ones(N * K))  # exactly one 1 per synthetic image
    assert torch.equal(state["values"].argmax(1), labels)
    assert tuple(head(f).shape) == (f.shape[0], N)
    assert [n for n, _ in head.named_parameters()] == ["keys"]  # W2 and W_text are not parameters


def test_alpha_zero_gives_exactly_the_zero_shot_logits():
    f, text, keys, values, _, _ = random_cache()
    assert torch.equal(cache_logits(f, text, keys, values, 0.0, 3.0, 100.0), zero_shot_logits(f, text, 100.0))
    assert torch.equal(zero_shot_logits(f, text, 100.0), 100.0 * f @ text.T)


def test_affinity_is_a_gaussian_kernel_of_the_euclidean_distance_for_unit_vectors():
    f, _, keys, _, _, _ = random_cache()
    f, keys, beta = unit(f.double()), unit(keys.double()), 2.5
    expected = torch.exp(-beta / 2 * torch.cdist(f, keys).pow(2))
    assert torch.allclose(affinity(f, keys, beta), expected, rtol=1e-10, atol=1e-12)


def test_autograd_gradient_equals_the_closed_form():
    f, text, keys, values, _, y = random_cache()
    f, text, keys, values = (t.double() for t in (f, text, keys, values))
    alpha, beta, scale = 3.0, 1.5, 100.0
    w = keys.clone().requires_grad_(True)
    F.cross_entropy(cache_logits(f, text, w, values, alpha, beta, scale), y).backward()
    closed = cache_gradient(f, y, text, keys, values, alpha, beta, scale)
    assert torch.allclose(w.grad, closed, rtol=1e-9, atol=1e-12)
    assert closed.abs().max() > 1e-6  # not trivially zero


def test_aggregation_weights_are_the_sample_counts():
    _f, text, keys, _values, labels, _ = random_cache()
    ctx = vl_context(keys, labels, text)
    w = [torch.full((N * K, C), v) for v in (1.0, 2.0, 4.0)]
    uploads = [Upload(i, n, Payload(arrays=model_arrays({"keys": w[i]}))) for i, n in enumerate((2, 3, 5))]
    info = RoundInfo(1, None, 0)
    cls = ALGORITHMS.get("cachefl")
    full = cls(cls.Params(), ctx).aggregate({}, uploads, info).state["weights"]["model.keys"]
    assert torch.allclose(full, torch.full_like(full, (2 * 1 + 3 * 2 + 5 * 4) / 10))
    # partial participation: normalised over the participants (default) or by the total n (literal)
    part = cls(cls.Params(), ctx).aggregate({}, uploads[:2], info).state["weights"]["model.keys"]
    assert torch.allclose(part, torch.full_like(part, (2 * 1 + 3 * 2) / 5))
    literal = cls(cls.Params(aggregation="total"), ctx).aggregate({}, uploads[:2], info).state["weights"]
    assert torch.allclose(literal["model.keys"], torch.full_like(part, (2 * 1 + 3 * 2) / 10))


def test_a_method_needs_the_vision_language_section_and_the_identity_model():
    with pytest.raises(ConfigError, match="data.vision_language"):
        build_config({"algorithm": {"name": "cachefl"}, "model": {"name": "identity"}})
    _f, text, keys, _values, labels, _ = random_cache()
    alg = ALGORITHMS.get("cachefl")(ALGORITHMS.get("cachefl").Params(), vl_context(keys, labels, text))
    with pytest.raises(ConfigError, match="model.name=identity"):
        alg.prepare_model(torch.nn.Linear(2, 2))


# ------------------------------------------------------------------------------------------ runs
def test_only_w1_is_sent_and_frozen_parts_stay_bit_identical(world_file, world_dataset):
    cfg = build_config(world_config(world_file, "cachefl", rounds=2))
    sim = build_simulation(cfg)
    assets = {k: v.clone() for k, v in sim.algorithm.ctx.assets.items()}
    features = sim.executor.runtime.data.x.raw.clone()
    w1_0 = sim.server["weights"]["model.keys"].clone()
    record = sim.run_round().record
    per_client = N * K * C  # C·N·K floats each way, W2 never
    assert record["round_params_up"] == 10 * per_client and record["round_bytes_up"] == 10 * per_client * 4
    assert record["round_params_down"] == 10 * per_client
    sim.run_round()
    model = sim.executor.runtime.models.model_for(0)
    assert torch.equal(model.text, assets["text"]) and torch.equal(
        model.values, F.one_hot(assets["cache_y"], N).float()
    )
    assert torch.equal(sim.executor.runtime.data.x.raw, features)  # features untouched
    for k, v in assets.items():
        assert torch.equal(sim.algorithm.ctx.assets[k], v)
    assert not torch.equal(sim.server["weights"]["model.keys"], w1_0)  # W1 did train
    assert list(sim.server["weights"]) == ["model.keys"]


def test_untrained_methods_send_nothing(world_file, world_dataset):
    for name in ("zeroshot", "cachefl_notrain"):
        record = build_simulation(build_config(world_config(world_file, name, rounds=1))).run_round().record
        assert record["round_bytes_up"] == 0 and record["round_bytes_down"] == 0


def test_same_seed_same_history(world_file, world_dataset):
    cfg = build_config(world_config(world_file, "cachefl", rounds=3))
    a, b = run_experiment(cfg), run_experiment(cfg)
    assert a["final"] == b["final"]


def final_accuracy(world_file: Path, name: str, partition: str = "iid", **over) -> float:
    return run_experiment(build_config(world_config(world_file, name, partition, **over)))["final"][
        "accuracy"
    ]


@pytest.mark.slow
def test_feature_world_cachefl_beats_the_untrained_cache_and_zero_shot(world_file, world_dataset):
    zero = final_accuracy(world_file, "zeroshot")
    untrained = final_accuracy(world_file, "cachefl_notrain")
    trained = {p: final_accuracy(world_file, "cachefl", p) for p in PARTITIONS}
    one_shot_cache = final_accuracy(
        world_file, "cachefl_notrain", data={"vision_language": {"shots": 1, "pool": K}}
    )
    print(f"zero-shot {zero:.3f} untrained {untrained:.3f} (K=1: {one_shot_cache:.3f}) trained {trained}")
    assert 0.3 < zero < 0.8  # a moderate zero-shot classifier, as CLIP's on a downstream set
    assert untrained >= one_shot_cache  # more synthetic images per class do not hurt the cache
    assert trained["iid"] > untrained + 0.05 and trained["iid"] > zero + 0.1
    assert trained["pat"] >= trained["iid"] - 0.08  # small degradation from iid to disjoint classes
    assert min(trained.values()) > max(untrained, zero)
