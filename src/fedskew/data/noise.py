"""Noise-based feature skew (NIID-Bench, Li, Diao, Chen, He 2022, ICDE, §4.2 "noise-based feature
imbalance"): the data are split first (IID in the paper), then client i's training inputs get Gaussian noise
of standard deviation ``σ · i / (N − 1)``, so the clients' feature distributions differ by a controlled amount
while their label distributions do not.

The noise is added on the [0, 1] pixel scale before the dataset's normalisation, as NIID-Bench's
``AddGaussianNoise`` transform follows ``ToTensor``. One deviation (docs/decisions.md, "NIID-Bench: feature
noise drawn once"): NIID-Bench's transform draws fresh noise at every read, so every epoch sees new noise;
here it is drawn once per sample from the run's seed and stored, so every engine mode and runtime reads the
same inputs (the noise level per client, the quantity the setting is about, is the paper's). The test sets
stay clean (NIID-Bench evaluates on the original test set).
"""

from __future__ import annotations

import dataclasses

import torch

from fedskew.data.federated import FederatedData
from fedskew.data.partition.core import child_seed
from fedskew.errors import ConfigError

#: sub-seed tag of the noise stream (independent of the partition's streams)
NOISE_TAG = 7301


def noise_levels(sigma: float, num_clients: int) -> list[float]:
    """Client i's noise standard deviation ``σ · i / (N − 1)`` (NIID-Bench); ``[0]`` for one client."""
    if num_clients == 1:
        return [0.0]
    return [sigma * i / (num_clients - 1) for i in range(num_clients)]


def with_feature_noise(fed: FederatedData, sigma: float) -> FederatedData:
    """``fed`` with client i's training (and validation) samples noised at level ``σ·i/(N−1)``; the
    inputs become normalised float32 (the noise must be added before the normalisation)."""
    if sigma <= 0:
        return fed
    ds = fed.dataset
    if ds.x_train.dtype != torch.uint8:
        raise ConfigError(
            "data.feature_noise needs image data stored as uint8 pixels (NIID-Bench adds noise on the "
            f"[0, 1] pixel scale); dataset '{ds.name}' stores {ds.x_train.dtype}"
        )
    x = ds.x_train.float().div_(255.0)
    gen = torch.Generator().manual_seed(child_seed(fed.seed, NOISE_TAG))
    levels = noise_levels(sigma, fed.num_clients)
    for cid, level in enumerate(levels):  # one vectorised draw per client (a handful of clients)
        rows = torch.cat([fed.train_idx[cid], *(fed.val_idx[cid : cid + 1] if fed.val_idx else [])])
        if level > 0 and rows.numel():
            x[rows] += level * torch.randn((rows.numel(), *x.shape[1:]), generator=gen)
    normalise = ds.normaliser()
    noisy = dataclasses.replace(
        ds,
        x_train=normalise(x),  # float input: normalised per channel by the same rule as uint8 rows
        x_test=ds.to_float(ds.x_test),
        mean=(0.0,) * len(ds.mean),
        std=(1.0,) * len(ds.std),
        meta={**ds.meta, "feature_noise": {"sigma": sigma, "levels": levels}},
    )
    return dataclasses.replace(fed, dataset=noisy)
