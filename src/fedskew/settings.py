"""The run settings every layer reads: the validated ``client``, ``eval`` and ``engine`` config sections.

They live here, below every layer, so that algorithms (which read ``client``), the engine and the experiment
config share one definition: the engine reads the sections pydantic validated, nothing is copied into a
second type.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from fedskew.search_space import tunable


class Strict(BaseModel):
    """A config section: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")


Beta = Annotated[float, Field(ge=0, lt=1)]
ADAMW_BETAS, ADAMW_EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults


def _constant_shape(t: int, rounds: int, floor: float) -> float:
    return 1.0


def _cosine_shape(t: int, rounds: int, floor: float) -> float:
    """η_min/η + (1 − η_min/η) · ½(1 + cos(π (t − 1) / T)): cosine annealing (Loshchilov & Hutter 2017,
    Eq. 5, the restart-free schedule of ``torch.optim.lr_scheduler.CosineAnnealingLR``) over the run's rounds
    t = 1..T instead of over iterations."""
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * (t - 1) / rounds))


#: ``client.lr_schedule``: the round-t shape of the learning rate, a factor of ``client.lr`` (``floor`` is
#: ``lr_min / lr``)
LR_SHAPES: dict[str, Callable[[int, int, float], float]] = {
    "constant": _constant_shape,
    "cosine": _cosine_shape,
}


class ClientSection(Strict):
    epochs: int = Field(1, ge=0, description="local epochs per round")
    batch_size: int = Field(32, ge=1, description="local mini-batch size")
    lr: float = tunable(
        0.01, low=1e-3, high=0.5, log=True, gt=0, description="local learning rate"
    )  # the search space `fedskew tune` gives every method's lr
    momentum: float = Field(0.0, ge=0, lt=1, description="local SGD momentum (0 with optimizer adamw)")
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="weight decay: sgd adds weight_decay·p to the gradient; adamw decays p ← p − lr·wd·p "
        "(decoupled; torch.optim.AdamW's default, and Tip-Adapter-F's, is 0.01)",
    )
    fraction: float = Field(1.0, gt=0, le=1, description="share of clients sampled per round")
    lr_decay: float = Field(
        1.0, gt=0, le=1, description="round-t learning rate = lr · lr_decay^(t−1) (MP-FedCL: 0.95)"
    )
    optimizer: Literal["sgd", "adamw"] = Field(
        "sgd",
        description="local optimizer: sgd (momentum, L2 weight decay), or adamw (torch.optim.AdamW's update; "
        "a deviation for adapter fine-tuning, Tip-Adapter-F); its state is fresh every round",
    )
    betas: tuple[Beta, Beta] = Field(ADAMW_BETAS, description="adamw: the moments' decay rates (β₁, β₂)")
    eps: float = Field(ADAMW_EPS, gt=0, description="adamw: ε added to √v̂ (Tip-Adapter-F: 1e-4)")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="round-t learning rate shape, times lr_decay's factor: constant, or cosine: "
        "lr_min + (lr − lr_min)·½(1 + cos(π(t−1)/T)) over the run's T rounds",
    )
    lr_min: float = Field(0.0, ge=0, description="cosine: the learning rate η_min approached at round T")

    @field_validator("optimizer")
    @classmethod
    def _optimizer(cls, v: str, info: ValidationInfo) -> str:
        if v == "adamw" and info.data.get("momentum"):
            raise ValueError("adamw needs client.momentum=0 (β₁ is its momentum); allowed with momentum: sgd")
        return v

    @field_validator("betas", "eps")
    @classmethod
    def _adamw_only(cls, v: object, info: ValidationInfo) -> object:
        default = {"betas": ADAMW_BETAS, "eps": ADAMW_EPS}[str(info.field_name)]
        if v != default and info.data.get("optimizer") != "adamw":
            raise ValueError(f"client.{info.field_name} applies to client.optimizer=adamw only")
        return v

    @field_validator("lr_min")
    @classmethod
    def _lr_min(cls, v: float, info: ValidationInfo) -> float:
        if v and info.data.get("lr_schedule") != "cosine":
            raise ValueError("client.lr_min applies to client.lr_schedule=cosine only")
        if v > info.data.get("lr", math.inf):
            raise ValueError(f"client.lr_min must not exceed client.lr={info.data['lr']}")
        return v

    def round_lr_scale(self, round_idx: int, rounds: int) -> float:
        """The factor on every phase's learning rate in round ``round_idx`` (1-based) of a ``rounds``-round
        run: ``lr_decay^(t−1)`` times the ``lr_schedule`` shape (1 for ``constant``)."""
        shape = LR_SHAPES[self.lr_schedule](round_idx, rounds, self.lr_min / self.lr)
        return self.lr_decay ** (round_idx - 1) * shape


