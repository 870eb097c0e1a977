"""The engine's local SGD equals ``torch.optim.SGD`` bit for bit on a CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedskew.engine.sgd import SGD


def _losses(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    out = model[0](x)
    # every third step the second layer takes no part: its parameters get no gradient
    return out.square().mean() if step % 3 == 2 else model[1](out).logsumexp(1).mean()


def train_steps(opt_factory, steps: int = 7) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    xs = torch.randn(steps, 8, 5)
    opt = opt_factory(list(model.parameters()))
    for step in range(steps):
        opt.zero_grad()
        _losses(model, xs[step], step).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-3])
def test_sgd_matches_torch_optim_sgd_bitwise(momentum, weight_decay):
    ours = train_steps(lambda ps: SGD(ps, lr=0.1, momentum=momentum, weight_decay=weight_decay))
    ref = train_steps(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=momentum, weight_decay=weight_decay))
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


def test_sgd_step_by_hand():
    p = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = SGD([p], lr=0.5, momentum=0.5, weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        (p * torch.tensor([2.0, 4.0])).sum().backward()  # gradient [2, 4]
        opt.step()
    # step 1: g = [2.1, 3.8], b = g, p = [1 - 1.05, -2 - 1.9] = [-0.05, -3.9]
    # step 2: g = [2 - 0.005, 4 - 0.39] = [1.995, 3.61], b = 0.5·[2.1, 3.8] + g = [3.045, 5.51]
    assert torch.allclose(p.detach(), torch.tensor([-0.05 - 1.5225, -3.9 - 2.755]), atol=1e-6)


def test_epoch_batches_drop_only_a_trailing_single_sample_and_keep_batch_size_one():
    from fedskew.algorithms.batching import batches_per_epoch, epoch_batches

    g = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    assert [len(b) for b in epoch_batches(7, 3, g, cpu)] == [3, 3]  # the trailing single sample is dropped
    assert [len(b) for b in epoch_batches(5, 1, g, cpu)] == [1, 1, 1, 1, 1]  # batch size 1 trains
    assert [len(b) for b in epoch_batches(1, 4, g, cpu)] == [1]  # one sample: one batch
    assert epoch_batches(0, 4, g, cpu) == []
    for n, bs in [(7, 3), (5, 1), (1, 4), (0, 4), (64, 32), (65, 32), (66, 32)]:
        assert batches_per_epoch(n, bs) == len(epoch_batches(n, bs, g, cpu)), (n, bs)
