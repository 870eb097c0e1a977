"""CacheFL's privacy experiment (Fig. 6): Deep Leakage from Gradients on MNIST test digits.

    FEDSKEW_DATA=... python docs/reproduction/cachefl_privacy.py --images 4 --json out.json

One private digit per attack (batch 1, as in DLG), 100 L-BFGS iterations, reconstructions recorded every
20. Three observed gradients, all of the first local step of round 1 (the weights a client receives):

* ``dlg_lenet``: FedAvg on the sigmoid LeNet that Zhu et al. attack (weights uniform in [-0.5, 0.5]);
* ``cnn_mnist``: FedAvg on the from-scratch network of ``configs/cachefl/mnist-*-fedavg.yaml`` (PyTorch's
  default initialisation from the seed; dropout off, which can only help the attacker);
* ``cachefl``: CacheFL's gradient w.r.t. the cache keys W1 only (Eq. 8), the keys being the initial
  synthetic cache of ``configs/cachefl/mnist-iid.yaml``; the attacker optimises the 28x28 pixels through
  the frozen EfficientNet-Lite0 (resize to 112 px, ImageNet normalisation, L2 normalisation) and Eq. (7).

PSNR is on the [0, 1] pixel scale of the 28x28 digit. The grid shows the first image of each target.

``--targets cachefl_inversion`` runs the analytic attack of ``fedskew.experiment.cachefl_leak`` on the same
CacheFL gradients instead of DLG (its grid has one row per digit):

* the leak: f̂ (top right-singular vector, sign from the per-class multipliers) and the label from each
  digit's one-sample W1 gradient; batches of 2 and 4 test digits and a one-class client of 16 training
  digits (rank, the span, the label set by sign, and :func:`match_batch` for B <= 4);
* feature inversion: ``--steps`` Adam steps (lr ``--lr``, TV weight ``--tv``) on the 28x28 pixels through
  the frozen encoder towards f̂, from the mean image of the attacker's pool (or ``--start noise``);
* retrieval: the nearest of ``--pool`` MNIST training digits (the attacker's auxiliary data; the private
  digits are test digits) and of the 160 rendered cache images (the keys themselves), by feature cosine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fedskew.algorithms.cachefl import cache_logits
from fedskew.data.base import DATASETS, Dataset, resolve_root
from fedskew.experiment.build import vision_language_spec
from fedskew.experiment.cachefl_leak import (
    Inversion,
    PublicModel,
    invert_features,
    key_gradients,
    label_set_by_sign,
    leak_single,
    leaked_span,
    match_batch,
    retrieve,
    singular_ratios,
)
from fedskew.experiment.config import load_config
from fedskew.experiment.dlg import (
    GradientTarget,
    dlg_attack,
    dlg_lenet,
    module_target,
    psnr,
    save_dlg_grid,
    save_image_grid,
)
from fedskew.models import MODELS
from fedskew.models.backbones import BACKBONES, Backbone, to_backbone_input
from fedskew.models.backbones.efficientnet_lite import MEAN, STD
from fedskew.models.vision_language import (
    encode_cached,
    feature_cache,
    normalize,
    synthetic_set,
    text_embeddings,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/cachefl/mnist-iid.yaml"
GRID = Path(__file__).parent / "img/cachefl_dlg.png"
INVERSION_GRID = Path(__file__).parent / "img/cachefl_inversion.png"


def pixel_network(net: torch.nn.Module, mean: float, std: float) -> GradientTarget:
    """A from-scratch network fed ``(x − mean) / std`` as in the data pipeline; every weight observed."""
    net = net.eval()
    target = module_target(net)
    return GradientTarget(lambda x: net((x - mean) / std), target.params)


def cachefl_assets(config: Path, class_names: list[str]) -> tuple[Backbone, PublicModel, torch.Tensor, Path]:
    """The run's frozen backbone, its public cache model (the initial keys, W2, W_text, α, β, s; the same
    generator draw and feature cache as ``build_data``), the cache's rendered images, the feature cache."""
    cfg = load_config(config, [])
    spec = vision_language_spec(cfg.data.vision_language, cfg.seed)
    root = resolve_root(cfg.data.root)
    backbone = BACKBONES.get(spec.backbone)(root, **spec.backbone_options)
    size, cache_dir = spec.image_size or backbone.image_size, feature_cache(root)
    images, labels, rows = synthetic_set(spec, class_names, size, spec.seed)
    keys = normalize(encode_cached(backbone, images, "synthetic", rows, cache_dir))
    text = text_embeddings(spec, backbone, class_names, size, cache_dir)
    hyper = cfg.algorithm.hyper()
    model = PublicModel(keys, labels, text, hyper["alpha"], hyper["beta"], hyper["logit_scale"])
    return backbone, model, images, cache_dir