class EvalSection(Strict):
    protocol: Literal["global", "personalized"] = Field("global", description="evaluation protocol")
    every: int = Field(1, ge=1, description="evaluate every k rounds (and always at the last round)")
    batch_size: int | None = Field(
        None,
        ge=1,
        description="evaluation batch size (default: 128 on CPU, where a CNN's activations stay in cache, "
        "1024 on a GPU); results do not depend on it",
    )
    per_class: bool = Field(
        False,
        description="also log accuracy_classes: per class, the test accuracy on that class's test samples "
        "(null: none; personalized: each client's own model, samples pooled); embedded runtime only",
    )


class NodeDataSection(Strict):
    """``data.nodes``: node-local data (``data.source: nodes``, docs/deployment.md "Silos")."""

    clients: int = Field(1, ge=1, description="clients per node, split locally by data.partition")
    roots: list[str] = Field(
        default_factory=list,
        description="node i's data root (embedded and flower-simulation runs, and the nodes "
        "flower-deployment starts); a deployed SuperNode's own data-root node config takes precedence",
    )
    classes: list[str] | None = Field(
        None,
        description="the federation's label space by class name; a node may hold a subset (default: every "
        "node must report the same classes)",
    )
    server_root: str | None = Field(
        None,
        description="the server's own data root (same dataset and layout as a node's): the global model is "
        "also scored on its test split (central_accuracy, central_loss)",
    )


