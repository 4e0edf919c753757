"""Flow's routing module ψ (Flow §3, eq. 2 and 4): a per-instance policy over a global and
a local copy of each routed layer.

ψ is a chain of fully connected ``base`` layers on the instance's representation, with one
``exit`` after each, ``q^(j) = softmax(ψ_exit^(j)(ψ_base^(j)(x̂)))`` (eq. 2): ``q_0`` picks the
global copy, ``q_1`` the local one. The router runs once per forward pass (a pre-hook on the
network) and each routed layer reads its own exit through :meth:`InstancePolicyRouter.gate`
(a whole layer copy, :class:`~ondevice_moe.experts.layer_copy.RoutedLayer`) or
:meth:`InstancePolicyRouter.copy_gate` (a LoRA expert of a Hugging Face block).

The instance's representation (:attr:`InstancePolicyRouter.represent`):

* a small model's flattened input (the paper's setting);
* a Hugging Face model's input embeddings averaged over the sequence
  (:class:`SequenceRepresentation`): over its real tokens for an encoder, one route per
  sequence; for a causal language model over the tokens up to each position, so that no
  token's route reads the tokens it is asked to predict (a whole-sequence mean would).

Which path the layers take is the router's ``path``:

* ``policy`` — the soft policy ``q`` while training (eq. 3), its rounded, one-hot version
  ``round(q)`` at inference (§3 "Soft versus Hard Policy");
* ``global`` / ``local`` — every instance on the global (``Acc_g``, eq. 6) or the local
  copies (training ``w_ℓ`` on ``ζ_ℓ``, eq. 1);
* ``mixture`` — APFL's interpolation (Deng et al., 2020, eq. 4): every instance on
  ``(1 − α)·g + α·ℓ`` with the device's private ``α = sigmoid(alpha_logit)``, learned (a
  linear layer's output is linear in its weights, so this is the interpolated model).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Path = Literal["policy", "global", "local", "mixture"]
GLOBAL, LOCAL = 0, 1
Representation = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


def flattened_input(inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A small model's instance: its input, flattened (Flow §3, Fig. 1)."""
    return inputs["inputs"].flatten(1)


@dataclass
class SequenceRepresentation:
    """A sequence's instance representation for ψ: the mean of its input embeddings.

    ``causal``: the running mean up to each position, shape ``(batch, seq, hidden)``, so the
    route of a token reads only its context; otherwise the mean over the real (unpadded)
    tokens, ``(batch, hidden)``. The embedding table is the frozen base's and is not ψ's
    (it stays out of ψ's parameters, so it is never trained or sent)."""

    embeddings: nn.Module
    causal: bool

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            embedded = self.embeddings(inputs["input_ids"]).float()
        mask = inputs.get("attention_mask")
        mask = torch.ones(embedded.shape[:2], device=embedded.device) if mask is None else mask.float()
        masked = embedded * mask.unsqueeze(-1)
        if self.causal:
            counts = mask.cumsum(dim=1).clamp_min(1).unsqueeze(-1)
            return masked.cumsum(dim=1) / counts
        return masked.sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp_min(1)


