"""CacheFL's key gradient leaks the feature and the label (Eqs. 6–8): checked against autograd on tiny
random caches; the batch span and label set; feature inversion through a small random CNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.algorithms.cachefl import cache_logits
from fedskew.errors import DataError
from fedskew.experiment.cachefl_leak import (
    PublicModel,
    invert_features,
    key_gradients,
    label_set_by_sign,
    leak_single,
    leaked_span,
    match_batch,
    retrieve,
    singular_ratios,
    total_variation,
)
from fedskew.models.backbones import BACKBONES, to_backbone_input

C, N, K = 8, 3, 2


def public(seed: int = 0, classes: int = N, nonnegative: bool = False) -> PublicModel:
    """Random unit keys (K per class, class-major) and W_text in float64; α = 2, β = 3, s = 10."""
    g = torch.Generator().manual_seed(seed)
    keys, text = torch.randn(classes * K, C, generator=g), torch.randn(classes, C, generator=g)
    if nonnegative:
        keys, text = keys.abs(), text.abs()
    unit = [F.normalize(t.double(), dim=1) for t in (keys, text)]
    return PublicModel(unit[0], torch.arange(classes).repeat_interleave(K), unit[1], 2.0, 3.0, 10.0)


def features(n: int, seed: int, nonnegative: bool = False) -> Tensor:
    f = torch.randn(n, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return F.normalize(f.abs() if nonnegative else f, dim=1)


def autograd_keys(m: PublicModel, f: Tensor, y: Tensor) -> Tensor:
    """∂ mean CE(Eq. 7 logits, y) / ∂ keys by autograd (independent of the closed form)."""
    w = m.keys.clone().requires_grad_(True)
    F.cross_entropy(cache_logits(f, m.text, w, m.values, m.alpha, m.beta, m.scale), y).backward()
    assert w.grad is not None
    return w.grad


@pytest.mark.parametrize("label", range(N))
def test_one_sample_gradient_is_rank_one_and_gives_the_feature_and_the_label(label):
    m, f = public(), features(1, seed=1)
    y = torch.tensor([label])
    grad = autograd_keys(m, f, y)
    # the formula: row j = α β a_j (softmax(z) − e_y)_{c(j)} · f, negative only on the true class's keys
    p = cache_logits(f, m.text, m.keys, m.values, m.alpha, m.beta, m.scale).softmax(1)[0]
    a = torch.exp(-m.beta * (1 - m.keys @ f[0]))
    mult = m.alpha * m.beta * a * (p - F.one_hot(y, N)[0])[m.labels]
    assert torch.allclose(grad, mult[:, None] * f, rtol=1e-10, atol=1e-14)
    assert ((mult < 0) == (m.labels == label)).all()
    leak = leak_single(grad, m)
    assert float(leak.feature[0] @ f[0]) == pytest.approx(1.0, abs=1e-6)  # the sign too
    assert leak.label.tolist() == [label] and bool(leak.by_signs[0])
    assert float(leak.ratio[0]) < 1e-6


def test_many_gradients_at_once_match_autograd_one_by_one():
    m, f = public(seed=2), features(4, seed=3)
    y = torch.tensor([2, 0, 1, 2])
    grads = key_gradients(m, f, y)
    for i in range(4):  # four cases, checked against autograd
        assert torch.allclose(grads[i], autograd_keys(m, f[i : i + 1], y[i : i + 1]), rtol=1e-10, atol=1e-14)
    leak = leak_single(grads, m)
    assert torch.allclose((leak.feature * f).sum(1), torch.ones(4, dtype=torch.float64), atol=1e-6)
    assert leak.label.tolist() == [2, 0, 1, 2]


@pytest.mark.parametrize("label", [0, 1])
def test_two_classes_the_signs_tie_and_the_sum_rule_decides(label):
    """N = 2: one class negative, one positive under either orientation; Σ_c ĝ_c = 0 picks f, not −f."""
    m, f = public(seed=4, classes=2), features(1, seed=5)
    leak = leak_single(autograd_keys(m, f, torch.tensor([label])), m)
    assert not bool(leak.by_signs[0])
    assert float(leak.feature[0] @ f[0]) == pytest.approx(1.0, abs=1e-6)
    assert leak.label.tolist() == [label]


def test_zero_gradient_is_an_error():
    with pytest.raises(DataError, match="zero key gradient"):
        leak_single(torch.zeros(N * K, C, dtype=torch.float64), public())


def test_batch_of_two_rank_two_span_and_labels():
    m, f = public(seed=6), features(2, seed=7)
    y = torch.tensor([2, 0])
    grad = autograd_keys(m, f, y)
    ratios = singular_ratios(grad)
    assert ratios[1] > 1e-3 and ratios[2] < 1e-6  # rank 2
    basis = leaked_span(grad, 2)
    assert torch.allclose((f @ basis).norm(dim=1), torch.ones(2, dtype=torch.float64), atol=1e-9)
    match = match_batch(grad, m, 2)
    assert sorted(match.labels.tolist()) == [0, 2] and match.residual < 1e-10
    order = match.labels.argsort(descending=True)  # match the features to samples by label
    assert torch.allclose((match.features[order] * f).sum(1), torch.ones(2, dtype=torch.float64), atol=1e-6)


def test_label_set_by_sign_never_names_an_absent_class():
    """Non-negative features and keys: every class outside the batch gets a positive projected sum."""
    m = public(seed=8, nonnegative=True)
    hits = 0
    for seed in range(20):  # 20 random batches of 2
        f = features(2, seed=100 + seed, nonnegative=True)
        y = torch.randperm(N, generator=torch.Generator().manual_seed(seed))[:2]
        found = label_set_by_sign(autograd_keys(m, f, y), m)
        assert set(torch.nonzero(found).flatten().tolist()) <= set(y.tolist())
        hits += int(found.sum())
    assert hits >= 24  # and most present classes (28 of the 40 here): a confident sample can hide its class


def test_inversion_raises_the_cosine_through_a_random_cnn():
    """Feature inversion through a small frozen CNN (centred features): from noise to cos > 0.95."""
    net = BACKBONES.get("random_cnn")(None, embed_dim=32, image_size=16, seed=0).net

    def raw(x: Tensor) -> Tensor:
        return net(to_backbone_input(x, 16, (0.5,) * 3, (0.25,) * 3))

    mean = raw(torch.rand(64, 1, 12, 12, generator=torch.Generator().manual_seed(9))).mean(0)
    img = torch.zeros(2, 1, 12, 12)
    img[0, :, 3:9, 5:7], img[1, :, 2:4, 2:10], img[1, :, 8:10, 2:10] = 1, 1, 1
    target = raw(img) - mean
    start = torch.rand(2, 1, 12, 12, generator=torch.Generator().manual_seed(0))
    out = invert_features(lambda x: raw(x) - mean, target, start, steps=100, tv=0.0, record_every=50)
    assert out.steps == [0, 50, 100] and out.snapshots.shape == (3, 2, 1, 12, 12)
    assert torch.equal(out.snapshots[0], start)
    assert (out.cosine[-1] > 0.95).all() and (out.cosine[-1] > out.cosine[0] + 0.5).all()
    assert out.images.min() >= 0 and out.images.max() <= 1


def test_total_variation_and_retrieval_by_hand():
    x = torch.zeros(1, 1, 2, 3)
    x[..., :, 2] = 1.0  # one vertical edge: 2 of 4 horizontal pairs differ by 1, no vertical pair
    assert total_variation(x).tolist() == [0.5]
    pool = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, 0.0]])
    assert retrieve(torch.tensor([[0.1, 1.0], [-3.0, 0.5]]), pool).tolist() == [1, 2]
