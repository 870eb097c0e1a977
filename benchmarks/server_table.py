"""FedFomo's server: state memory and seconds per round of the server's hooks, by federation size.

The server side only (``init_server``, then per round ``broadcast`` to the sampled clients and ``aggregate``
of their uploads), on a tiny model (an MLP 64-32-10: 2,410 parameters), so what is measured is what the
server state costs as the federation grows, not training: the uploads are the model plus noise, with the
candidate ids each client was sent and random first-order weights. Each size runs a fresh algorithm; the
table gives the bytes of tensor storage the server state holds after the rounds (each storage once) and the
median seconds per round of the server's hooks (broadcast + aggregate).

    python benchmarks/server_table.py                   # N = 100 and 1000, 20 clients a round, 10 rounds
    python benchmarks/server_table.py --sizes 100 1000 10000 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from fedskew.algorithms.base import Context, Payload, RoundInfo, Upload
from fedskew.algorithms.fedfomo import IDS, WEIGHTS, FedFomo
from fedskew.engine.states import state_nbytes
from fedskew.settings import ClientSection


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def context(n: int) -> Context:
    return Context(
        num_clients=n,
        num_classes=10,
        in_shape=(64,),
        device=torch.device("cpu"),
        client=ClientSection(),
        client_sizes=torch.full((n,), 20),
        class_counts=torch.full((n, 10), 2),
        rounds=100,
        seed=0,
        build_model=lambda cid: tiny_model(),
    )


storage_bytes = state_nbytes  # bytes of the tensor storages, each once (tables included)


def upload(cid: int, sent: Payload, model: nn.Module, gen: torch.Generator) -> Upload:
    arrays = {
        "model." + k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()
    }
    ids = sent.arrays[IDS]
    arrays.update({IDS: ids, WEIGHTS: torch.randn(ids.numel(), generator=gen)})
    return Upload(cid, 20, Payload(arrays=arrays))


def measure(n: int, per_round: int, rounds: int) -> tuple[int, float]:
    alg = FedFomo(FedFomo.Params(), context(n))
    model = tiny_model()
    server = alg.init_server(model)
    gen = torch.Generator().manual_seed(1)
    times = []
    for r in range(1, rounds + 1):
        cids = torch.randperm(n, generator=gen)[:per_round].tolist()
        t0 = time.perf_counter()
        sent = {c: alg.broadcast(server, RoundInfo(r, c, 0)) for c in cids}
        t1 = time.perf_counter()
        ups = [upload(c, sent[c], model, gen) for c in cids]
        t2 = time.perf_counter()
        server = alg.aggregate(server, ups, RoundInfo(r, None, 0)).state
        times.append(t1 - t0 + time.perf_counter() - t2)
    return storage_bytes(server), statistics.median(times[1:] or times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--per-round", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'clients':>8} {'state MB':>10} {'server ms/round':>16}")
    for n in args.sizes:
        nbytes, seconds = measure(n, args.per_round, args.rounds)
        print(f"{n:>8} {nbytes / 2**20:>10.2f} {seconds * 1e3:>16.2f}")


if __name__ == "__main__":
    main()
