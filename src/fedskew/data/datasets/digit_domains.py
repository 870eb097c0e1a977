"""``digit_domains``: a Digit-5-style feature-skew dataset that works offline (MP-FedCL's feature non-IID).

Digit-5 (MNIST, SVHN, USPS, SynthDigits, MNIST-M) needs four downloads; three of them are re-created here from
material that ships with our dependencies, following each original recipe. Every domain is a 10-class digit
set of RGB ``uint8`` images ``[N, 3, size, size]``, class-balanced, deterministic per ``seed``.

Domains (provenance and recipe; see docs/digit_domains.md for what is and is not faithful):

- ``mnist``: real MNIST (LeCun et al. 1998) from the data root, grey replicated to RGB.
- ``svhn``: real SVHN (Netzer et al. 2011), included when its ``.mat`` files are in the data root.
- ``usps_like``: scikit-learn's bundled handwritten digits (UCI optdigits: real writers, a second hand-writing
  source like USPS), bilinearly up-sampled from 8x8. Only 1,797 exist: when more are requested, the extra
  samples are the same digits under small random affine jitter (rotation +-10 deg, shift +-8%).
- ``mnist_m``: MNIST strokes blended with colour patches of real photographs, the MNIST-M recipe (Ganin &
  Lempitsky 2015): ``out = |patch - digit|`` per channel. The photographs are scikit-learn's two bundled
  sample images (``china.jpg``, ``flower.jpg``) instead of BSDS500.
- ``synth_digits``: digits rendered from the DejaVu fonts that matplotlib ships, the SynthDigits recipe (Ganin
  & Lempitsky 2015): random font, position, scale, rotation, foreground / background colours and blur, plus
  pixel noise. A glyph atlas is rendered once with Pillow; the augmentation is batched in torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew import numerics
from fedskew.data.base import DATASETS, Dataset
from fedskew.errors import ConfigError, DataError

ALL_DOMAINS = ("mnist", "svhn", "usps_like", "synth_digits", "mnist_m")
OFFLINE_DOMAINS = ("usps_like", "synth_digits")


def _stratified(labels: Tensor, per_class: int, rng: np.random.Generator) -> np.ndarray:
    """``per_class`` indices of each class; a class too small is used whole before any index repeats."""
    y = labels.numpy()
    out = []
    for c in range(10):  # ten classes, not a per-sample loop
        pool = np.flatnonzero(y == c)
        # whole shuffled copies of the pool: drawing with replacement would leave ~1/4 of the images unused
        reps = -(-per_class // len(pool))
        out.append(np.concatenate([rng.permutation(pool) for _ in range(reps)])[:per_class])
    return np.concatenate(out)


def _resize(x: Tensor, size: int) -> Tensor:
    """float [N, C, H, W] in [0, 1] -> [N, C, size, size]."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


def _affine(
    x: Tensor, rng: np.random.Generator, rot_deg: float, scale: tuple[float, float], shift: float
) -> Tensor:
    """Random rotation / scale / translation per sample, batched with ``affine_grid``."""
    n = x.shape[0]
    theta = np.deg2rad(rng.uniform(-rot_deg, rot_deg, n))
    s = rng.uniform(*scale, n)
    t = rng.uniform(-shift, shift, (n, 2))
    mat = np.stack(
        [
            np.stack([np.cos(theta) / s, -np.sin(theta) / s, t[:, 0]], 1),
            np.stack([np.sin(theta) / s, np.cos(theta) / s, t[:, 1]], 1),
        ],
        1,
    )
    grid = F.affine_grid(torch.as_tensor(mat, dtype=torch.float32), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, align_corners=False, padding_mode="zeros")


def _to_uint8(x: Tensor) -> Tensor:
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


# ---------------------------------------------------------------------------------------------- domains
def _mnist_split(root: Path, train: bool) -> tuple[Tensor, Tensor]:
    try:
        ds = DATASETS.get("mnist")(root)
    except DataError as err:
        raise DataError(
            f"digit_domains: domains 'mnist' and 'mnist_m' need MNIST ({err}); without it ask only for "
            f"domains={list(OFFLINE_DOMAINS)}"
        ) from None
    return (ds.x_train, ds.y_train) if train else (ds.x_test, ds.y_test)


