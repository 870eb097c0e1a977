"""The bare-Flower row of ``flower_runtime.py``: the same FedAvg training as fedskew's ``flower-deployment``,
written the way a Flower 1.42 user would, for the same loopback deployment (``flwr run`` of
``benchmarks/flower_bare_app``, whose pyproject names ``flower_bare:server_app`` / ``client_app``).

* ``client_app``: the train handler reads its node's index (``partition-id``) and the round
  (``server-round``, which Flower's ``FedAvg`` puts in every train message), trains the round's sampled
  clients that live on its node (``c % num-partitions == partition-id``, fedskew's rule) one after the
  other with a ``DataLoader`` and plain PyTorch SGD, each from the received global model, and replies with
  their sample-weighted mean and their total sample count (``num-examples``). Flower's ``FedAvg`` then
  weights the nodes' means by those counts, which gives exactly the sample-weighted mean over all clients
  that fedskew's FedAvg computes from per-client uploads: the same training, one message per node per
  round each way, as fedskew's deployment sends (fedskew's reply carries each client's upload; this one
  carries one model, the node's mean; both are noted in the results).
* ``server_app``: Flower's own ``FedAvg`` (Message API) over every node each round, with central
  evaluation of the global model on the test set (``evaluate_fn``, as fedskew's ``eval.protocol: global``
  does on its ServerApp) after each round, where the round's end time is stamped.

The workload (tensors, the fedskew partition of the same config, hyper-parameters, fedskew's pre-drawn
client sample per round) is a torch file named by ``FEDSKEW_FLOWER_BUNDLE`` (:func:`write_bundle`),
loaded with ``flower_peer``'s loader and model; round stamps go beside it (``*.stamps.json``).
Not a module of fedskew: it only borrows fedskew's partition and model zoo so that both sides train
the same clients on the same network. The deployment's processes import it through ``PYTHONPATH``
(``flower_runtime.py`` puts this folder there): ``flwr run`` ships only the app folder's pyproject.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from flower_peer import _bundle, _loader, _model  # noqa: E402

#: the app folder ``flwr run`` submits, and the variable naming the workload file
APP_DIR, BUNDLE_ENV = HERE / "flower_bare_app", "FEDSKEW_FLOWER_BUNDLE"


def write_bundle(cfg: dict[str, Any], path: Path, nodes: int) -> dict[str, Any]:
    """The workload of fedskew config ``cfg`` for ``nodes`` nodes: its data and partition (fedskew's
    ``build_data``), model, hyper-parameters and fedskew's client sample of every round."""
    from fedskew.engine.runtime import INIT_KEY
    from fedskew.engine.sampling import sampling_schedule
    from fedskew.experiment.build import build_data
    from fedskew.experiment.config import build_config
    from fedskew.seeding import derive_seed

    c = build_config(cfg)
    fd = build_data(c)
    ds, n = fd.dataset, len(fd.train_idx)
    bundle = {
        **{k: getattr(ds, k) for k in ("x_train", "y_train", "x_test", "y_test", "in_shape", "num_classes")},
        "train_idx": fd.train_idx,
        "model": c.model.name,
        "model_options": c.model.options(),
        "epochs": c.client.epochs,
        "batch_size": c.client.batch_size,
        "lr": c.client.lr,
        "momentum": c.client.momentum,
        "num_clients": n,
        "nodes": nodes,
        "seed": c.seed,
        "init_seed": derive_seed(c.seed, INIT_KEY),  # fedskew's initial global model (engine.assembly)
        "schedule": sampling_schedule(n, c.client.fraction, c.rounds, c.seed).tolist(),
        "mean": torch.tensor(ds.mean).view(-1, 1, 1),
        "std": torch.tensor(ds.std).view(-1, 1, 1),
        "device": "cpu",
    }
    torch.save(bundle, path)
    return bundle


def model_bytes(b: dict[str, Any]) -> int:
    """The bytes of the bundle's model (its state dict): what one message carries."""
    from fedskew.models import MODELS

    model = MODELS.get(b["model"])(tuple(b["in_shape"]), b["num_classes"], **b["model_options"])
    return sum(v.numel() * v.element_size() for v in model.state_dict().values())


