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

What the pin cannot close (issue 56): MKL's vector math (VML), which ATen calls for float32 and float64
``sqrt``, ``exp``, ``log``, ``sin``, ``cos``, ``acos``, ``tanh``, ``erf`` and a few more. Its kernels start
from approximation instructions (``rsqrtps``, ``rcpps``) whose bits differ between processor models, under
every ``MKL_CBWR`` branch: on a 5th-generation Xeon (Emerald Rapids) FedOpt's, FedDecorr's and FedGen's
float32 square roots gave other bits than on the AMD EPYC that recorded them. The code therefore takes those
functions from ``fedskew.numerics`` (correctly rounded, so the same on every CPU), and the pinned run runs
under ``numerics.VectorMathGuard``: a float32 call that still reaches VML fails the golden suite, naming the
op and the source line. float64 VML calls remain (FedEnt's solver takes float64 ``log``s); rounded to
float32 they practically never move a result; FedEnt's float64 metrics would move with them, and the probe
(``python -m tests.golden.cases --probe``) shows such a case in one command. See docs/decisions.md,
"Portable float32 math".
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
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


def pinned() -> bool:
    """Whether this process was started by ``pinned_env``."""
    return os.environ.get(PIN_FLAG) == "1"


def libraries() -> dict[str, str]:
    """The CPU and the library builds the numbers depend on, for ``cases.py --probe``."""
    build = torch.__config__.show().splitlines()
    mkl = next((ln.strip(" -") for ln in build if "Math Kernel" in ln), "none")
    onednn = next((ln.strip(" -") for ln in build if "DNN" in ln), "none")
    return {
        "cpu": cpu_description(),
        "cpu flags": cpu_flags(),
        "torch": torch.__version__,
        "mkl": mkl,
        "onednn": onednn,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "native isa": torch.backends.cpu.get_cpu_capability(),
    }


def environment() -> dict[str, Any]:
    """What the recorded numbers depend on besides the code: bit-equality is asserted only where these
    match the recording (another torch or another architecture compares within tolerances)."""
    return {
        "torch": torch.__version__.split("+")[0],
        "machine": platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "pinned": pinned(),
    }


def _cpuinfo(field: str) -> str:
    """The first ``field`` line of ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.split(":", 1)[0].strip() == field), "")


def cpu_flags() -> str:
    """The CPU's vector extensions, all of them (``avx*``, ``amx*``, ``fma``, ``f16c``, ``sse*``)."""
    flags = _cpuinfo("flags").split()
    return " ".join(f for f in flags if f.startswith(("avx", "amx", "sse", "fma", "f16c")))


def cpu_description() -> str:
    """The CPU's model, family/model numbers and the vector extensions that decide the kernels."""
    model = _cpuinfo("model name") or platform.processor() or platform.machine()
    numbers = f"family {_cpuinfo('cpu family')} model {_cpuinfo('model')}"
    flags = _cpuinfo("flags").split()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile")
    return f"{model}, {numbers} ({', '.join(f for f in wanted if f in flags)})"