def host_port(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(HOST, PORT)``; ``ValueError`` naming the expected form otherwise."""
    host, sep, port = address.strip().rpartition(":")
    if not (sep and host and "/" not in host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError("expected HOST:PORT of a Ray head node, e.g. 10.0.0.5:6379 (no ray:// client URL)")
    return host.strip("[]"), int(port)


class SecAggSection(Strict):
    """``engine.secagg``: Flower's SecAgg+ (Bell et al. 2020) on the Flower runtimes, with the parameters of
    ``flwr.server.workflow.SecAggPlusWorkflow`` (docs/deployment.md, :mod:`fedskew.flower.secure`)."""

    shares: int | float = Field(
        1.0,
        gt=0,
        description="shares each node's secrets are split into: an integer >= 3, or a share (0, 1] of the "
        "round's nodes (1.0: every node holds a share of every other's, Flower's SecAgg)",
    )
    threshold: int | float = Field(
        0.67,
        gt=0,
        description="shares that rebuild a secret: an integer >= 2 below shares, or a share (0, 1] of "
        "shares (at least 2); shares - threshold nodes may drop out of a round, fewer than threshold "
        "colluding with the server learn nothing",
    )
    clipping_range: float = Field(
        8.0,
        gt=0,
        description="each node's update (weighted mean of its clients' uploads minus what they were sent) is "
        "quantized on [-c, c]; a node whose update leaves it fails the round's training",
    )
    quantization_range: int = Field(
        2**22, ge=2, lt=2**32, description="quantization levels over [-c, c] (Flower's default 2^22)"
    )

    @field_validator("shares", "threshold")
    @classmethod
    def _share_count(cls, v: int | float, info: ValidationInfo) -> int | float:
        """Flower's ``SecAggPlusWorkflow`` rules: an integer count (shares >= 3, threshold >= 2) or a share
        in (0, 1]."""
        low = 3 if info.field_name == "shares" else 2
        if isinstance(v, int) and v != 1 and v < low:
            raise ValueError(f"allowed: an integer >= {low} or a share in (0, 1]")
        if isinstance(v, float) and not 0 < v <= 1:
            raise ValueError(f"allowed: an integer >= {low} or a share in (0, 1]")
        return v

    @model_validator(mode="after")
    def _threshold_below_shares(self) -> SecAggSection:
        if isinstance(self.shares, int) and isinstance(self.threshold, int) and self.threshold >= self.shares:
            raise ValueError(f"threshold={self.threshold} must be below shares={self.shares}")
        return self


class EngineSection(Strict):
    mode: str = Field(
        "auto",
        description="client execution: a registered executor (sequential, vectorized: torch.func over the "
        "sampled clients), or auto (vectorized for small dropout-free models at small batches, else "
        "workers if > 1, else sequential)",
    )
    workers: int = Field(
        1, ge=1, description="processes that train clients in parallel, one thread each (1: in-process)"
    )
    threads: int = Field(
        0,
        ge=0,
        description="torch threads of the run's process (`--threads`): 0 or auto: the cores free as the run "
        "starts (affinity, cgroup quota, minus those other processes keep busy) divided by the processes it "
        "starts (main + workers), at least 1 ($OMP_NUM_THREADS if set); runtime-only: recorded in the "
        "summary, not compared on --resume (fedskew/threads.py)",
    )
    device: str = Field(
        "auto",
        description="torch device: auto (CUDA if present, else MPS, else CPU; the choice is logged and "
        "written to config.yaml), cpu, cuda, cuda:N, mps",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="forward passes (local losses, evaluation) in float32, or under bfloat16 autocast "
        "(parameters, optimizer and aggregation stay float32); bf16 changes the numbers",
    )
    deterministic: bool = Field(
        False,
        description="torch's deterministic algorithms for the run (cuBLAS workspace, no cuDNN benchmarking): "
        "bit-reproducible GPU runs where every operation has a deterministic implementation",
    )
    memory_mb: float = Field(1024.0, gt=0, description="memory budget of one vectorized chunk of clients")
    fold_uploads: bool = Field(
        True,
        description="methods that aggregate with FedAvg's sample-weighted mean (as the base class "
        "writes it): fold each upload into the mean as it arrives, in sampling order, bit for bit the mean "
        "of the held uploads (worker processes take turns on one shared sum and send back no upload). "
        "false: hold the round's uploads and average them at the end",
    )
    state_memory_mb: float = Field(
        64.0,
        gt=0,
        description="memory for the clients' committed states (personal models, control variates, ...) and, "
        "separately, as much again for the server's per-client tables (FedFomo, FedPAC); the least recently "
        "trained beyond it wait on disk (<out>/client-states, or a temporary folder under $FEDSKEW_CACHE) "
        "and are read back exactly",
    )
    memory_format: Literal["auto", "contiguous", "channels_last"] = Field(
        "auto",
        description="tensor layout of 2-d convolutional models: channels_last (NHWC, faster on CPU), "
        "contiguous (NCHW), or auto (channels_last on CPU unless engine.mode=vectorized)",
    )
    runtime: str = Field(
        "embedded",
        description="where the federation runs, a registered runtime (fedskew.runtimes): embedded (this "
        "process), flower-simulation (Flower's simulation runtime) or flower-deployment (a local Flower "
        "SuperLink and engine.nodes SuperNodes on loopback; see docs/deployment.md; the Flower ones need the "
        "[flower] extra), or a plugin's",
    )
    nodes: int = Field(
        3,
        ge=1,
        description="Flower SuperNodes; client c lives on node c % nodes (data.source: nodes: on node "
        "c // data.nodes.clients)",
    )
    insecure: bool = Field(
        False,
        description="flower-deployment: run the local SuperLink and SuperNodes with Flower's --insecure and "
        "no node authentication (default: TLS and a key per node, made for the run); runtime-only",
    )
    secagg: SecAggSection | None = Field(
        None,
        description="Flower runtimes: secure aggregation with Flower's SecAgg+ (the ServerApp sees only the "
        "sum of the nodes' masked updates) for methods whose aggregation is a weighted mean; unset: off",
    )
    round_timeout: float = Field(
        600.0,
        gt=0,
        description="Flower runtimes: seconds a round (training or evaluation) waits for the nodes' "
        "replies; clients of nodes that did not reply are dropped from the round",
    )
    ray_address: str | None = Field(
        None,
        description="engine.runtime=flower-simulation: HOST:PORT of an existing Ray cluster's head "
        "(`ray start --head --port PORT`) whose nodes host the virtual SuperNodes' actors; unset: "
        "$RAY_ADDRESS if set, else a local Ray instance started for the run (docs/deployment.md)",
    )

    on_client_error: Literal["drop_non_finite", "drop", "fail"] = Field(
        "drop_non_finite",
        description="a client that fails: drop_non_finite drops an update with NaN/Inf from the round "
        "(logged, counted in 'rejected') and fails the round when a client raises (a bug); drop drops "
        "either; fail fails the round on either (nothing of it is committed; the run stops with one line "
        "and resumes from the last committed round). A round with every client dropped is recorded as "
        "skipped. An algorithm's ContractError always fails the round",
    )
    max_skipped_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="the run counts as failed (summary.json status: failed, exit code 1; its results are "
        "still written) when more than this share of its rounds accepted no upload (every sampled client "
        "rejected or dropped); 1: never. A final non-finite loss or accuracy always fails the run",
    )

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, v: object) -> object:
        if isinstance(v, str) and not v.strip().lstrip("-").isdigit():
            if v.strip() != "auto":
                raise ValueError("allowed: auto (or 0: the free cores / the run's processes) or a count >= 1")
            return 0
        return v

    @field_validator("ray_address")
    @classmethod
    def _ray_address(cls, v: str | None) -> str | None:
        if v is not None:
            host_port(v)
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        kind, _, index = v.partition(":")
        indexed_cuda = kind == "cuda" and index.isdigit()
        if v != "auto" and (kind not in ("cpu", "cuda", "mps") or (index and not indexed_cuda)):
            raise ValueError("allowed: auto, cpu, cuda, cuda:N, mps")
        return v


# ---------------------------------------------------------------------------- security (docs/security.md)
#: names are checked against ``fedskew.algorithms.security.ATTACKS`` / ``DEFENCES`` when the run is built
#: (registries, so a plugin may add one): "none", "label_flip", "backdoor", "sign_flip", "gaussian",
#: "scaling", "alie"; "mean", "median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geomed", "norm_bound"
AttackName = str
DefenceName = str


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AttackSection(_Section):
    """Malicious clients (simulation only: a real deployment has no such switch)."""

    name: AttackName = Field("none", description="the malicious clients' behaviour")
    fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="share of the clients that are malicious (seeded)"
    )
    clients: list[int] | None = Field(None, description="malicious client ids (instead of fraction)")
    scale: float = Field(
        1.0, gt=0.0, description="sign_flip: −scale·Δ; scaling / model replacement: scale·Δ (boost γ)"
    )
    sigma: float = Field(1.0, gt=0.0, description="gaussian: the std of the update sent instead of Δ")
    z: float | None = Field(None, description="alie: z (default: Baruch et al. 2019's z_max from n and f)")
    target: int = Field(0, ge=0, description="backdoor: the label the trigger asks for")
    trigger_size: int = Field(4, ge=1, description="backdoor: side of the square pattern (bottom-right)")
    poison_fraction: float = Field(
        0.5, gt=0.0, le=1.0, description="backdoor: share of each malicious batch stamped and relabelled"
    )


class DefenceSection(_Section):
    """Robust aggregation of the uploads (for algorithms whose aggregation is a mean of uploads)."""

    name: DefenceName = Field("mean", description="the aggregation rule; mean: the algorithm's own")
    byzantine_fraction: float | None = Field(
        None, ge=0.0, description="assumed share f/m of malicious clients a round (krum, multi_krum, bulyan, "
        "median); default: the attack's fraction"
    )  # fmt: skip
    beta: float = Field(0.1, ge=0.0, description="trimmed_mean: share trimmed at each end (< 0.5)")
    select: int | None = Field(None, ge=1, description="multi_krum: uploads kept (default m − f)")
    max_norm: float | None = Field(None, description="norm_bound: the largest update norm kept (> 0)")
    eps: float = Field(1e-6, gt=0.0, description="geomed: Weiszfeld smoothing ν (Pillutla et al. 2022)")
    max_iter: int = Field(100, ge=1, description="geomed: Weiszfeld iterations at most")
    too_few: Literal["skip", "fail"] = Field(
        "skip",
        description="a round left (by drops, rejections, the clock) with fewer uploads than the rule needs "
        "for its f (krum, multi_krum: 2f + 3; bulyan: 4f + 3; median: 2f + 1): skip: the server state is "
        "kept, one logged line, the round recorded as skipped; fail: the round fails (nothing committed, "
        "--resume)",
    )


class AdaptiveClip(_Section):
    """Adaptive quantile clipping (Andrew et al. 2021, Alg. 1)."""

    quantile: float = Field(0.5, gt=0.0, lt=1.0, description="target share γ of updates within the norm")
    lr: float = Field(0.2, gt=0.0, description="geometric update rate η_C of the clip norm")
    count_noise: float | None = Field(
        None, ge=0.0, description="std σ_b of the noise on the count (default: m / 20, Andrew et al. §4)"
    )


class PrivacySection(_Section):
    """Client-level differential privacy (DP-FedAvg, McMahan et al. 2018)."""

    mechanism: Literal["none", "central", "local"] = Field("none", description="where the noise is added")
    clip: float = Field(1.0, description="L2 bound C of each client's update (the initial one when adaptive)")
    noise_multiplier: float | None = Field(None, ge=0.0, description="z: noise std / sensitivity")
    target_epsilon: float | None = Field(None, description="calibrate z to reach this ε at the last round")
    delta: float | None = Field(None, description="δ of the (ε, δ) guarantee, e.g. 1e-5 or 1/num_clients")
    adaptive: AdaptiveClip | None = Field(None, description="adaptive quantile clipping (central only)")
    randomness: Literal["secret", "reproducible"] = Field(
        "secret",
        description="secret: the noise and the client sample come from the OS's cryptographic source and are "
        "written nowhere (the guarantee); reproducible: both follow from the seed, for tests and debugging "
        "only: NOT private, no ε is reported",
    )
    sampling: Literal["fixed", "poisson"] = Field(
        "fixed",
        description="fixed: m = fraction·N clients without replacement each round; poisson: each client "
        "independently with q = m/N, the noisy sum divided by the fixed qN (McMahan et al. 2018)",
    )
    adjacency: Literal["replace_one", "add_remove"] = Field(
        "replace_one",
        description="neighbouring federations: one client's data replaced (sensitivity 2C) or one client "
        "added/removed (sensitivity C, needs sampling=poisson); the noise std is z times it",
    )
    accountant: Literal["rdp", "pld"] = Field(
        "rdp",
        description="the accountant of the reported ε and of target_epsilon's calibration: rdp (an upper "
        "bound) or pld (tight; poisson sampling or local DP); both are reported in summary.json",
    )
