"""fedskew.numerics: correctly rounded float32 math, the same on every CPU (issue 56).

The references never touch MKL's vector math: IEEE's float32 square root (numpy, ``sqrtps``) and numpy's /
scipy's float64 functions rounded to float32. ATen's own kernels are checked only for what makes them a
problem (they are not correctly rounded here), never for particular bits.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.special
import torch
import torch.nn.functional as F

from fedskew import numerics
from fedskew.numerics import VectorMathGuard

N = 1 << 20


def _positive_floats(n: int, seed: int = 0) -> np.ndarray:
    """Random positive finite float32 bit patterns, subnormals included."""
    bits = np.random.default_rng(seed).integers(1, 0x7F800000, size=n, dtype=np.uint32)
    return bits.view(np.float32)


def test_sqrt_is_ieee_correctly_rounded_on_random_bit_patterns():
    x = _positive_floats(N)
    got = numerics.sqrt(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, np.sqrt(x))


@pytest.mark.parametrize(
    "value, want",
    [(0.0, 0.0), (-0.0, -0.0), (float("inf"), float("inf")), (4.0, 2.0), (1e-45, np.sqrt(np.float32(1e-45)))],
)
def test_sqrt_special_values_are_ieee(value: float, want: float):
    got = numerics.sqrt(torch.tensor([value]))
    assert got.item() == want and np.signbit(got.item()) == np.signbit(want)


def test_sqrt_of_negative_and_nan_is_nan():
    assert numerics.sqrt(torch.tensor([-1.0, float("nan"), float("-inf")])).isnan().all()


def test_float64_sqrt_is_within_two_ulps_and_leaves_other_dtypes_alone():
    x = torch.from_numpy(np.exp(np.random.default_rng(1).uniform(-300, 300, N)))
    ulps = (numerics.sqrt(x) - torch.from_numpy(np.sqrt(x.numpy()))).abs() / torch.from_numpy(
        np.spacing(np.sqrt(x.numpy()))
    )
    assert ulps.max() <= 2
    assert numerics.sqrt(torch.tensor([9])).item() == 3.0  # integers: ATen's (promotes to float)
    assert numerics.sqrt(torch.tensor([2.0], dtype=torch.bfloat16)).dtype == torch.bfloat16


REFERENCE = {
    "exp": (np.exp, 80.0),
    "log": (np.log, None),
    "log10": (np.log10, None),
    "sin": (np.sin, 20.0),
    "cos": (np.cos, 20.0),
    "acos": (np.arccos, 1.0),
    "tanh": (np.tanh, 6.0),
    "erf": (scipy.special.erf, 4.0),
}


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_transcendental_functions_are_correctly_rounded(name: str):
    """Against an independent float64 implementation rounded to float32 (2^20 inputs)."""
    fn, scale = REFERENCE[name]
    rng = np.random.default_rng(2)
    x = (rng.uniform(-1, 1, N) * scale if scale else np.exp(rng.uniform(-80, 80, N))).astype(np.float32)
    got = getattr(numerics, name)(torch.from_numpy(x)).numpy()
    want = fn(x.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_logsumexp_and_cross_entropy_equal_atens_within_rounding():
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(3)) * 5
    y = torch.arange(64) % 10
    torch.testing.assert_close(numerics.logsumexp(logits, 1), torch.logsumexp(logits, 1))
    torch.testing.assert_close(numerics.cross_entropy(logits, y), F.cross_entropy(logits, y))
    assert numerics.logsumexp(logits, 1, keepdim=True).shape == (64, 1)


def test_cdist_is_euclidean_and_never_takes_the_matrix_product_form():
    gen = torch.Generator().manual_seed(4)
    a, b = (
        torch.randn(40, 6, generator=gen),
        torch.randn(30, 6, generator=gen),
    )  # > 25 rows: ATen would use mm
    want = (a.double()[:, None] - b.double()[None]).pow(2).sum(-1).sqrt().float()
    torch.testing.assert_close(numerics.cdist(a, b), want, rtol=1e-6, atol=0)
    guard = VectorMathGuard()
    with guard:
        numerics.cdist(a, b)
    assert not guard.calls


def test_gradients_match_the_analytic_ones_under_autograd_and_torch_func():
    x = torch.rand(5, dtype=torch.float32) + 0.1
    leaf = x.clone().requires_grad_(True)
    numerics.sqrt(leaf).sum().backward()
    torch.testing.assert_close(leaf.grad, 0.5 / torch.from_numpy(np.sqrt(x.numpy())), rtol=0, atol=0)
    per_row = torch.func.vmap(torch.func.grad(lambda w: numerics.sqrt(w).sum()))(x.expand(3, 5))
    torch.testing.assert_close(per_row, leaf.grad.expand(3, 5), rtol=0, atol=0)
    leaf.grad = None
    numerics.exp(leaf).sum().backward()
    torch.testing.assert_close(leaf.grad, torch.exp(x.double()).float())


def test_the_guard_sees_float32_vector_math_and_names_the_line():
    x = torch.rand(8) + 0.5
    guard = VectorMathGuard()
    with guard:
        x.sqrt()
        torch.exp(x)
        x.pow(0.5)
        torch._foreach_sqrt([x])
        torch.logsumexp(x, 0)
        torch.cdist(torch.rand(30, 2), torch.rand(30, 2))
        x.double().sqrt()  # float64: not recorded
        x.pow(2)  # not vector math
        numerics.sqrt(x), numerics.exp(x), numerics.logsumexp(x, 0)
    ops = sorted({op for op, _ in guard.calls})
    assert ops == ["_euclidean_dist", "_foreach_sqrt", "exp", "logsumexp", "pow", "sqrt"]
    assert {site.rsplit(":", 1)[0].rsplit("/", 1)[-1] for _, site in guard.calls} == {"test_numerics.py"}


def test_forward_over_reverse_cross_entropy_stays_off_float32_vector_math():
    """Per-FedAvg's Hessian-vector product: ``jvp`` of ATen's ``log_softmax`` rule calls a float32 ``exp``."""
    w = torch.randn(3, 5)
    x, y = torch.randn(8, 5), torch.arange(8) % 3

    def hvp(loss):
        return torch.func.jvp(lambda v: torch.func.grad(lambda u: loss(x @ u.T, y))(v), (w,), (w,))[1]

    plain, portable = VectorMathGuard(), VectorMathGuard()
    with plain:
        want = hvp(F.cross_entropy)
    with portable:
        got = hvp(numerics.cross_entropy)
    assert plain.calls and not portable.calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
