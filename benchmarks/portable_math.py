"""How portable is float32 element-wise math on this CPU? Prints one table (issue 56).

For each function: the share of float32 results of ATen's own kernel (MKL vector math) that differ from
the correctly rounded value, and the same share for ``fedskew.numerics``. A correctly rounded result is
unique, so a function whose share is 0 gives the same bits on every CPU. The reference never calls MKL:
IEEE's float32 square root (numpy, ``sqrtps``) for ``sqrt``; otherwise numpy's (scipy's for ``erf``)
float64 result rounded to float32, an implementation independent of the one under test.

``sqrt`` is checked on every positive finite float32 (2³¹ − 2²³ values, about three minutes on 2 cores;
``--quick``: a random 2²² of them); the others on 2²² random inputs of their usual range.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import scipy.special
import torch

from fedskew import numerics

CHUNK = 1 << 24
RESULTS = Path(__file__).parent / "results" / "portable_math.json"


def _sqrt_share(bits: np.ndarray) -> tuple[int, int]:
    x = bits.view(np.float32)
    want = np.sqrt(x)
    t = torch.from_numpy(x)
    return int((torch.sqrt(t).numpy() != want).sum()), int((numerics.sqrt(t).numpy() != want).sum())


def sqrt_rows(quick: bool) -> tuple[int, int, int]:
    """(inputs, ATen mismatches, fedskew mismatches) over the positive finite float32 bit patterns."""
    top = 0x7F800000  # +inf's bits: everything below is a positive finite float (subnormals included)
    if quick:
        rng = np.random.default_rng(0)
        bits = rng.integers(1, top, size=1 << 22, dtype=np.uint32)
        return (bits.size, *_sqrt_share(bits))
    n = aten = ours = 0
    for start in range(1, top, CHUNK):
        bits = np.arange(start, min(start + CHUNK, top), dtype=np.uint32)
        a, o = _sqrt_share(bits)
        n, aten, ours = n + bits.size, aten + a, ours + o
    return n, aten, ours


def other_rows() -> dict[str, tuple[int, int, int]]:
    gen = torch.Generator().manual_seed(0)
    n = 1 << 22
    uniform = torch.empty(n, dtype=torch.float64).uniform_(-1, 1, generator=gen)
    inputs = {
        "exp": uniform * 80,
        "log": torch.exp(uniform * 80),
        "sin": uniform * 20,
        "cos": uniform * 20,
        "acos": uniform,
        "tanh": uniform * 6,
        "erf": uniform * 4,
    }
    rows = {}
    reference = {"acos": np.arccos, "erf": scipy.special.erf}
    for name, wide in inputs.items():
        x = wide.float()
        ref = reference[name] if name in reference else getattr(np, name)
        want = torch.from_numpy(ref(x.double().numpy())).float()
        aten = getattr(torch, name)(x)
        ours = getattr(numerics, name)(x)
        rows[name] = (n, int((aten != want).sum()), int((ours != want).sum()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a random sample of the float32 square roots")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = {"sqrt": sqrt_rows(args.quick), **other_rows()}
    print(f"{'function':10s} {'inputs':>12s} {'ATen not correctly rounded':>28s} {'fedskew.numerics':>18s}")
    for name, (n, aten, ours) in rows.items():
        print(f"{name:10s} {n:12d} {aten:16d} ({aten / n:6.2%}) {ours:11d} ({ours / n:.2%})")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps({k: dict(zip(("inputs", "aten", "fedskew"), v, strict=True)) for k, v in rows.items()})
    )


if __name__ == "__main__":
    main()
