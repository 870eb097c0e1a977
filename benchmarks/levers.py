"""Step-level levers for small-model clients, measured side by side on one CPU thread.

W2's client step (FedProto's MNIST CNN ``cnn_fedproto``, 21.8k parameters, batch 8, dropout on) is bound
by per-call overhead, not by arithmetic (docs/performance.md). This script times one local SGD step per
client, for 20 clients, six ways, and prints a table (JSON to ``benchmarks/results/levers[_quick].json``):

* ``eager NCHW`` / ``eager NHWC``: the sequential loop's step (module forward, cross-entropy, autograd
  backward, fedskew's foreach SGD), one client after the other;
* ``torch.compile NCHW`` / ``NHWC``: the same step with the module compiled by inductor (compile time
  reported apart);
* ``vmap (grouped conv)``: the vectorized mode's form: ``torch.func.grad`` of a functional call, vmapped
  over the 20 clients' stacked weights (vmap lowers each convolution to one grouped convolution);
* ``unfold + bmm``: both convolutions as im2col (``F.unfold``) and one batched matrix product over the
  clients, the linear layers as ``bmm`` too; autograd over the stacked weights.

The batched forms are checked against the per-client gradients (dropout off) before they are timed.

    python benchmarks/levers.py            # 20 clients, the fastest of 3 blocks of 200 steps each form
    python benchmarks/levers.py --clients 64
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, grad, vmap

from fedskew.engine.sgd import SGD
from fedskew.models.base import MODELS
from round_speed import gemm_ceilings, train_flops_per_sample

RESULTS = Path(__file__).parent / "results"
BATCH, LR, MOMENTUM, DROPOUT = 8, 0.01, 0.5, 0.5


def _model() -> torch.nn.Module:
    return MODELS.get("cnn_fedproto")((1, 28, 28), 10, dropout=DROPOUT).train()


def _per_step(step: Callable[[int], None], steps: int, clients: int) -> float:
    """Seconds per client-step of ``step(i)`` (one call = one step of every client when batched)."""
    step(0)
    best = float("inf")
    for _ in range(3):  # the fastest of three blocks: this machine is shared
        t = time.perf_counter()
        for i in range(steps):
            step(i)
        best = min(best, time.perf_counter() - t)
    return best / steps / clients


def eager(x: Tensor, y: Tensor, steps: int, channels_last: bool, compiled: bool) -> tuple[float, float]:
    """The sequential loop's step, one client after the other; returns (s per client-step, compile s)."""
    clients = x.shape[0]
    model = _model()
    if channels_last:  # one input channel: the images' layout is the same, the activations' is not
        model = model.to(memory_format=torch.channels_last)
    net = torch.compile(model) if compiled else model
    opts = [SGD(model.parameters(), LR, MOMENTUM) for _ in range(clients)]

    def one(c: int, i: int) -> None:
        loss = F.cross_entropy(net(x[c, i % x.shape[1]]), y[c, i % x.shape[1]])
        loss.backward()
        opts[c].step()
        opts[c].zero_grad()

    t = time.perf_counter()
    one(0, 0)  # compiles when ``compiled``
    compile_s = time.perf_counter() - t if compiled else 0.0
    return _per_step(lambda i: [one(c, i) for c in range(clients)], steps, clients), compile_s


def _stacked(clients: int) -> dict[str, Tensor]:
    torch.manual_seed(0)
    state = _model().state_dict()
    return {k: v.detach().unsqueeze(0).repeat(clients, *[1] * v.dim()) for k, v in state.items()}


def _vmap_grads(params: dict[str, Tensor], x: Tensor, y: Tensor, train: bool) -> dict[str, Tensor]:
    model = _model().train(train)

    def loss(p: dict[str, Tensor], xb: Tensor, yb: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xb,)), yb)

    return vmap(grad(loss), randomness="different" if train else "error")(params, x, y)


def _conv_bmm(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """Per-client valid convolution as one ``bmm``: x [C, B, Cin, H, W], w [C, Cout, Cin, k, k]."""
    c, n, cin, h, wd = x.shape
    k = w.shape[-1]
    cols = F.unfold(x.reshape(c * n, cin, h, wd), k)  # [C·B, Cin·k·k, L]
    L = cols.shape[-1]
    cols = cols.view(c, n, cin * k * k, L).transpose(1, 2).reshape(c, cin * k * k, n * L)
    out = torch.bmm(w.flatten(2), cols) + b.unsqueeze(-1)  # [C, Cout, B·L]
    side = h - k + 1
    return out.view(c, -1, n, side, side).transpose(1, 2)


def _unfold_forward(p: dict[str, Tensor], x: Tensor, train: bool) -> Tensor:
    """cnn_fedproto for C clients at once (layer names of its state dict)."""
    c, n = x.shape[:2]
    w1, b1, w2, b2, fc1w, fc1b, fc2w, fc2b = p.values()  # the state dict's order: conv1, conv2, fc, head
    z = _conv_bmm(x, w1, b1).flatten(0, 1)
    z = F.relu(F.max_pool2d(z, 2)).view(c, n, *z.shape[1:-2], 12, 12)
    z = _conv_bmm(z, w2, b2).flatten(0, 1)
    z = F.dropout2d(z, DROPOUT, train)
    z = F.relu(F.max_pool2d(z, 2)).view(c, n, -1)
    z = F.relu(torch.baddbmm(fc1b.unsqueeze(1), z, fc1w.transpose(1, 2)))
    z = F.dropout(z, DROPOUT, train)
    return torch.baddbmm(fc2b.unsqueeze(1), z, fc2w.transpose(1, 2))


def _unfold_grads(params: dict[str, Tensor], x: Tensor, y: Tensor, train: bool) -> dict[str, Tensor]:
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    logits = _unfold_forward(leaves, x, train)
    # sum over clients of each client's mean loss: each client's gradient is its own
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1).sum()
    g = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, g, strict=True))