class InstancePolicyRouter(nn.Module):
    """ψ: ``exits`` exits over a chain of ReLU layers of width ``hidden`` on ``in_features``
    inputs (eq. 2). Shared: FedAvg'd with the global layers (Alg. 1 line 14).

    ``pairs``: the (global, local) modules it routes, in exit order (several per exit where
    one exit drives LoRA copies on several projections of a block); the layout fills it, and
    Flow's round restarts each local module from its global one (Alg. 1 line 5).
    ``interpolation``: APFL's α at the start (the ``mixture`` path's private parameter).
    ``reads_whole_context``: a token's route reads every token of its text (generation keeps no
    key/value cache for it, :mod:`~ondevice_moe.generate`)."""

    reads_whole_context = True

    def __init__(self, in_features: int, exits: int, hidden: int, generator: torch.Generator,
                 represent: Representation = flattened_input, interpolation: float | None = None) -> None:
        super().__init__()
        widths = [in_features] + [hidden] * exits
        self.base = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))
        self.exits = nn.ModuleList(nn.Linear(hidden, 2) for _ in range(exits))
        with torch.no_grad():
            for layer in (*self.base, *self.exits):
                bound = 1.0 / layer.in_features ** 0.5
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
        if interpolation is not None:  # APFL's α, kept in (0, 1) by a sigmoid
            self.alpha_logit = nn.Parameter(torch.logit(torch.tensor(float(interpolation))))
        self.represent = represent
        self.pairs: list[tuple[nn.Module, nn.Module]] = []
        self.path: Path = "policy"
        self.last_q: list[torch.Tensor] = []

    def route(self, features: torch.Tensor) -> list[torch.Tensor]:
        """``q^(j)`` for every exit, shape ``(…, 2)`` each (eq. 2), from instance features
        ``(…, in_features)``; kept for the layers and for the regulariser of eq. 4."""
        hidden = features.to(self.base[0].weight.dtype)
        probabilities = []
        for base, exit_ in zip(self.base, self.exits, strict=True):
            hidden = torch.relu(base(hidden))
            probabilities.append(torch.softmax(exit_(hidden), dim=-1))
        self.last_q = probabilities
        return probabilities

    def route_inputs(self, inputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Route a batch as the model receives it (``inputs`` or ``input_ids``/``attention_mask``)."""
        return self.route(self.represent(inputs))

    def before_network(self, _network: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        """A forward pre-hook on a small model's network: route its input."""
        self.route_inputs({"inputs": args[0]})

    def before_model(self, _model: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward pre-hook (with kwargs) on a Hugging Face model: route its token ids."""
        inputs = dict(kwargs)
        if inputs.get("input_ids") is None and args:
            inputs["input_ids"] = args[0]
        self.route_inputs(inputs)

    def weights(self, index: int) -> torch.Tensor:
        """The mixing weights exit ``index`` gives now, ``(…, 2)``: ``q``, ``round(q)`` or a fixed path."""
        q = self.last_q[index]
        if self.path == "mixture":
            alpha = torch.sigmoid(self.alpha_logit).to(q.dtype)
            return torch.stack([1 - alpha, alpha]).expand(q.shape)
        if self.path != "policy":
            chosen = torch.full(q.shape[:-1], GLOBAL if self.path == "global" else LOCAL, device=q.device)
            return nn.functional.one_hot(chosen, 2).to(q.dtype)
        if self.training:
            return q
        return nn.functional.one_hot(q.argmax(dim=-1), 2).to(q.dtype)

    def gate(self, index: int) -> Callable[[], torch.Tensor]:
        """Exit ``index``'s weights ``(batch, 2)`` for a whole layer copy, read at every forward pass."""
        return lambda: self.weights(index)

    def copy_gate(self, index: int, copy: int) -> Callable[[], torch.Tensor]:
        """The weight of one copy (``GLOBAL`` or ``LOCAL``) at exit ``index``, shaped ``(batch, 1, 1)``
        (one route per sequence) or ``(batch, seq, 1)`` (causal), to scale a LoRA expert's
        per-token residual."""

        def weight() -> torch.Tensor:
            chosen = self.weights(index)[..., copy : copy + 1]
            return chosen.unsqueeze(1) if chosen.dim() == 2 else chosen

        return weight


def policy_regulariser(router: InstancePolicyRouter) -> torch.Tensor:
    """``−(1/L) Σ_j log q_0^(j)`` of eq. 4, averaged over the batch (and positions): lower
    when more instances take the global layers (γ weighs it in the policy step)."""
    logs = [torch.log(q[..., GLOBAL].clamp_min(torch.finfo(q.dtype).tiny)).mean() for q in router.last_q]
    return -torch.stack(logs).mean()


def instance_policy(model: nn.Module) -> InstancePolicyRouter | None:
    """The model's Flow router, or ``None``."""
    router = getattr(model, "router", None)
    return router if isinstance(router, InstancePolicyRouter) else None
