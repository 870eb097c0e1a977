"""Core data types: the in-memory :class:`Dataset`, the dataset and partitioner registries, loading."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedskew.errors import DataError
from fedskew.registry import Registry, check_options

#: name -> ``loader(root: Path, **options) -> Dataset``
DATASETS: Registry = Registry("dataset")
#: name -> ``partition(labels, num_clients, seed, *, num_classes, domains, **params) -> list[np.ndarray]``
PARTITIONERS: Registry = Registry("partition scheme")

DEFAULT_ROOT = Path("~/.cache/fedskew")


def resolve_root(root: str | os.PathLike | None = None) -> Path:
    """The data root: explicit ``data.root``, else ``$FEDSKEW_DATA``, else ``~/.cache/fedskew``."""
    if root is not None and str(root) != "":
        return Path(root).expanduser()
    env = os.environ.get("FEDSKEW_DATA")
    if env:
        return Path(env).expanduser()
    return DEFAULT_ROOT.expanduser()


@dataclass(frozen=True)
class Normaliser:
    """uint8 images -> float32 in [0, 1], then per-channel ``(x - mean) / std``; other inputs are copied to
    float32 (tabular data and features are stored normalised). In place on one new tensor, so converting a
    large set costs one float32 copy, not three. Element-wise, so a batch converts to the same values as
    the rows of the whole set."""

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, x: Tensor) -> Tensor:
        x = x.float().div_(255.0) if x.dtype == torch.uint8 else x.to(torch.float32, copy=True)
        if x.dim() == 4:
            mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
            std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
            x.sub_(mean).div_(std)
        return x


@dataclass(frozen=True)
class FewShotSubset:
    """The few-shot draw a loader decoded instead of the whole training split (CoOp's 16-shot protocol on
    ImageNet-sized sets): exactly the rows :func:`~fedskew.data.federated.build_federated` uses with
    ``shots``, ``val_shots`` and ``seed``, so it must be called with the same three values."""

    shots: int
    val_shots: int | None
    seed: int


@dataclass
class Dataset:
    """A labelled dataset held as tensors, never as per-sample Python objects.

    Images are ``uint8`` tensors ``[N, C, H, W]`` (values 0..255); :meth:`to_float` converts a batch
    or the whole set to normalised ``float32``. Tabular data may be stored as ``float32`` directly.
    ``domain_train`` / ``domain_test`` (int64) tag each sample with a domain (feature skew).
    ``val_pool`` (bool ``[N_train]``) marks training rows that form a separate validation pool (CoOp's
    ``val`` split): they are never partitioned, and ``data.val_shots`` draws validation from them only.
    ``subset`` says the training rows are only a decoded few-shot draw (:class:`FewShotSubset`).
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)
    classes: list[str] | None = None
    domain_train: Tensor | None = None
    domain_test: Tensor | None = None
    domain_names: list[str] | None = None
    meta: dict = field(default_factory=dict)
    val_pool: Tensor | None = None
    subset: FewShotSubset | None = None

    def __post_init__(self) -> None:
        pool = self.val_pool
        if pool is not None and (pool.dtype != torch.bool or tuple(pool.shape) != (len(self.y_train),)):
            raise DataError(
                f"dataset '{self.name}': val_pool must be a bool mask over the {len(self.y_train)} training "
                f"rows, got {pool.dtype} {tuple(pool.shape)}"
            )

    @property
    def in_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. ``(1, 28, 28)``."""
        return tuple(self.x_train.shape[1:])

    @property
    def class_names(self) -> list[str]:
        """Class names by label (``classes``, or the label numbers when the source names none)."""
        return list(self.classes) if self.classes is not None else [str(c) for c in range(self.num_classes)]

    def to_float(self, x: Tensor) -> Tensor:
        """uint8 images -> float32 in [0, 1], then per-channel ``(x - mean) / std`` (:class:`Normaliser`)."""
        return self.normaliser()(x)

    def normaliser(self) -> Normaliser:
        """:meth:`to_float` as a small object that holds no tensors of the dataset: the engine keeps it, and
        the stored samples, instead of a normalised copy of the training set."""
        return Normaliser(tuple(self.mean), tuple(self.std))

    def __repr__(self) -> str:  # keep tensors out of reprs
        return (
            f"Dataset({self.name!r}, train={tuple(self.x_train.shape)}, test={tuple(self.x_test.shape)}, "
            f"classes={self.num_classes})"
        )


def load_dataset(name: str, root: str | os.PathLike | None = None, **options: Any) -> Dataset:
    """Load a registered dataset by name from the data root (``root`` > ``$FEDSKEW_DATA`` > default).

    Unknown names raise ``ConfigError`` listing the valid ones; unknown options list the allowed options.
    """
    loader = DATASETS.get(name)
    check_options(loader, options, f"dataset '{name}': unknown option '{{key}}'", skip=1)
    return loader(resolve_root(root), **options)
