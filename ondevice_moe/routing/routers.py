"""Token-level routers.

:class:`TokenTopKRouter` is the CoMiGS router (§2, App. B.1.2): one linear
layer on the MLP input, a softmax over the user's experts, the top-k kept and
renormalised. :class:`UniformRouter` mixes experts with fixed equal weights;
the baselines without routing (Local, FedAvg, ...) use it so that they hold the
same two LoRA modules as CoMiGS-1G1S. :class:`ClientRouter` mixes them with one
weight per expert for the whole device (FDLoRA).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ondevice_moe.routing.balance import generalist_balance_loss, switch_balance_loss
from ondevice_moe.routing.lifecycle import RoundAware
from ondevice_moe.routing.topk import top_k_softmax

BalanceForm = Literal["uniform", "generalist"]


@dataclass
class Routing:
    """One routing decision for a batch of tokens.

    ``weights`` (…, n) are the mixing weights (zero outside the top-k),
    ``balance_loss`` is the un-weighted load-balancing term (zero when the
    router has nothing to balance).
    """

    weights: torch.Tensor
    balance_loss: torch.Tensor


def linear_gate(hidden_size: int, num_experts: int, generator: torch.Generator | None = None) -> nn.Linear:
    """A bias-free linear gate, initialised as ``nn.Linear`` initialises itself
    (``U(±1/√d)``, the bound of ``kaiming_uniform_(a=√5)``), drawn from ``generator``.

    The authors' code (epfml/CoMiGS) keeps ``nn.Linear``'s initialisation. A
    zero gate would tie every score, and top-k would then send every token to
    the same experts until the router is first trained.
    """
    gate = nn.Linear(hidden_size, num_experts, bias=False)
    bound = 1.0 / math.sqrt(hidden_size)
    with torch.no_grad():
        gate.weight.uniform_(-bound, bound, generator=generator)
    return gate


class UniformRouter(nn.Module):
    """Every token takes every expert with weight ``1/n``; nothing to learn."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts

    def forward(self, hidden: torch.Tensor) -> Routing:
        shape = (*hidden.shape[:-1], self.num_experts)
        weights = hidden.new_full(shape, 1.0 / self.num_experts)
        return Routing(weights=weights, balance_loss=hidden.new_zeros(()))


class ClientRouter(nn.Module):
    """One weight per expert for every token of the device: client-level mixing.

    The weights are a buffer (the device's own, never sent): FDLoRA trains each
    expert alone in turn (:meth:`use_only`) and fits the weights on the validation
    split at the end (:mod:`ondevice_moe.routing.fusion`).
    """

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.register_buffer("mix", torch.full((num_experts,), 1.0 / num_experts))

    def use_only(self, index: int) -> None:
        """Route every token to expert ``index`` alone."""
        self.mix.zero_()
        self.mix[index] = 1.0

    def forward(self, hidden: torch.Tensor) -> Routing:
        weights = self.mix.to(hidden.dtype).expand(*hidden.shape[:-1], self.mix.shape[0])
        return Routing(weights=weights, balance_loss=hidden.new_zeros(()))


class TokenTopKRouter(nn.Module):
    """Linear gate → softmax → top-k → renormalise (CoMiGS App. B.1.2).

    The gate starts as ``nn.Linear`` does (:func:`linear_gate`), so tokens
    spread over the experts from the first step.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        balance_form: BalanceForm = "uniform",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and the number of experts ({num_experts}), got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.balance_form = balance_form
        self.gate = linear_gate(hidden_size, num_experts, generator)

    def forward(self, hidden: torch.Tensor) -> Routing:
        logits = self.gate(hidden.to(self.gate.weight.dtype)).float()
        probs = torch.softmax(logits, dim=-1)
        # The softmax over the top-k logits is the full softmax renormalised over the top-k.
        weights, selected = top_k_softmax(logits, self.top_k)
        if self.balance_form == "generalist":
            balance = generalist_balance_loss(probs, selected)
        else:
            balance = switch_balance_loss(probs, selected, self.top_k)
        return Routing(weights=weights.to(hidden.dtype), balance_loss=balance)


class ClientMixtureRouter(RoundAware, nn.Module):
    """FLoRAL §5: the client's mixture ``π^k = softmax(θ^k)`` over its C experts, one
    vector for the whole device (every adapted layer, every input), ``θ^k ∈ R^C``
    private and learned with the model (Alg. 1 line 7) from ``θ = 0`` (the authors'
    ``floral/model/router.py``).

    ``optimal`` (an expert index) fixes π to that one-hot vector instead: the
    "π*" rows of Tables 1 and 3, the client's ground-truth cluster.

    ``noise``: the paper's Alg. 1 trains θ as it is (``noise = 0``). The authors' code
    (``Router.moe``, ``router_noise_std: 1.0`` in every config) adds uniform noise
    ``noise · U[0, 1)^C`` to θ in training, drawn once per forward pass of the model
    (:meth:`resample`): with θ = 0 and the experts alike, it breaks the tie between them.
    Evaluation always reads ``softmax(θ)``.
    """

    def __init__(self, num_experts: int, optimal: int | None = None, noise: float = 0.0) -> None:
        super().__init__()
        if noise < 0:
            raise ValueError(f"router noise must be non-negative, got {noise}")
        self.noise = noise
        self.drawn: torch.Tensor | None = None  # this pass's noise: no buffer, it is never kept or sent
        if optimal is None:
            self.theta = nn.Parameter(torch.zeros(num_experts))
        else:
            if not 0 <= optimal < num_experts:
                raise ValueError(f"optimal expert {optimal} is not one of {num_experts}")
            self.register_buffer("fixed", nn.functional.one_hot(torch.tensor(optimal), num_experts).float())

    def resample(self, _model: nn.Module | None = None, _inputs: tuple = ()) -> None:
        """Draw this forward pass's noise (a training pass of a learned, noisy θ), or clear it;
        a forward pre-hook of the model (hence the unused hook arguments)."""
        noisy = self.training and self.noise > 0 and hasattr(self, "theta")
        self.drawn = self.noise * torch.rand_like(self.theta.detach()) if noisy else None

    def mixture(self) -> torch.Tensor:
        """``π``, shape ``(C,)``: ``softmax(θ + noise)`` in a noisy training pass, else ``softmax(θ)``."""
        if self.training and self.drawn is not None:
            return torch.softmax(self.theta + self.drawn, dim=0)
        return self.probabilities()

    def probabilities(self) -> torch.Tensor:
        """The learned ``softmax(θ)`` (or π*), without this pass's noise: what the device reports."""
        return self.fixed if hasattr(self, "fixed") else torch.softmax(self.theta, dim=0)

    def gate(self, index: int) -> Callable[[], torch.Tensor]:
        """Expert ``index``'s weight ``π_index``, read at every forward pass."""
        return lambda: self.mixture()[index]

    def round_metrics(self) -> dict[str, float]:
        """``pi_<c>``: the learned mixture after the round (FLoRAL Alg. 1 line 12 sends it)."""
        return {f"pi_{index}": float(weight) for index, weight in enumerate(self.probabilities().detach())}


def client_mixture(model: nn.Module) -> list[float] | None:
    """A device's mixture ``π`` over its experts (FLoRAL), or ``None`` without a client-mixture router."""
    router = getattr(model, "router", None)
    if not isinstance(router, ClientMixtureRouter):
        return None
    return [float(p) for p in router.probabilities().detach()]