def _domain_mnist(
    root: Path, n: int, train: bool, size: int, rng: np.random.Generator
) -> tuple[Tensor, Tensor]:
    x, y = _mnist_split(root, train)
    idx = _stratified(y, n // 10, rng)
    img = _resize(x[idx].float() / 255, size)
    return _to_uint8(img.expand(-1, 3, -1, -1)), y[idx]


def _domain_svhn(
    root: Path, n: int, train: bool, size: int, rng: np.random.Generator
) -> tuple[Tensor, Tensor]:
    ds = DATASETS.get("svhn")(root)
    x, y = (ds.x_train, ds.y_train) if train else (ds.x_test, ds.y_test)
    idx = _stratified(y, n // 10, rng)
    return _to_uint8(_resize(x[idx].float() / 255, size)), y[idx]


def _domain_usps_like(
    root: Path, n: int, train: bool, size: int, rng: np.random.Generator
) -> tuple[Tensor, Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(d.target, dtype=torch.int64)
    # fixed 80/20 split of the real writers (independent of the seed, so train and test never share an image)
    order = np.random.default_rng(12345).permutation(len(y))
    cut = int(0.8 * len(y))
    part = order[:cut] if train else order[cut:]
    x, y = x[part], y[part]
    idx = _stratified(y, n // 10, rng)
    img = _resize(x[idx], size)
    repeated = np.zeros(len(idx), dtype=bool)
    _, first = np.unique(idx, return_index=True)
    repeated[np.setdiff1d(np.arange(len(idx)), first)] = True
    if repeated.any():  # more requested than exist: jitter the duplicates so no two samples are identical
        jit = torch.as_tensor(repeated)
        img[jit] = _affine(img[jit], rng, 10.0, (0.92, 1.08), 0.08)
    return _to_uint8(img.expand(-1, 3, -1, -1)), y[idx]


def _photos() -> Tensor:
    from sklearn.datasets import load_sample_images

    imgs = load_sample_images().images  # two real photographs, 427x640x3 uint8
    return torch.as_tensor(np.stack(imgs)).float() / 255  # [2, H, W, 3]


def _domain_mnist_m(
    root: Path, n: int, train: bool, size: int, rng: np.random.Generator
) -> tuple[Tensor, Tensor]:
    x, y = _domain_mnist(root, n, train, size, rng)
    digit = x.float() / 255  # [n, 3, s, s], grey replicated
    photos = _photos()
    _, h, w, _ = photos.shape
    src = torch.as_tensor(rng.integers(0, photos.shape[0], n))
    oy = torch.as_tensor(rng.integers(0, h - size, n))
    ox = torch.as_tensor(rng.integers(0, w - size, n))
    ar = torch.arange(size)
    rows = (oy[:, None] + ar)[:, :, None]  # [n, s, 1]
    cols = (ox[:, None] + ar)[:, None, :]  # [n, 1, s]
    patch = photos[src[:, None, None], rows, cols]  # [n, s, s, 3]
    blended = (patch.permute(0, 3, 1, 2) - digit).abs()  # Ganin & Lempitsky: |background - digit|
    return _to_uint8(blended), y


def _glyph_atlas(canvas: int = 64) -> Tensor:
    """``[fonts, 10, canvas, canvas]`` white-on-black digit glyphs from matplotlib's DejaVu fonts."""
    import matplotlib
    from PIL import Image, ImageDraw, ImageFont

    font_dir = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    files = sorted(p for p in font_dir.glob("DejaVu*.ttf") if "Display" not in p.name)
    if not files:
        raise DataError(f"digit_domains: no DejaVu fonts found in {font_dir} (they ship with matplotlib)")
    atlas = np.zeros((len(files), 10, canvas, canvas), dtype=np.float32)
    for f_i, path in enumerate(files):
        font = ImageFont.truetype(str(path), int(canvas * 0.8))
        for d in range(10):
            img = Image.new("L", (canvas, canvas), 0)
            draw = ImageDraw.Draw(img)
            left, top, right, bottom = draw.textbbox((0, 0), str(d), font=font)
            pos = ((canvas - (right - left)) / 2 - left, (canvas - (bottom - top)) / 2 - top)
            draw.text(pos, str(d), fill=255, font=font)
            atlas[f_i, d] = np.asarray(img, dtype=np.float32) / 255
    return torch.as_tensor(atlas)


def _domain_synth_digits(
    root: Path, n: int, train: bool, size: int, rng: np.random.Generator
) -> tuple[Tensor, Tensor]:
    atlas = _glyph_atlas()
    fonts = atlas.shape[0]
    y = torch.as_tensor(np.repeat(np.arange(10), n // 10))
    font = torch.as_tensor(rng.integers(0, fonts, len(y)))
    masks = atlas[font, y].unsqueeze(1)  # [n, 1, 64, 64]
    masks = _affine(masks, rng, 15.0, (0.55, 0.9), 0.15)
    masks = _resize(masks, size)
    bg = torch.as_tensor(rng.uniform(0, 1, (len(y), 3, 1, 1)), dtype=torch.float32)
    # foreground far from the background in every channel on average (legible, as in SVHN-like renders)
    shift = torch.as_tensor(rng.uniform(0.35, 0.8, (len(y), 1, 1, 1)), dtype=torch.float32)
    direction = torch.where(bg.mean(1, keepdim=True) > 0.5, -1.0, 1.0)
    fg = bg + direction * shift + torch.as_tensor(rng.normal(0, 0.1, (len(y), 3, 1, 1)), dtype=torch.float32)
    img = bg * (1 - masks) + fg.clamp(0, 1) * masks
    sigma = torch.as_tensor(rng.uniform(0.0, 1.2, len(y)), dtype=torch.float32)
    img = _gaussian_blur(img, sigma)
    img = img + torch.as_tensor(rng.normal(0, 0.03, img.shape), dtype=torch.float32)
    return _to_uint8(img), y


def _gaussian_blur(img: Tensor, sigma: Tensor, radius: int = 2) -> Tensor:
    """Per-sample isotropic Gaussian blur (separable, batched as a grouped convolution)."""
    n, c, h, w = img.shape
    ar = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = numerics.exp(-(ar[None] ** 2) / (2 * sigma.clamp_min(1e-3)[:, None] ** 2))
    k = k / k.sum(1, keepdim=True)  # [n, 2r+1]; sigma ~ 0 gives a delta
    k = k.repeat_interleave(c, 0)  # one kernel per (sample, channel)
    flat = img.reshape(1, n * c, h, w)
    flat = F.conv2d(F.pad(flat, (radius, radius, 0, 0), mode="replicate"), k[:, None, None, :], groups=n * c)
    flat = F.conv2d(F.pad(flat, (0, 0, radius, radius), mode="replicate"), k[:, None, :, None], groups=n * c)
    return flat.reshape(n, c, h, w)


_BUILDERS = {
    "mnist": _domain_mnist,
    "svhn": _domain_svhn,
    "usps_like": _domain_usps_like,
    "synth_digits": _domain_synth_digits,
    "mnist_m": _domain_mnist_m,
}


def _svhn_present(root: Path) -> bool:
    return all((root / "svhn" / f).is_file() for f in ("train_32x32.mat", "test_32x32.mat"))


@DATASETS.register("digit_domains")
def load_digit_domains(
    root: Path,
    *,
    domains: list[str] | None = None,
    train_per_domain: int = 2000,
    test_per_domain: int = 500,
    seed: int = 0,
    size: int = 28,
) -> Dataset:
    """Digit-5-style feature skew offline: mnist, usps_like, mnist_m, synth_digits (+ svhn if present)."""
    if domains is None:
        domains = [d for d in ALL_DOMAINS if d != "svhn" or _svhn_present(Path(root))]
    unknown = [d for d in domains if d not in _BUILDERS]
    if unknown or not domains:
        raise ConfigError(
            f"digit_domains: unknown domain(s) {unknown or '(none given)'}; valid: {', '.join(ALL_DOMAINS)}"
        )
    if train_per_domain < 10 or test_per_domain < 10 or size < 8:
        raise ConfigError("digit_domains: train_per_domain and test_per_domain must be >= 10 and size >= 8")
    xs_tr: list[Tensor] = []
    ys_tr: list[Tensor] = []
    ds_tr: list[Tensor] = []
    xs_te: list[Tensor] = []
    ys_te: list[Tensor] = []
    ds_te: list[Tensor] = []
    for d_i, name in enumerate(domains):
        build = _BUILDERS[name]
        # one stream per (seed, domain, split): adding a domain never changes the others
        for train, n, xs, ys, dd in (
            (True, train_per_domain, xs_tr, ys_tr, ds_tr),
            (False, test_per_domain, xs_te, ys_te, ds_te),
        ):
            rng = np.random.default_rng([seed, ALL_DOMAINS.index(name), int(train)])
            x, y = build(Path(root), n - n % 10, train, size, rng)
            xs.append(x)
            ys.append(y)
            dd.append(torch.full((len(y),), d_i, dtype=torch.int64))
    return Dataset(
        name="digit_domains",
        x_train=torch.cat(xs_tr),
        y_train=torch.cat(ys_tr).long(),
        x_test=torch.cat(xs_te),
        y_test=torch.cat(ys_te).long(),
        num_classes=10,
        mean=(0.5, 0.5, 0.5),  # Digit-5 at mean 0.5, std 0.5, as FedPCL's code (MP-FedCL gives none)
        std=(0.5, 0.5, 0.5),
        classes=[str(i) for i in range(10)],
        domain_train=torch.cat(ds_tr),
        domain_test=torch.cat(ds_te),
        domain_names=list(domains),
        meta={"domains_used": list(domains), "seed": seed},
    )