def encoder(backbone: Backbone) -> Callable[[torch.Tensor], torch.Tensor]:
    """[0, 1] digits -> features through the encoder itself (``encode_images`` runs without autograd)."""
    return lambda x: backbone.net(to_backbone_input(x, backbone.image_size, MEAN, STD))  # type: ignore[attr-defined]


def cachefl_target(config: Path, class_names: list[str]) -> GradientTarget:
    """Eq. (7) on the frozen backbone's normalised features of the pixels; only W1 (the keys) observed."""
    backbone, m, _, _ = cachefl_assets(config, class_names)
    keys, encode = m.keys.clone().requires_grad_(True), encoder(backbone)

    def logits(x: torch.Tensor) -> torch.Tensor:
        # the attacker differentiates through the encoder
        return cache_logits(normalize(encode(x)), m.text, keys, m.values, m.alpha, m.beta, m.scale)

    return GradientTarget(logits, (keys,))


def batch_leak(model: PublicModel, f: torch.Tensor, y: torch.Tensor) -> dict:
    """What one batch-mean W1 gradient of ``f``, ``y`` gives away: rank, span, label set (and B <= 4: the
    features and labels by :func:`match_batch`)."""
    b = f.shape[0]
    grad = key_gradients(model, f, y).mean(0)  # = the batch's cache_gradient
    ratios = singular_ratios(grad)
    present = torch.nonzero(label_set_by_sign(grad, model)).flatten().tolist()
    out = {
        "batch": b,
        "labels": sorted(y.tolist()),
        "sigma_ratios": [float(f"{v:.3g}") for v in ratios[: b + 1]],
        "span_norm_min": round(float((f @ leaked_span(grad, b)).norm(dim=1).min()), 6),
        "sign_label_set": present,
    }
    if b <= 4:
        match = match_batch(grad, model, b)
        cos = (f.double() @ match.features.double().T).max(1).values
        out |= {"match_labels": sorted(match.labels.tolist()), "match_cos_min": round(float(cos.min()), 6)}
        out["match_residual"] = float(f"{match.residual:.3g}")
    return out


def rounded(t: torch.Tensor, digits: int) -> list:
    return [round(float(v), digits) for v in t]


def inversion_grid(
    x: torch.Tensor, y: torch.Tensor, inv: Inversion, quality: torch.Tensor, found: dict
) -> list:
    """One row per digit: the private digit, the inversion snapshots, the nearest MNIST and font image."""
    rows = []
    for i in range(x.shape[0]):  # rows of the picture
        cells = [(x[i], f"digit {int(y[i])}\nprivate")]
        for t, snap, q, c in zip(inv.steps, inv.snapshots, quality, inv.cosine, strict=True):
            cells.append((snap[i], f"step {t}\n{float(q[i]):.1f} dB, cos {float(c[i]):.2f}"))
        cells.append((found["mnist"][i], f"MNIST nn: {found['mnist_y'][i]}\n{found['mnist_psnr'][i]:.1f} dB"))
        cells.append((found["font"][i], f"font nn: {found['font_y'][i]}"))
        rows.append(cells)
    return rows


