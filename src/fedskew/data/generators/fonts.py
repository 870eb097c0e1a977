"""``fonts``: renders class names that are short strings (digits, letters) with the installed TrueType fonts.

An offline stand-in for a text-to-image model on character datasets (MNIST, EMNIST, digits): each class
name is drawn in a random font with a random size, rotation, stroke width, position and foreground /
background colour. Printed glyphs are far from handwriting, so the set has a real style gap to the client
data, as DALL·E images have to a downstream dataset (CacheFL, Eq. 2).

Fonts are found at run time: every ``*.ttf`` / ``*.otf`` under the installed Python packages
(matplotlib ships DejaVu, STIX and Computer Modern fonts) and, with ``system_fonts``, under the usual
system font folders; the files are taken in sorted order and de-duplicated by file name (the first wins,
packages before system folders). ``fonts`` keeps the files whose name matches one of its glob patterns
(text fonts by default: symbol and math fonts map digits to other glyphs). A font is then used only if it
draws every character of every class name, non-empty, different from its "missing glyph" box, and with
distinct glyphs for distinct names. :func:`font_files` lists the fonts a call uses, so a run can record
them; a different set of installed fonts gives different images.

Each glyph is rasterised once per (font, class) with Pillow; the per-image geometry (scale, rotation,
shift), stroke (a max-pool dilation) and colours are applied to whole batches with torch.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import os
import sysconfig
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew import numerics
from fedskew.data.generators import GENERATORS, GeneratedImages
from fedskew.errors import ConfigError

#: default file-name patterns: text fonts whose digit and letter code points hold those glyphs
TEXT_FONTS = (
    "DejaVu*",
    "Liberation*",
    "Free*",
    "Noto*",
    "Ubuntu*",
    "STIXGeneral*",
    "cmr10.*",
    "cmb10.*",
    "cmss10.*",
    "cmtt10.*",
    "cmti10.*",
)
SYSTEM_FONT_DIRS = ("/usr/share/fonts", "/usr/local/share/fonts", "/Library/Fonts", "C:/Windows/Fonts")
_SUFFIXES = (".ttf", ".otf")
_GLYPH = 64  # side of the canvas each glyph is rasterised on
_MISSING = "\U0010fffd"  # a private-use code point no text font maps: draws the "missing glyph" box


def _walk(folder: str) -> list[str]:
    out: list[str] = []
    for d, _, files in os.walk(folder):
        out += [os.path.join(d, f) for f in files if f.lower().endswith(_SUFFIXES)]
    return sorted(out)


@functools.lru_cache(maxsize=8)
def _discover(font_dirs: tuple[str, ...]) -> tuple[str, ...]:
    seen: dict[str, str] = {}
    for folder in font_dirs:
        for path in _walk(folder):
            seen.setdefault(os.path.basename(path), path)
    return tuple(seen.values())


def default_font_dirs(system_fonts: bool = True) -> list[str]:
    """The folders searched by default: the interpreter's package folders, then system font folders."""
    paths = sysconfig.get_paths()
    dirs = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    return dirs + [d for d in SYSTEM_FONT_DIRS if system_fonts and os.path.isdir(d)]


def _render(path: str, text: str) -> np.ndarray:
    """``text`` in the font at ``path``, centred on a ``_GLYPH``² canvas, as a float mask in [0, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    size = int(_GLYPH * 0.7)
    font = ImageFont.truetype(path, size)
    box = font.getbbox(text)
    w, h = box[2] - box[0], box[3] - box[1]
    if w > 0 and h > 0 and max(w, h) > 0.8 * _GLYPH:  # long names: shrink to fit
        font = ImageFont.truetype(path, max(4, int(size * 0.8 * _GLYPH / max(w, h))))
        box = font.getbbox(text)
        w, h = box[2] - box[0], box[3] - box[1]
    im = Image.new("L", (_GLYPH, _GLYPH), 0)
    ImageDraw.Draw(im).text(((_GLYPH - w) / 2 - box[0], (_GLYPH - h) / 2 - box[1]), text, font=font, fill=255)
    return np.asarray(im, dtype=np.float32) / 255.0


def _draws(path: str, names: tuple[str, ...]) -> np.ndarray | None:
    """Glyph masks ``[C, G, G]`` of ``names`` in this font, or ``None`` when it cannot draw one of them."""
    try:
        masks = np.stack([_render(path, n) for n in names])
        missing = _render(path, _MISSING)
    except OSError:  # not a font Pillow/FreeType can read
        return None
    ink = masks.reshape(len(names), -1)
    if (ink.max(1) < 0.5).any() or any(np.array_equal(m, missing) for m in masks):
        return None
    distinct = len({m.tobytes() for m in masks}) == len(set(names))
    return masks if distinct else None


@functools.lru_cache(maxsize=8)
def _glyphs(names: tuple[str, ...], fonts: tuple[str, ...], font_dirs: tuple[str, ...]) -> tuple:
    files = [p for p in _discover(font_dirs) if any(fnmatch.fnmatch(os.path.basename(p), g) for g in fonts)]
    kept, masks = [], []
    for path in files:  # per font file (a few dozen), not per sample
        m = _draws(path, names)
        if m is not None:
            kept.append(path)
            masks.append(m)
    if not kept:
        raise ConfigError(
            f"generator 'fonts': none of the {len(files)} font files matching {list(fonts)} under "
            f"{list(font_dirs)} draws every class name ({', '.join(map(repr, names[:5]))}, ...); "
            "set the fonts / font_dirs options"
        )
    return tuple(kept), torch.from_numpy(np.stack(masks))  # [F, C, G, G]


def _check_names(names: Sequence[str], max_chars: int) -> None:
    for n in names:
        if not n or len(n) > max_chars or not n.isprintable() or n.isspace():
            raise ConfigError(
                f"generator 'fonts': class name {n!r} is not renderable: names must be 1..{max_chars} "
                "printable characters (digits or letters, e.g. MNIST's '0'..'9')"
            )


def font_files(
    class_names: Sequence[str],
    fonts: Sequence[str] = TEXT_FONTS,
    font_dirs: Sequence[str] | None = None,
    system_fonts: bool = True,
) -> list[str]:
    """The font files the ``fonts`` generator draws ``class_names`` with (same options, same order)."""
    dirs = tuple(font_dirs) if font_dirs is not None else tuple(default_font_dirs(system_fonts))
    return list(_glyphs(tuple(class_names), tuple(fonts), dirs)[0])


def _colours(n: int, colour: bool, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Foreground / background ``[n, 3, 1, 1]``: one dark, one light (random polarity), contrast >= 0.2."""
    dark = 0.4 * torch.rand(n, 3 if colour else 1, generator=g)
    light = 0.6 + 0.4 * torch.rand(n, 3 if colour else 1, generator=g)
    flip = torch.rand(n, 1, generator=g) < 0.5
    fg, bg = torch.where(flip, light, dark), torch.where(flip, dark, light)
    return fg.expand(n, 3)[:, :, None, None], bg.expand(n, 3)[:, :, None, None]


