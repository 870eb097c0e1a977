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
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fedskew.algorithms.cachefl import cache_logits
from fedskew.data.base import DATASETS, resolve_root
from fedskew.experiment.config import load_config
from fedskew.experiment.dlg import GradientTarget, dlg_attack, dlg_lenet, module_target, save_dlg_grid
from fedskew.experiment.runner import vision_language_spec
from fedskew.models import MODELS
from fedskew.models.backbones import BACKBONES, to_backbone_input
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


def pixel_network(net: torch.nn.Module, mean: float, std: float) -> GradientTarget:
    """A from-scratch network fed ``(x − mean) / std`` as in the data pipeline; every weight observed."""
    net = net.eval()
    target = module_target(net)
    return GradientTarget(lambda x: net((x - mean) / std), target.params)


def cachefl_target(config: Path, class_names: list[str]) -> GradientTarget:
    """Eq. (7) on the frozen backbone's normalised features of the pixels; only W1 (the keys) observed.

    The keys and W_text are the run's: the same generator draw and feature cache as ``build_data``."""
    cfg = load_config(config, [])
    spec = vision_language_spec(cfg.data.vision_language)
    root = resolve_root(cfg.data.root)
    backbone = BACKBONES.get(spec.backbone)(root, **spec.backbone_options)
    size, cache_dir = spec.image_size or backbone.image_size, feature_cache(root)
    images, labels, rows = synthetic_set(spec, class_names, size, spec.seed)
    keys = normalize(encode_cached(backbone, images, "synthetic", rows, cache_dir)).requires_grad_(True)
    text = text_embeddings(spec, backbone, class_names, size, cache_dir)
    values = F.one_hot(labels.long(), len(class_names)).float()
    hyper = cfg.algorithm.hyper()

    def logits(x: torch.Tensor) -> torch.Tensor:
        # the encoder itself (encode_images runs without autograd): the attacker differentiates through it
        f = normalize(backbone.net(to_backbone_input(x, backbone.image_size, MEAN, STD)))
        return cache_logits(f, text, keys, values, hyper["alpha"], hyper["beta"], hyper["logit_scale"])

    return GradientTarget(logits, (keys,))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4, help="how many MNIST test digits (the first ones)")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--targets", default="dlg_lenet,cnn_mnist,cachefl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--grid", type=Path, default=GRID)
    p.add_argument("--json", type=Path, default=None)
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
    out: dict[str, dict] = {}
    grid = {}
    for name in args.targets.split(","):
        torch.manual_seed(args.seed)
        target = builders[name]()
        t0 = time.time()
        rows = [
            dlg_attack(target, x[i : i + 1], y[i : i + 1], classes, iterations=args.iterations, seed=i)
            for i in range(x.shape[0])
        ]
        final = torch.stack([r.psnr[-1, 0] for r in rows])
        out[name] = {
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
        grid[name] = rows[0]
        print(name, json.dumps(out[name]), flush=True)
    save_dlg_grid(args.grid, x[:1], grid)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"images": args.images, "iterations": args.iterations, **out}, indent=2)
        )


if __name__ == "__main__":
    main()
