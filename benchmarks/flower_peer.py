"""The peer side of ``engine_speed.py``: the same workload on Flower's simulation engine (``[flower]`` extra,
``flwr[simulation]`` for the Ray backend), written the way a Flower user would: a ``ClientApp`` whose train
handler loads its partition, builds a ``DataLoader`` and runs plain PyTorch SGD, a ``ServerApp`` with
Flower's own ``FedAvg`` strategy (W1, W3) or a FedProto loop over ``grid.send_and_receive`` (W2), one CPU
per client. Round times come from the server side (``evaluate_fn`` / the loop), so Ray's start-up is not
counted.

Not a module of fedskew: it only borrows fedskew's model zoo so both sides train the same network.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

_CACHE: dict[str, Any] = {}


def _bundle() -> dict[str, Any]:
    """The workload file (tensors + partition + settings), loaded once per Ray worker process."""
    path = os.environ["FEDSKEW_FLOWER_BUNDLE"]
    if _CACHE.get("path") != path:
        _CACHE.clear()
        _CACHE.update(torch.load(path, weights_only=False), path=path)
    return _CACHE


def _model() -> torch.nn.Module:
    from fedskew.models import MODELS

    b = _bundle()
    return MODELS.get(b["model"])(tuple(b["in_shape"]), b["num_classes"], **b["model_options"])


def _loader(cid: int, train: bool) -> DataLoader:
    b = _bundle()
    idx = b["train_idx"][cid] if train else b["test_idx"][cid]
    x = b["x_train"] if train else b["x_test"]
    y = b["y_train"] if train else b["y_test"]
    return DataLoader(TensorDataset(x[idx], y[idx]), batch_size=b["batch_size"], shuffle=train)


def make_client_app():
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    def partition(context: Context) -> int:
        return int(context.node_config.get("partition-id", context.node_id))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        b = _bundle()
        cid = partition(context)
        dev = torch.device(b["device"])
        model = _model().to(dev)
        if b["algorithm"] == "fedproto" and "model" in context.state:
            model.load_state_dict(context.state["model"].to_torch_state_dict())
        elif b["algorithm"] != "fedproto":
            model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        protos = msg.content["protos"].to_torch_state_dict() if "protos" in msg.content else {}
        protos = {k: v.to(dev) for k, v in protos.items()}
        opt = torch.optim.SGD(model.parameters(), lr=b["lr"], momentum=b["momentum"])
        model.train()
        n = 0
        sums: dict[int, torch.Tensor] = {}
        counts: dict[int, int] = {}
        for _ in range(b["epochs"]):
            for xb, yb in _loader(cid, True):
                xb, yb = xb.to(dev), yb.to(dev)
                xb = xb.float().div_(255.0).sub_(b["mean"].to(dev)).div_(b["std"].to(dev))
                z = model.features(xb)
                loss = F.cross_entropy(model.head(z), yb)
                if protos:  # FedProto's regulariser: MSE to the global prototype of the sample's class
                    has = [str(int(c)) in protos for c in yb]
                    if any(has):
                        zero = torch.zeros(z.shape[1], device=dev)
                        target = torch.stack([protos.get(str(int(c)), zero) for c in yb])
                        mask = torch.tensor(has, dtype=torch.float32, device=dev)[:, None]
                        loss = loss + b["lam"] * ((z - target) ** 2 * mask).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                n += len(yb)
                if b["algorithm"] == "fedproto":
                    for c in yb.unique().tolist():
                        sel = z[yb == c].detach()
                        sums[c] = sums.get(c, 0) + sel.sum(0)
                        counts[c] = counts.get(c, 0) + len(sel)
        content = RecordDict({"metrics": MetricRecord({"num-examples": n})})
        if b["algorithm"] == "fedproto":
            context.state["model"] = ArrayRecord(model.state_dict())
            local = {str(c): sums[c] / counts[c] for c in sums}
            content["protos"] = ArrayRecord(local)
            content["counts"] = MetricRecord({str(c): counts[c] for c in counts})
        else:
            content["arrays"] = ArrayRecord(model.state_dict())
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        b = _bundle()
        dev = torch.device(b["device"])
        model = _model().to(dev)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model.eval()
        correct = total = 0
        with torch.no_grad():
            for xb, yb in _loader(partition(context), False):
                xb, yb = xb.to(dev), yb.to(dev)
                xb = xb.float().div_(255.0).sub_(b["mean"].to(dev)).div_(b["std"].to(dev))
                correct += int((model(xb).argmax(1) == yb).sum())
                total += len(yb)
        metrics = MetricRecord({"accuracy": correct / max(total, 1), "num-examples": total})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


def make_server_app(rounds: int, evaluate: bool, stamps: Path):
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    app = ServerApp()
    times: list[float] = []

    def stamp() -> None:
        times.append(time.perf_counter())
        stamps.write_text(json.dumps(times))

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        b = _bundle()
        if b["algorithm"] != "fedproto":
            strategy = FedAvg(
                fraction_train=b["fraction"],
                fraction_evaluate=b["fraction"] if evaluate else 0.0,
                min_train_nodes=1,
                min_evaluate_nodes=1,
                min_available_nodes=b["num_clients"],
            )

            def on_round(server_round: int, arrays: ArrayRecord) -> None:
                stamp()
                return None

            strategy.start(
                grid=grid,
                initial_arrays=ArrayRecord(_model().state_dict()),
                num_rounds=rounds,
                evaluate_fn=on_round,
            )
            return
        while len(list(grid.get_node_ids())) < b["num_clients"]:
            time.sleep(0.1)
        nodes = sorted(grid.get_node_ids())
        protos: dict[str, torch.Tensor] = {}
        stamp()
        for r in range(1, rounds + 1):
            content = RecordDict({"config": ConfigRecord({"round": r})})
            if protos:
                content["protos"] = ArrayRecord(protos)
            msgs = [
                Message(content=content, dst_node_id=nid, message_type=MessageType.TRAIN) for nid in nodes
            ]
            replies = [m for m in grid.send_and_receive(msgs) if m.has_content()]
            sums: dict[str, torch.Tensor] = {}
            counts: dict[str, float] = {}
            for m in replies:  # Eq. 6: per-class average weighted by the clients' class counts
                local = m.content["protos"].to_torch_state_dict()
                for c, v in local.items():
                    w = float(m.content["counts"][c])
                    sums[c] = sums.get(c, 0) + w * v
                    counts[c] = counts.get(c, 0.0) + w
            protos = {c: sums[c] / counts[c] for c in sums}
            stamp()

    return app


def flower_seconds_per_round(
    bundle_path: Path, rounds: int, evaluate: bool, num_clients: int, cpus: int, device: str = "cpu"
) -> float:
    """Median seconds per round (rounds 2..R) of the Flower simulation of the bundled workload."""
    from flwr.simulation import run_simulation

    os.environ["FEDSKEW_FLOWER_BUNDLE"] = str(bundle_path)
    stamps = bundle_path.with_suffix(".stamps.json")
    stamps.unlink(missing_ok=True)
    run_simulation(
        server_app=make_server_app(rounds, evaluate, stamps),
        client_app=make_client_app(),
        num_supernodes=num_clients,
        backend_config={
            # on a GPU, one client per CPU shares it (Flower's documented fractional-GPU pattern)
            "client_resources": {"num_cpus": 1, "num_gpus": 1.0 / cpus if device.startswith("cuda") else 0.0},
            "init_args": {"num_cpus": cpus, "include_dashboard": False},
        },
    )
    times = json.loads(stamps.read_text())
    diffs = sorted(b - a for a, b in itertools.pairwise(times[1:]))  # skip round 1 (warm-up)
    if not diffs:
        diffs = [times[-1] - times[0]]
    return diffs[len(diffs) // 2]
