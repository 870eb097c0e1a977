"""Element-wise math whose float32 results are the same on every CPU.

PyTorch's CPU build sends contiguous float32 and float64 ``sqrt``, ``exp``, ``log``, ``sin``, ``cos``,
``acos``, ``tanh``, ``erf`` (and a few more, ``MKL_VECTOR_MATH``) to MKL's vector math (VML, high-accuracy
mode). VML is accurate to about one ulp, not correctly rounded, and its kernels start from approximation
instructions whose bits differ between processor models (``rsqrtps``, ``rcpps``): no MKL setting
(``MKL_CBWR``, ``MKL_ENABLE_INSTRUCTIONS``) makes them agree across CPUs. Measured on an AMD EPYC (Zen 4)
under ``MKL_CBWR=COMPATIBLE`` (``benchmarks/portable_math.py``): 17% of float32 ``sqrt`` results, 0.6% of
``log``, 1.1% of ``exp``, 5% of ``sin``/``cos`` and 9% of ``acos`` differ from the correctly rounded value,
and 1.3% of float64 ``sqrt`` results differ from IEEE's; on a 5th-generation Xeon the set of wrong results
is another one, so the same code gave other numbers (issue 56; ``docs/decisions.md``, "Portable float32
math").

A correctly rounded result is unique, so it is the same on every CPU. The functions here give it:

* ``sqrt`` never calls VML: ``x · rsqrt(x)`` in float64, where ATen's ``rsqrt`` is ``1 / sqrt`` of the
  processor's IEEE square root (correctly rounded by the standard). Its error is below 1.5 float64 ulps,
  while the exact square root of a float32 lies at least 2⁻⁵⁰ (relative) away from every float32
  rounding boundary, so rounding it to float32 gives the correctly rounded float32 square root
  (checked on every positive float32 by ``benchmarks/portable_math.py``). Float64 inputs get the same
  float64 value: within 1.5 ulps, made only of IEEE operations, so identical on every CPU.
* ``exp``, ``log``, ``sin``, ``cos``, ``acos``, ``tanh``, ``erf`` compute a float32 input in float64
  and round: VML's float64 error (below one float64 ulp) changes the float32 result only where the
  exact value lies within 2⁻²⁹ float32 ulps of a rounding boundary (none among the 10⁶ inputs per
  function of ``tests/test_numerics.py``). Float64 inputs are passed through.

Each is differentiable (autograd and ``torch.func``), and float16 / bfloat16 inputs go the float32 way. On
MPS, which has no float64, they are ATen's own functions.
``VectorMathGuard`` records every float32 call that would reach VML; the pinned golden run fails on one.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

#: ATen's element-wise ops whose float32 / float64 CPU kernels call MKL's vector math
#: (``aten/src/ATen/cpu/vml.h``, ``IMPLEMENT_VML_MKL``; ``trunc`` is exact everywhere and left out)
MKL_VECTOR_MATH: frozenset[str] = frozenset(
    {
        "acos",
        "asin",
        "atan",
        "cos",
        "sin",
        "tan",
        "tanh",
        "erf",
        "erfc",
        "erfinv",
        "exp",
        "log",
        "log10",
        "log2",
        "sqrt",
    }
)
#: ATen ops that reach the same kernels from inside their own implementation
_COMPOSITE_VECTOR_MATH: frozenset[str] = frozenset({"logsumexp", "_euclidean_dist"})
_REDUCED = (torch.float32, torch.float16, torch.bfloat16)


def _widens(x: Tensor) -> bool:
    """Whether ``x`` is computed in float64 and rounded back (a reduced float on a device with float64)."""
    return x.dtype in _REDUCED and x.device.type != "mps"


def _sqrt_value(x: Tensor) -> Tensor:
    wide = x.double()
    root = wide * torch.rsqrt(wide)
    # rsqrt(0) = inf and rsqrt(inf) = 0 make 0·inf: sqrt(±0) = ±0 and sqrt(inf) = inf, as IEEE's
    root = torch.where((wide == 0) | (wide == torch.inf), wide, root)
    return root.to(x.dtype)


class _Sqrt(torch.autograd.Function):
    """The value of ``_sqrt_value``; the gradient is ATen's ``grad / (2·√x)`` (``sqrt_backward``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return _sqrt_value(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (root,) = ctx.saved_tensors
        return grad / (2 * root)