def build_model() -> torch.nn.Module:
    """The bundle's model, freshly initialised (``flower_peer``'s)."""
    return _model()


def normalised(b: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    return x.float().div_(255.0).sub_(b["mean"]).div_(b["std"])


def node_clients(b: dict[str, Any], server_round: int, index: int, nodes: int) -> list[int]:
    """The clients of round ``server_round`` (1-based) living on node ``index`` (fedskew: ``c % nodes``)."""
    if not 1 <= server_round <= len(b["schedule"]):  # round 0 would silently train the last round's clients
        raise ValueError(
            f"server-round {server_round} is outside the bundle's rounds 1..{len(b['schedule'])}"
        )
    return [c for c in b["schedule"][server_round - 1] if c % nodes == index]


def train_clients(
    b: dict[str, Any], state: dict[str, torch.Tensor], cids: list[int], server_round: int
) -> tuple[dict[str, torch.Tensor], int]:
    """Train each client of ``cids`` from ``state`` (epochs of SGD over its shuffled samples; the shuffle
    seeded per round and client, so a client trains alike alone or beside others); returns their
    sample-weighted mean state (``state`` when ``cids`` is empty) and their total sample count."""
    model = build_model()
    sums = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.items()}
    total = 0
    for cid in cids:
        model.load_state_dict(state)
        opt = torch.optim.SGD(model.parameters(), lr=b["lr"], momentum=b["momentum"])
        torch.manual_seed(b["seed"] * 1_000_003 + server_round * 10_007 + cid)
        model.train()
        for _ in range(b["epochs"]):
            for xb, yb in _loader(cid, True):
                loss = F.cross_entropy(model(normalised(b, xb)), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
        n = len(b["train_idx"][cid])
        for k, v in model.state_dict().items():
            sums[k] += n * v.double()
        total += n
    if total == 0:
        return state, 0
    return {k: (sums[k] / total).to(state[k].dtype) for k in state}, total


def accuracy(b: dict[str, Any], model: torch.nn.Module) -> float:
    """The model's accuracy on the whole test set."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for xb, yb in zip(b["x_test"].split(1024), b["y_test"].split(1024), strict=True):
            correct += int((model(normalised(b, xb)).argmax(1) == yb).sum())
    return correct / max(len(b["y_test"]), 1)


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Train this node's clients of the round; reply with their weighted mean and total count."""
    torch.set_num_threads(int(context.node_config.get("threads", 1)))  # the deployment's threads per node
    b = _bundle()
    index, nodes = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    if nodes != b["nodes"]:  # the clients' homes (c % nodes) would not be fedskew's
        raise ValueError(f"num-partitions {nodes} is not the workload's {b['nodes']} nodes")
    server_round = int(msg.content["config"]["server-round"])
    state = msg.content["arrays"].to_torch_state_dict()
    mean, n = train_clients(b, state, node_clients(b, server_round, index, nodes), server_round)
    content = RecordDict({"arrays": ArrayRecord(mean), "metrics": MetricRecord({"num-examples": n})})
    return Message(content=content, reply_to=msg)


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower's FedAvg over every node for the bundle's rounds; stamps each round's end (after the central
    evaluation) and the accuracy in ``<bundle>.stamps.json``."""
    b = _bundle()
    stamps = Path(os.environ[BUNDLE_ENV]).with_suffix(".stamps.json")
    torch.manual_seed(b["init_seed"])
    model = build_model()  # fedskew's initial model: the two rows' accuracies are comparable
    times: list[float] = []
    accs: list[float] = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        accs.append(accuracy(b, model))
        times.append(time.perf_counter())
        stamps.write_text(json.dumps({"times": times, "accuracy": accs}))
        return MetricRecord({"accuracy": accs[-1]})

    nodes = int(b["nodes"])
    strategy = FedAvg(
        fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=nodes, min_available_nodes=nodes
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=len(b["schedule"]),
        evaluate_fn=central,
    )


if __name__ == "__main__":  # benchmarks/run_all.py runs every script: this one is a module
    print("flower_bare: the bare-Flower app of flower_runtime.py (run that)")