def run_inversion(args: argparse.Namespace, ds: Dataset, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The analytic leak, the batch leak, feature inversion and retrieval (module doc); writes the grid."""
    backbone, model, synthetic, cache_dir = cachefl_assets(args.config, list(ds.class_names))
    encode = encoder(backbone)
    with torch.no_grad():
        f = normalize(encode(x))
    leak = leak_single(key_gradients(model, f, y), model)
    pool_x, pool_y = ds.x_train[: args.pool].float().div(255.0), ds.y_train[: args.pool]
    pool_f = normalize(
        encode_cached(backbone, ds.x_train[: args.pool], "train", torch.arange(args.pool), cache_dir)
    )
    own = torch.nonzero(ds.y_train[args.pool :] == y[0]).flatten()[:16] + args.pool  # a one-class client
    with torch.no_grad():
        client_f = normalize(encode(ds.x_train[own].float().div(255.0)))
    batches = [batch_leak(model, f[:b], y[:b]) for b in (2, 4) if b <= x.shape[0]]
    batches.append(batch_leak(model, client_f, ds.y_train[own].long()))
    start = {"mean": pool_x.mean(0, keepdim=True), "noise": torch.rand(1, *x.shape[1:])}[args.start]
    every = max(args.steps // 4, 1)
    inv = invert_features(
        encode, leak.feature, start.expand_as(x), steps=args.steps, lr=args.lr, tv=args.tv, record_every=every
    )
    quality = torch.stack([psnr(snap, x) for snap in inv.snapshots])
    near, font = retrieve(leak.feature, pool_f), retrieve(leak.feature, model.keys)
    found = {
        "mnist": pool_x[near],
        "mnist_y": pool_y[near].tolist(),
        "mnist_psnr": rounded(psnr(pool_x[near], x), 2),
        "font": synthetic[font].float().div(255.0).mean(1, keepdim=True),
        "font_y": model.labels[font].tolist(),
    }
    save_image_grid(args.inversion_grid, inversion_grid(x, y, inv, quality, found))
    return {
        "cos_feature": rounded((leak.feature * f).sum(1), 7),
        "sigma2_over_sigma1": [float(f"{v:.3g}") for v in leak.ratio],
        "labels": y.tolist(),
        "labels_leaked": leak.label.tolist(),
        "labels_recovered": int((leak.label == y).sum()),
        "orientation_by_signs": int(leak.by_signs.sum()),
        "batches": batches,
        "inversion": {
            "start": args.start,
            "steps": args.steps,
            "lr": args.lr,
            "tv": args.tv,
            "psnr_by_step": {str(t): rounded(q, 2) for t, q in zip(inv.steps, quality, strict=True)},
            "cos_by_step": {str(t): rounded(c, 4) for t, c in zip(inv.steps, inv.cosine, strict=True)},
        },
        "retrieval_mnist": {"pool": args.pool, "labels": found["mnist_y"], "psnr": found["mnist_psnr"]},
        "retrieval_fonts": {"pool": int(model.keys.shape[0]), "labels": found["font_y"]},
        "retrieval_top1": {
            "mnist": int((pool_y[near] == y).sum()),
            "fonts": int((model.labels[font] == y).sum()),
        },
    }


def run_dlg(target: GradientTarget, x: torch.Tensor, y: torch.Tensor, classes: int, iterations: int) -> tuple:
    """DLG on each digit alone; the summary and the first digit's result (for the grid)."""
    t0 = time.time()
    rows = [
        dlg_attack(target, x[i : i + 1], y[i : i + 1], classes, iterations=iterations, seed=i)
        for i in range(x.shape[0])
    ]
    final = torch.stack([r.psnr[-1, 0] for r in rows])
    summary = {
        "psnr_final": [round(float(v), 2) for v in final],
        "psnr_mean": round(float(final.mean()), 2),
        "psnr_std": round(float(final.std()), 2) if len(rows) > 1 else 0.0,
        "psnr_by_iteration": {
            str(it): round(float(torch.stack([r.psnr[k, 0] for r in rows]).mean()), 2)
            for k, it in enumerate(rows[0].iterations)
        },
        "labels_recovered": sum(int(r.labels[0] == y[i]) for i, r in enumerate(rows)),
        "observed_params": sum(p.numel() for p in target.params),
        "seconds": round(time.time() - t0, 1),
    }
    return summary, rows[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4, help="how many MNIST test digits (the first ones)")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--targets", default="dlg_lenet,cnn_mnist,cachefl", help="and/or cachefl_inversion")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--grid", type=Path, default=GRID)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--steps", type=int, default=300, help="cachefl_inversion: Adam steps on the pixels")
    p.add_argument("--lr", type=float, default=0.01, help="cachefl_inversion: Adam learning rate")
    p.add_argument("--tv", type=float, default=0.02, help="cachefl_inversion: total-variation weight")
    p.add_argument(
        "--start", choices=("mean", "noise"), default="mean", help="cachefl_inversion: start image"
    )
    p.add_argument(
        "--pool", type=int, default=2000, help="cachefl_inversion: MNIST training digits to search"
    )
    p.add_argument("--inversion-grid", type=Path, default=INVERSION_GRID)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    cfg = load_config(args.config, [])
    ds = DATASETS.get(cfg.data.dataset)(resolve_root(cfg.data.root))
    x = ds.x_test[: args.images].float().div(255.0)
    y = ds.y_test[: args.images].long()
    mean, std = float(ds.mean[0]), float(ds.std[0])
    shape, classes = tuple(x.shape[1:]), ds.num_classes
    builders = {
        "dlg_lenet": lambda: pixel_network(dlg_lenet(shape, classes, args.seed), mean, std),
        "cnn_mnist": lambda: pixel_network(MODELS.get("cnn_mnist")(shape, classes), mean, std),
        "cachefl": lambda: cachefl_target(args.config, list(ds.class_names)),
    }
    analyses = {"cachefl_inversion": run_inversion}
    out: dict[str, dict] = {}
    grid = {}
    for name in args.targets.split(","):
        torch.manual_seed(args.seed)
        t0 = time.time()
        if name in analyses:
            out[name] = {**analyses[name](args, ds, x, y), "seconds": round(time.time() - t0, 1)}
        else:
            out[name], grid[name] = run_dlg(builders[name](), x, y, classes, args.iterations)
        print(name, json.dumps(out[name]), flush=True)
    if grid:
        save_dlg_grid(args.grid, x[:1], grid)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"images": args.images, "iterations": args.iterations, **out}, indent=2)
        )


if __name__ == "__main__":
    main()
