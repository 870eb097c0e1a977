"""Local fine-tuning on a copy: the personalization step of FedAvg-FT and FedBABU.

Both methods evaluate a client with a model fine-tuned on its own training data for ``τ_f`` epochs (FedBABU,
Oh, Kim, Yun, ICLR 2022; "FedAvg-FT", Wang et al. 2019). The fine-tuned model must never reach an upload
nor the committed state, so it is computed here, as an auxiliary computation on copies: :func:`finetune`
runs mini-batch SGD with the engine's update rule (:class:`fedskew.update_rules.SGD`, ``torch.optim.SGD``'s
update, the leaf module algorithms and the engine share)

    g ← ∇ℓ(p) + weight_decay · p;   b ← g (first step) or momentum · b + g;   p ← p − lr · b

over the parameters that ``trainable`` accepts, on mini-batches of the client's data cut from a permutation
drawn from a given generator (a trailing batch of one sample is dropped, as the engine does), in training
mode (BatchNorm batch statistics; running statistics update copies; dropout draws from a seed of that
generator inside a forked RNG). Neither the model nor the given weights change. It runs where it is called
from, evaluation included (gradients are enabled inside). The settings both methods share
(:class:`FineTuneParams`) and the plan of one fine-tuning (:func:`finetune_plan`) live here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn
from torch.func import functional_call

from fedskew.algorithms.base import Algorithm, Context, HyperParams
from fedskew.algorithms.batching import epoch_batches
from fedskew.algorithms.helpers import train_mode
from fedskew.algorithms.steps import ClientView
from fedskew.algorithms.work import Work, epochs_work
from fedskew.errors import ConfigError
from fedskew.search_space import tunable
from fedskew.update_rules import SGD


@dataclass(frozen=True)
class FineTune:
    """How to fine-tune: ``epochs`` passes at learning rate ``lr`` in batches of ``batch_size``, SGD with
    ``momentum`` and ``weight_decay``, over the parameters ``trainable`` accepts (``None``: all)."""

    epochs: int
    lr: float
    batch_size: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    trainable: Callable[[str], bool] | None = None


def finetune(
    model: nn.Module,
    weights: Mapping[str, Tensor],
    client: ClientView,
    plan: FineTune,
    generator: torch.Generator,
) -> dict[str, Tensor]:
    """``weights`` (every parameter and buffer of ``model``) after ``plan.epochs`` epochs of SGD on the
    client's cross-entropy: new detached tensors, the untrained entries copied."""
    names = [n for n, _ in model.named_parameters()]
    train = [n for n in names if plan.trainable is None or plan.trainable(n)]
    params = {n: weights[n].detach().clone() for n in names}
    buffers = {n: weights[n].detach().clone() for n, _ in model.named_buffers() if n in weights}
    leaves = [params[n].requires_grad_(True) for n in train]
    opt = SGD(leaves, plan.lr, plan.momentum, plan.weight_decay)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    devices = [client.x.device] if client.x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), train_mode(model), torch.enable_grad():
        torch.manual_seed(seed)
        for _ in range(plan.epochs if train else 0):
            for idx in epoch_batches(client.num_samples, plan.batch_size, generator, client.x.device):
                out = functional_call(model, {**params, **buffers}, (client.x[idx],))
                grads = torch.autograd.grad(F.cross_entropy(out, client.y[idx]), leaves, allow_unused=True)
                for p, g in zip(leaves, grads, strict=True):
                    p.grad = g
                opt.step()
                opt.zero_grad()
    out_state = {n: p.detach() for n, p in params.items()}
    out_state.update(buffers)
    return {k: out_state[k] if k in out_state else v.detach().clone() for k, v in weights.items()}


#: the generator stream of the fine-tuning batches (and its dropout seed)
FINETUNE_KEY = 0xF17E


def head_filter(model: nn.Module, algorithm: str) -> tuple[str, ...]:
    """Parameter names of ``model``'s head (``FedModel.is_head``), or a one-line error naming the
    algorithm."""
    is_head = getattr(model, "is_head", None)
    names = tuple(n for n, _ in model.named_parameters() if is_head is not None and is_head(n))
    if not names:
        raise ConfigError(f"{algorithm} needs a model with a head (FedModel.is_head); see `fedskew list`")
    return names


class FineTuneParams(HyperParams):
    """The fine-tuning settings FedAvg-FT and FedBABU share."""

    finetune_epochs: int = tunable(
        5,
        low=1,
        high=10,
        integer=True,
        protocols=("personalized",),  # fine-tuning makes the personal model only; the global one is FedAvg's
        ge=0,
        description="τ_f, local fine-tuning epochs before evaluation (source: FedBABU's τ_f; its code's "
        "--ft_ep default 5, applied to FedAvg and FedBABU alike; search: fedskew, [1, 10])",
    )
    finetune_lr: float | None = tunable(
        None,
        low=1e-3,
        high=0.5,
        log=True,
        protocols=("personalized",),
        gt=0.0,
        description="fine-tuning learning rate (None: the rate the client trains with this round, "
        "client.lr x lr_decay^(t-1); search: client.lr's range)",
    )
    finetune: Literal["full", "head"] = Field(
        "full",
        description="fine-tuned parameters: the whole model (FedBABU's personalization, Wang et al. 2019) "
        "or the head only (FedBABU's head-only comparison)",
    )
    eval_finetune: Literal["fresh", "stale"] = Field(
        "fresh",
        description="fresh: each evaluation fine-tunes the model being evaluated on the client's data (the "
        "papers: fine-tune the global model, then test); stale: the client fine-tunes the model it received "
        "in its round and is scored with that later (one round or more behind; fedskew before contract v4)",
    )


def finetune_plan(alg: Algorithm, p: FineTuneParams, round_idx: int, model: nn.Module) -> FineTune:
    """The fine-tuning under ``p`` after round ``round_idx`` (the client config's batches, momentum and
    weight decay; unless ``finetune_lr`` is set, the rate clients train with in that round, ``client.lr``
    times the round's factor, as the engine computes it)."""
    heads = frozenset(head_filter(model, alg.name)) if p.finetune == "head" else None
    cfg = alg.ctx.client
    # before round 1 (an evaluation of the initial model) the rate of round 1, not lr / decay
    round_lr = cfg.lr * cfg.round_lr_scale(max(round_idx, 1), alg.ctx.rounds)
    return FineTune(
        epochs=p.finetune_epochs,
        lr=p.finetune_lr if p.finetune_lr is not None else round_lr,
        batch_size=cfg.batch_size,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        trainable=None if heads is None else heads.__contains__,
    )


class FineTuneWork:
    """The fine-tuning's work (:mod:`fedskew.algorithms.work`) of FedAvg-FT and FedBABU: ``τ_f`` epochs of the
    client's training data in ``client.batch_size`` batches (:func:`finetune`'s batching is the engine's), at
    each evaluation (``fresh``, :meth:`Algorithm.adapt_for_eval`) or in the client's round (``stale``,
    ``finish_local``)."""

    p: FineTuneParams
    ctx: Context

    def _finetune_work(self, num_samples: int) -> Work:
        return epochs_work(self.p.finetune_epochs, num_samples, self.ctx.client.batch_size)

    def eval_work(self, num_samples: int) -> Work:
        return Work() if self.p.eval_finetune == "stale" else self._finetune_work(num_samples)

    def extra_work(self, num_samples: int, local: Work) -> Mapping[str, Work]:
        if self.p.eval_finetune == "fresh":
            return {}
        return {"stale_finetune": self._finetune_work(num_samples)}
