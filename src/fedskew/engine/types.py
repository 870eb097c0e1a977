"""Types every engine module shares: a client's outcome of a round, a round's job, and tree helpers.

Kept apart from the round loop so that executors, workers and the vectorized trainer import them without
importing each other or the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fedskew.algorithms.base import Payload, State, Upload


@dataclass
class ClientOutcome:
    """One client's local training in one round; nothing of it is committed until the round is."""

    cid: int
    bytes_down: int
    params_down: int = 0
    upload: Upload | None = None  # None: rejected (non-finite loss or upload)
    state: State | None = None  # the client's new state (CPU), committed with the round
    loss: float = float("nan")
    dropped: bool = False  # the runtime lost the client (its node did not reply in time); never rejected
    bytes_up: int = 0  # the accepted upload's traffic (kept when a folding executor drops its arrays)
    params_up: int = 0
    steps: int = 0  # local optimizer steps taken (the virtual clock's compute time)
    passes: int = 0  # samples of those steps' mini-batches (summary.json's compute)

    def accept(self, upload: Upload) -> None:
        """Take ``upload`` as the client's accepted upload and count its traffic."""
        self.upload = upload
        self.bytes_up, self.params_up = upload.payload.nbytes(), upload.payload.num_params()

    @classmethod
    def received(cls, cid: int, payload: Payload) -> ClientOutcome:
        """A client that received ``payload`` and has no accepted upload (yet)."""
        return cls(cid=cid, bytes_down=payload.nbytes(), params_down=payload.num_params())


@dataclass(frozen=True)
class RoundJob:
    """What an executor needs to train a round's clients: the round, the sampled clients (in sampling
    order), the server state to broadcast from and the clients' current states (CPU)."""

    round: int
    cids: list[int]
    server: State
    states: Mapping[int, State] = field(default_factory=dict)
    #: the uploads go into a folded mean (fedskew.engine.folding), whose one check of finiteness stands in
    #: for each upload's: a non-finite mean abandons the fold and the round trains again unfolded
    folded: bool = False
    #: the virtual clock's ``late: partial``: at most this many local steps per client (sequential kind)
    step_limits: Mapping[int, int] = field(default_factory=dict)


def tree_to(obj: Any, device: torch.device | str) -> Any:
    """Move every tensor in a nested dict / list structure to ``device`` (new containers)."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: tree_to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_to(v, device) for v in obj)
    return obj
