"""The ``clock:`` config section: a federation on a virtual clock (system heterogeneity).

Without the section a run is what it always was: synchronous rounds in which every sampled client
finishes, and its results are bit-identical to a config without it. With it, every client has a compute
speed (seconds per local optimizer step) and a link bandwidth (bytes per second), drawn once per seed from
the distributions below or read from a trace file; a client's simulated duration in a round is
``steps x step_seconds + (bytes_down + bytes_up) / bytes_per_second`` (:mod:`fedskew.engine.clock`).

Trace file (CSV with a header; docs/clock.md): ``client,step_seconds,bytes_per_second[,online]``.
``client`` is a federation client id (0 .. N - 1, each at most once); ``online`` (optional) is 24
characters of ``0`` / ``1``, the client's availability in each hour of the virtual day (used by
``availability: trace``). Clients without a row keep their drawn values and are always online.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from fedskew.settings import Strict


class Spread(Strict):
    """A positive quantity per client, drawn once per seed: ``constant`` (every client ``value``),
    ``lognormal`` (median ``value``, ``sigma`` the standard deviation of its log) or ``uniform`` on
    [``low``, ``high``]."""

    distribution: Literal["constant", "lognormal", "uniform"] = "constant"
    value: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="constant: the value; lognormal: the median"
    )
    sigma: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="lognormal: standard deviation of the log"
    )
    low: float | None = Field(None, gt=0, allow_inf_nan=False, description="uniform: the lower end")
    high: float | None = Field(None, gt=0, allow_inf_nan=False, description="uniform: the upper end")

    @model_validator(mode="after")
    def _uniform_bounds(self) -> Spread:
        if self.distribution == "uniform" and (self.low is None or self.high is None or self.low > self.high):
            raise ValueError("distribution 'uniform' needs low <= high, both > 0")
        return self


class ClockSection(Strict):
    """Speeds, availability, round policy and aggregation on the virtual clock (module docstring)."""

    step_seconds: Spread = Field(
        default_factory=lambda: Spread(value=0.01, sigma=0.0),
        description="seconds per local optimizer step of each client",
    )
    bytes_per_second: Spread = Field(
        default_factory=lambda: Spread(value=1.25e6, sigma=0.0),
        description="each client's link bandwidth, up and down (default 10 Mbit/s)",
    )
    trace: str | None = Field(
        None, description="CSV client,step_seconds,bytes_per_second[,online] (relative: the config's folder)"
    )
    trace_sha256: str | None = Field(
        None, description="set when the config is built: the trace's SHA-256 (a changed trace is refused)"
    )
    availability: Literal["always", "bernoulli", "trace"] = Field(
        "always", description="who can be sampled: always, each round with probability `available`, or "
        "from the trace's hourly `online` column at the round's virtual start time",
    )  # fmt: skip
    available: float = Field(1.0, gt=0, le=1, description="bernoulli: a client's chance to be online")
    dropout: float = Field(0.0, ge=0, lt=1, description="chance a sampled client drops out mid-round")
    slow_classes: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list,
        description="clients holding mostly these classes are slow_factor times slower (compute and link)",
    )
    slow_factor: float = Field(
        1.0, ge=1, allow_inf_nan=False, description="slowdown of the slow_classes' clients"
    )
    deadline: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="round deadline in virtual seconds (sync)"
    )
    late: Literal["drop", "partial"] = Field(
        "drop", description="a client that misses the deadline: dropped, or (methods declaring "
        "partial_work: FedProx, FedNova) trains only the steps that fit",
    )  # fmt: skip
    over_selection: float = Field(
        1.0, ge=1, allow_inf_nan=False, description="sample ceil(k m) clients, keep the first m"
    )
    aggregation: Literal["sync", "fedasync", "fedbuff"] = Field(
        "sync", description="synchronous rounds, FedAsync (Xie et al. 2019) or FedBuff (Nguyen et al. 2022)"
    )
    concurrency: int | None = Field(None, ge=1, description="async: clients training at once (default m)")
    buffer: int | None = Field(None, ge=1, description="fedbuff: updates per server step K (default m)")
    server_lr: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="fedbuff: server learning rate eta_g"
    )
    mixing: float = Field(0.6, gt=0, le=1, description="fedasync: mixing weight alpha")
    staleness: Literal["constant", "polynomial", "hinge"] = Field(
        "polynomial", description="s(tau): 1; (1 + tau)^-a; hinge 1 if tau <= b else 1 / (a (tau - b) + 1)"
    )
    staleness_a: float = Field(0.5, gt=0, allow_inf_nan=False, description="a of the staleness function")
    staleness_b: int = Field(4, ge=0, description="b of the hinge staleness function")
    buffer_weights: Literal["method", "uniform"] = Field(
        "method", description="fedbuff: the method's mean weights (FedAvg: n_k / n) or the paper's 1 / K"
    )

    #: keys that only asynchronous aggregation reads
    ASYNC_ONLY: ClassVar[tuple[str, ...]] = (
        "concurrency", "buffer", "server_lr", "mixing", "staleness", "staleness_a", "staleness_b",
        "buffer_weights",
    )  # fmt: skip

    @property
    def asynchronous(self) -> bool:
        return self.aggregation != "sync"

    @property
    def cuts_after_training(self) -> bool:
        """Whether a client that trained may still be left out of the round (deadline, over-selection)."""
        return self.deadline is not None or self.over_selection > 1