def _stroke(masks: Tensor, width: Tensor) -> Tensor:
    """Thicken each mask by ``width[i]`` pixels (max-pool dilation), one pass per distinct width."""
    out = masks.clone()
    for w in torch.unique(width).tolist():  # a handful of widths, not a loop over samples
        if w > 0:
            sel = width == w
            out[sel] = F.max_pool2d(masks[sel], 2 * w + 1, stride=1, padding=w)
    return out


@GENERATORS.register("fonts")
def fonts_generator(
    class_names: Sequence[str],
    per_class: int,
    seed: int,
    size: int,
    *,
    fonts: Sequence[str] = TEXT_FONTS,
    font_dirs: Sequence[str] | None = None,
    system_fonts: bool = True,
    max_chars: int = 3,
    rotation: float = 15.0,
    scale: tuple[float, float] = (0.55, 0.95),
    jitter: float = 0.12,
    max_stroke: int = 2,
    colour: bool = True,
    noise: float = 0.02,
) -> GeneratedImages:
    """Class names (<= ``max_chars`` characters) drawn in random installed fonts, sizes, angles and colours.

    Per image: a font drawn uniformly from :func:`font_files`; glyph height ``scale`` (min, max) of the
    image; rotation uniform in ±``rotation`` degrees; shift uniform in ±``jitter`` of the side; stroke
    dilation 0..``max_stroke`` pixels on the 64-pixel glyph canvas; a dark and a light colour (RGB when
    ``colour``, grey otherwise) in random polarity; Gaussian pixel noise ``noise``.
    """
    _check_names(class_names, max_chars)
    if not 0 < scale[0] <= scale[1]:
        raise ConfigError(f"generator 'fonts': scale must be (min, max) with 0 < min <= max, got {scale}")
    dirs = tuple(font_dirs) if font_dirs is not None else tuple(default_font_dirs(system_fonts))
    _, glyphs = _glyphs(tuple(class_names), tuple(fonts), dirs)
    g = torch.Generator().manual_seed(int(seed))
    labels = torch.arange(len(class_names)).repeat_interleave(per_class)
    n = labels.numel()
    font = torch.randint(glyphs.shape[0], (n,), generator=g)
    masks = glyphs[font, labels][:, None]  # [n, 1, G, G]
    masks = _stroke(masks, torch.randint(max_stroke + 1, (n,), generator=g))
    # glyphs fill ~0.7 of their canvas; the sampling grid maps the output onto it at the drawn scale
    zoom = 0.7 / (scale[0] + (scale[1] - scale[0]) * torch.rand(n, generator=g))
    angle = (2 * torch.rand(n, generator=g) - 1) * math.radians(rotation)
    shift = (2 * torch.rand(n, 2, generator=g) - 1) * 2 * jitter
    cos, sin = numerics.cos(angle) * zoom, numerics.sin(angle) * zoom
    theta = torch.stack(
        [torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1
    )
    grid = F.affine_grid(theta, [n, 1, size, size], align_corners=False)
    ink = F.grid_sample(masks, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    fg, bg = _colours(n, colour, g)
    img = bg + (fg - bg) * ink + noise * torch.randn(n, 3, size, size, generator=g)
    return GeneratedImages((img.clamp(0, 1) * 255).round().to(torch.uint8), labels)
