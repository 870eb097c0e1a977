"""The run settings every layer reads: the validated ``client``, ``eval`` and ``engine`` config sections.

They live here, below every layer, so that algorithms (which read ``client``), the engine and the experiment
config share one definition: the engine reads the sections pydantic validated, nothing is copied into a
second type.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Strict(BaseModel):
    """A config section: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")


class ClientSection(Strict):
    epochs: int = Field(1, ge=0, description="local epochs per round")
    batch_size: int = Field(32, ge=1, description="local mini-batch size")
    lr: float = Field(0.01, gt=0, description="local SGD learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="local SGD momentum")
    weight_decay: float = Field(0.0, ge=0, description="local SGD weight decay")
    fraction: float = Field(1.0, gt=0, le=1, description="share of clients sampled per round")
    lr_decay: float = Field(
        1.0, gt=0, le=1, description="round-t learning rate = lr · lr_decay^(t−1) (MP-FedCL: 0.95)"
    )


class EvalSection(Strict):
    protocol: Literal["global", "personalized"] = Field("global", description="evaluation protocol")
    every: int = Field(1, ge=1, description="evaluate every k rounds (and always at the last round)")
    batch_size: int | None = Field(
        None,
        ge=1,
        description="evaluation batch size (default: 128 on CPU, where a CNN's activations stay in cache, "
        "1024 on a GPU); results do not depend on it",
    )


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
    state_memory_mb: float = Field(
        64.0,
        gt=0,
        description="memory for the clients' committed states (personal models, control variates, ...); "
        "the least recently trained beyond it wait on disk (<out>/client-states, or a temporary folder under "
        "$FEDSKEW_CACHE) and are read back exactly",
    )
    memory_format: Literal["auto", "contiguous", "channels_last"] = Field(
        "auto",
        description="tensor layout of 2-d convolutional models: channels_last (NHWC, faster on CPU), "
        "contiguous (NCHW), or auto (channels_last on CPU unless engine.mode=vectorized)",
    )
    runtime: Literal["embedded", "flower-simulation", "flower-deployment"] = Field(
        "embedded",
        description="where the federation runs: embedded (this process), flower-simulation (Flower's "
        "simulation runtime) or flower-deployment (a local Flower SuperLink and engine.nodes SuperNodes on "
        "loopback; see docs/deployment.md); needs the [flower] extra",
    )
    nodes: int = Field(3, ge=1, description="Flower SuperNodes; client c lives on node c % nodes")
    round_timeout: float = Field(
        600.0,
        gt=0,
        description="Flower runtimes: seconds a round (training or evaluation) waits for the nodes' "
        "replies; clients of nodes that did not reply are dropped from the round",
    )

    on_client_error: Literal["drop_non_finite", "drop", "fail"] = Field(
        "drop_non_finite",
        description="a client that fails: drop_non_finite drops an update with NaN/Inf from the round "
        "(logged, counted in 'rejected') and fails the round when a client raises (a bug); drop drops "
        "either; fail fails the round on either (nothing of it is committed; the run stops with one line "
        "and resumes from the last committed round). A round with every client dropped is recorded as "
        "skipped. An algorithm's ContractError always fails the round",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        kind, _, index = v.partition(":")
        indexed_cuda = kind == "cuda" and index.isdigit()
        if v != "auto" and (kind not in ("cpu", "cuda", "mps") or (index and not indexed_cuda)):
            raise ValueError("allowed: auto, cpu, cuda, cuda:N, mps")
        return v