def batched(form: Callable, x: Tensor, y: Tensor, steps: int) -> float:
    """A batched form's step for every client: gradients, then the foreach SGD over the stacked weights."""
    clients = x.shape[0]
    params = _stacked(clients)
    bufs: dict[str, Tensor] = {}

    def step(i: int) -> None:
        j = i % x.shape[1]
        g = form(params, x[:, j], y[:, j], True)
        for k, v in g.items():
            bufs[k] = bufs[k].mul_(MOMENTUM).add_(v) if k in bufs else v
        torch._foreach_add_(list(params.values()), [bufs[k] for k in params], alpha=-LR)

    return _per_step(step, steps, clients)


def check(x: Tensor, y: Tensor) -> float:
    """Largest difference of the batched forms' gradients from per-client autograd (dropout off)."""
    clients = x.shape[0]
    params = _stacked(clients)
    model = _model().eval()
    ref = []
    for c in range(clients):
        model.load_state_dict({k: v[c] for k, v in params.items()})
        model.zero_grad()
        F.cross_entropy(model(x[c, 0]), y[c, 0]).backward()
        ref.append({k: p.grad.clone() for k, p in model.named_parameters()})
    worst = 0.0
    for form in (_vmap_grads, _unfold_grads):
        g = form({k: v for k, v in params.items() if k in ref[0]}, x[:, 0], y[:, 0], False)
        worst = max(worst, max(float((g[k][c] - ref[c][k]).abs().max()) for c in range(clients) for k in g))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="blocks of 20 steps (make bench QUICK=1)")
    args = ap.parse_args()
    args.steps = 20 if args.quick else args.steps
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.clients, 16, BATCH, 1, 28, 28)
    y = torch.randint(0, 10, (args.clients, 16, BATCH))
    print(f"batched forms vs per-client gradients: max |diff| {check(x[:, :1], y[:, :1]):.2e}")
    rows: dict[str, dict[str, float]] = {}
    for name, kw in {
        "eager NCHW": {"channels_last": False, "compiled": False},
        "eager NHWC": {"channels_last": True, "compiled": False},
        "torch.compile NCHW": {"channels_last": False, "compiled": True},
        "torch.compile NHWC": {"channels_last": True, "compiled": True},
    }.items():
        s, c = eager(x, y, args.steps, **kw)
        rows[name] = {"ms_per_client_step": s * 1e3, "compile_s": c}
    for name, form in {"vmap (grouped conv)": _vmap_grads, "unfold + bmm": _unfold_grads}.items():
        rows[name] = {"ms_per_client_step": batched(form, x, y, args.steps) * 1e3, "compile_s": 0.0}
    base = rows["eager NCHW"]["ms_per_client_step"]
    flops = train_flops_per_sample(_model(), x[0, 0], y[0, 0]) * BATCH
    ceiling = max(gemm_ceilings(1024))  # GFLOP/s of one thread
    print(f"one step: {flops / 1e6:.1f} MFLOP; GEMM ceiling of one thread {ceiling:.1f} GFLOP/s")
    head = ("form", "ms/client-step", "× eager", "GFLOP/s", "ceiling", "compile s")
    print(f"{head[0]:22s} {head[1]:>15s} {head[2]:>8s} {head[3]:>8s} {head[4]:>8s} {head[5]:>10s}")
    for name, r in rows.items():
        ms = r["ms_per_client_step"]
        r["ceiling_fraction"] = flops / (ms / 1e3) / 1e9 / ceiling
        print(
            f"{name:22s} {ms:15.3f} {base / ms:8.2f} {flops / ms / 1e6:8.2f} "
            f"{r['ceiling_fraction']:8.1%} {r['compile_s']:10.1f}"
        )
    RESULTS.mkdir(exist_ok=True)
    meta = {"clients": args.clients, "batch": BATCH, "threads": 1, "torch": torch.__version__}
    meta |= {"step_flops": flops, "gemm_ceiling_gflops": ceiling}
    out = RESULTS / ("levers_quick.json" if args.quick else "levers.json")
    out.write_text(json.dumps({"forms": rows, **meta}, indent=2) + "\n")


if __name__ == "__main__":
    main()
