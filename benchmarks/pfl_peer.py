"""The second peer of ``engine_speed.py``: the same workload on Apple's ``pfl`` simulator (``pfl[pytorch]``
0.6, installed by ``make bench``), written the way pfl's documentation shows: a ``FederatedDataset`` of
per-user ``Dataset`` slices, a ``PyTorchModel`` whose module defines ``loss`` and ``metrics``, pfl's
``FederatedAveraging`` over a ``SimulatedBackend`` (weighted by data points, as fedskew's FedAvg), and one
worker process per CPU started by ``torchrun`` (pfl's distributed simulation over ``torch.distributed``,
gloo on a CPU), each on one thread. Evaluation on = pfl's ``CentralEvaluationCallback`` on the test set
every round.

pfl ships no FedProto, so on W2 this peer runs pfl's FedAvg on W2's data, model, batch size and epochs: the
same network forward and backward per step, without the prototype term (a few hundred FLOPs per sample).
Round times are taken on rank 0 by a callback after every central iteration; the first round is a warm-up.

Not a module of fedskew: it borrows fedskew's model zoo so that both sides train the same network.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F


class _PflNet(torch.nn.Module):
    """A fedskew zoo model with the ``loss`` / ``metrics`` methods ``PyTorchModel`` requires; the bundle's
    uint8 images are normalised per batch, as on the Flower side."""

    def __init__(self, bundle: dict) -> None:
        super().__init__()
        from fedskew.models import MODELS

        self.net = MODELS.get(bundle["model"])(
            tuple(bundle["in_shape"]), bundle["num_classes"], **bundle["model_options"]
        )
        self.mean, self.std = bundle["mean"], bundle["std"]  # plain attributes: not trained, not sent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x.float() / 255.0 - self.mean) / self.std)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> dict:
        from pfl.metrics import Weighted

        self.eval() if eval else self.train()
        out = self(x)
        n = len(y)
        return {
            "loss": Weighted(float(F.cross_entropy(out, y, reduction="sum")), n),
            "accuracy": Weighted(float((out.argmax(1) == y).sum()), n),
        }


def schedule_sampler(schedule: list[list[int]], start: int, users: dict) -> Callable[[], int]:
    """pfl's user sampler (called for every user drawn, in order, identically on every worker) walking
    fedskew's sampling schedule from round ``start``: both sides train the same clients each round (pfl's
    own samplers draw other users on every run, and their sample counts vary the round's work by ±20%)."""
    sequence = iter([c for row in schedule[start:] for c in row if c in users])
    return lambda: next(sequence)


def _worker(bundle_path: str, rounds: int, evaluate: bool, stamps_path: str) -> None:
    """One pfl worker process (rank from ``torchrun``'s environment)."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    torch.set_num_threads(1)
    b = torch.load(bundle_path, weights_only=False)
    # pfl evaluates every sampled user and fails on one without data: W4's empty clients (``min_size: 0``)
    # are left out and the cohort is the same fraction of the others, the same expected work per round.
    users = {u: [b["x_train"][idx], b["y_train"][idx]] for u, idx in enumerate(b["train_idx"]) if len(idx)}
    # fedskew's evaluation-on rounds follow its evaluation-off ones in the same process: start there too
    sampler = schedule_sampler(b["schedule"], rounds if evaluate else 0, users)
    train_data = FederatedDataset.from_slices(users, sampler)
    net = _PflNet(b)
    model = PyTorchModel(
        model=net,
        local_optimizer_create=functools.partial(torch.optim.SGD, momentum=b["momentum"]),
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),  # FedAvg: w ← w + mean Δ
    )
    backend = SimulatedBackend(training_data=train_data, val_data=None, postprocessors=[WeightByDatapoints()])
    rank = get_default_framework_module().distributed.global_rank
    times: list[float] = []
    accuracy: list[float] = []

    class Stamp(TrainingProcessCallback):
        def on_train_begin(self, *, model) -> Metrics:
            times.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            times.append(time.perf_counter())
            accuracy.extend(
                v for k, v in aggregate_metrics.to_simple_dict().items() if k.endswith("accuracy")
            )
            if rank == 0:
                Path(stamps_path).write_text(json.dumps({"times": times, "accuracy": accuracy}))
            return False, Metrics()

    eval_params = NNEvalHyperParams(local_batch_size=1000)
    callbacks: list = []
    if evaluate:
        test = Dataset(raw_data=[b["x_test"], b["y_test"]])
        callbacks.append(CentralEvaluationCallback(test, model_eval_params=eval_params, frequency=1))
    callbacks.append(Stamp())  # after the evaluation, so an evaluated round includes it
    cohort = max(1, round(b["fraction"] * len(users)))
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            evaluation_frequency=10**9,  # no per-user metrics before/after local training
            train_cohort_size=cohort,
            val_cohort_size=None,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=b["epochs"], local_learning_rate=b["lr"], local_batch_size=b["batch_size"]
        ),
        model_eval_params=eval_params,
        callbacks=callbacks,
    )


def pfl_seconds_per_round(bundle_path: Path, rounds: int, evaluate: bool, workers: int) -> float:
    """Median seconds per round (rounds 2..R) of pfl's simulation of the bundled workload, ``workers``
    processes under ``torchrun``."""
    stamps = bundle_path.with_suffix(".pfl.json")
    stamps.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}"]
    cmd += [__file__, str(bundle_path), str(rounds), str(int(evaluate)), str(stamps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0 or not stamps.exists():
        log = bundle_path.with_suffix(".pfl.log")
        log.write_text(out.stderr)
        first = out.stderr.find("Traceback")  # a worker's own error, before torchrun's summary
        raise RuntimeError(f"pfl run failed (full log: {log}):\n{out.stderr[first : first + 3000]}")
    times = json.loads(stamps.read_text())["times"]
    diffs = sorted(b - a for a, b in itertools.pairwise(times[1:]))  # skip round 1 (warm-up)
    return diffs[len(diffs) // 2] if diffs else times[-1] - times[0]


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3])), sys.argv[4])