def sqrt(x: Tensor) -> Tensor:
    """Square root, correctly rounded for float32 inputs on every CPU (module docstring)."""
    if not (_widens(x) or x.dtype == torch.float64):
        return torch.sqrt(x)
    return _Sqrt.apply(x)


def _widened(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def portable(x: Tensor) -> Tensor:
        return fn(x.double()).to(x.dtype) if _widens(x) else fn(x)

    portable.__name__ = fn.__name__
    portable.__doc__ = f"``torch.{fn.__name__}``; a float32 input in float64, rounded back (module doc)."
    return portable


exp = _widened(torch.exp)
log = _widened(torch.log)
sin = _widened(torch.sin)
cos = _widened(torch.cos)
acos = _widened(torch.acos)
tanh = _widened(torch.tanh)
erf = _widened(torch.erf)
log10 = _widened(torch.log10)


def logsumexp(x: Tensor, dim: int, keepdim: bool = False) -> Tensor:
    """``torch.logsumexp`` (its CPU kernel calls VML's exp and log), a float32 input in float64."""
    if not _widens(x):
        return torch.logsumexp(x, dim, keepdim=keepdim)
    return torch.logsumexp(x.double(), dim, keepdim=keepdim).to(x.dtype)


def cross_entropy(logits: Tensor, y: Tensor) -> Tensor:
    """``F.cross_entropy`` (mean over the batch) through ``logsumexp``: its forward-mode derivative (``jvp``,
    Hessian-vector products) never calls a float32 ``exp``, which ATen's ``log_softmax`` rule does."""
    return F.nll_loss(logits - logsumexp(logits, -1, keepdim=True), y)


def foreach_sqrt(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``torch._foreach_sqrt`` with ``sqrt``'s rounding."""
    return [sqrt(t) for t in tensors]


def cdist(x1: Tensor, x2: Tensor) -> Tensor:
    """Euclidean ``torch.cdist`` of ``[B, D]`` by ``[P, D]``: ATen's kernel takes VML's square root of the
    ``‖a‖² − 2a·b + ‖b‖²`` form once either side has more than 25 rows (``compute_mode`` default), so this
    forces the difference form, whose square root is IEEE's on every CPU."""
    return torch.cdist(x1, x2, compute_mode="donot_use_mm_for_euclid_dist")


def _reaches_vector_math(func: Any, args: tuple, kwargs: dict) -> bool:
    name = func.overloadpacket.__name__
    base = name.removeprefix("_foreach_").rstrip("_")
    if base in MKL_VECTOR_MATH or name in _COMPOSITE_VECTOR_MATH:
        return True
    if base == "pow":  # a scalar exponent of ±0.5 is sent to the sqrt kernel
        exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
        return isinstance(exponent, int | float) and exponent == 0.5
    return False


class VectorMathGuard(TorchDispatchMode):
    """Records every float32 call that reaches MKL's vector math while active, with the first frame of
    fedskew's code (or the caller's) that made it; ``calls`` counts ``(op, site)`` pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _reaches_vector_math(func, args, kwargs) and _has_float32(args):
            self.calls[(str(func.overloadpacket.__name__), _call_site())] += 1
        return func(*args, **kwargs)


def _has_float32(args: Any) -> bool:
    for a in args:
        if isinstance(a, Tensor) and a.dtype == torch.float32 and a.device.type == "cpu":
            return True
        if isinstance(a, list | tuple) and _has_float32(a):
            return True
    return False


def _call_site() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename.split('/src/')[-1]}:{frame.lineno}"
    return "?"
