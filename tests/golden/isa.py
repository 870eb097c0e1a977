"""The instruction-set environments the golden cases run under.

PyTorch picks its CPU kernels at run time: ATen's vectorised kernels by the CPU's capability (AVX2,
AVX-512), oneDNN's JIT kernels by the CPU's ISA (and its cache sizes), MKL's BLAS by the CPU's vendor
and ISA. A different kernel sums in another order, so the same code gives other bits on another CPU
(measured: fedavg round 1 ``train_loss`` 1.772175720292852 on AVX-512 against 1.7721756360137584 on
AVX2). ``PINNED`` removes each of those choices for the process that runs the golden cases:

* ``ATEN_CPU_CAPABILITY=avx2``: ATen's AVX2 kernels on every x86-64 CPU that has AVX2;
* ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility branch that MKL documents as
  giving the same results on Intel and non-Intel processors (its ``AVX2`` branch falls back to the
  CPU-dependent ``AUTO`` dispatch on non-Intel CPUs; measured here, it moved FedSKC's numbers);
* oneDNN switched off in-process (``torch.backends.mkldnn``): its JIT kernels choose their blocking
  from the CPU they run on; with oneDNN off, convolutions go through ATen and MKL, both pinned above
  (``ONEDNN_MAX_CPU_ISA`` is pinned too, for any call that still reaches oneDNN);
* one thread everywhere (OpenMP, MKL, torch): a reduction split over threads sums in another order.

Measured (see ``python -m tests.golden.cases --record``): under ``PINNED`` every case is bit-identical
whatever ``MKL_ENABLE_INSTRUCTIONS`` (SSE4_2, AVX2, AVX512) MKL is allowed to dispatch to on this CPU.
``NATIVE`` is the process's own environment: the kernels a user gets.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

#: environment of the pinned process (set before ``import torch``: the libraries read it at load time)
PINNED: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "DNNL_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
#: the variable the child process reads to apply the in-process part of the pin
PIN_FLAG = "FEDSKEW_GOLDEN_PINNED"

#: the other kernel choices an x86-64 machine can make, used to measure the drift that the tolerances of
#: unpinned runs are derived from (``native`` is this machine's own, AVX-512 where the CPU has it)
VARIANTS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2-unpinned": {"ATEN_CPU_CAPABILITY": "avx2"},
    "scalar": {"ATEN_CPU_CAPABILITY": "default"},
    "sse4": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
}


def pinned_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the pins of ``PINNED`` and the in-process flag."""
    return {**(os.environ if base is None else base), **PINNED, PIN_FLAG: "1"}


def apply_in_process_pin() -> None:
    """The part of the pin that has no environment variable; a no-op unless the parent asked for it."""
    torch.set_num_threads(1)
    if os.environ.get(PIN_FLAG) != "1":
        return
    torch.backends.mkldnn.enabled = False
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":  # the CPU has no AVX2: the pin cannot hold, say so rather than compare
        raise RuntimeError(f"pinned golden run needs an AVX2 CPU; ATen runs {capability} kernels here")


def environment() -> dict[str, Any]:
    """What the recorded numbers depend on besides the code: bit-equality is asserted only where these
    match the recording (another torch or another architecture compares within tolerances)."""
    return {
        "torch": torch.__version__.split("+")[0],
        "machine": platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "pinned": os.environ.get(PIN_FLAG) == "1",
    }


def cpu_description() -> str:
    """The CPU's model and the vector extensions that decide the kernels (from ``/proc/cpuinfo``)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    return f"{model} ({', '.join(f for f in wanted if f in flags)})"
