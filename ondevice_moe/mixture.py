"""The MLP of a transformer block carrying a mixture of experts (CoMiGS §2, App. B.1.2).

The router weighs the experts token by token, and the block's MLP output is
``Σ_j w_j E_j(x)``. An expert is either

* a LoRA expert: the block's MLP with its own LoRA on every MLP linear layer
  (CoMiGS eq. 5), or
* an Adapter expert: the MLP followed by its own bottleneck adapter,
  ``E_j(x) = MLP(x) + adapter_j(MLP(x))`` (Houlsby et al., 2019).

Computed naively that runs the frozen MLP once per expert. Here the frozen
projections run once. The input projections are shared by all experts (only
the low-rank residuals differ), and because the output projection is linear
and the weights sum to one,

    Σ_j w_j · (W_out a_j + b + ΔW_out,j a_j) = W_out (Σ_j w_j a_j) + b + Σ_j w_j ΔW_out,j a_j,

where ``a_j`` is expert ``j``'s activation (``a_0``, the frozen MLP's own, for
adapters). The base output ``W_out a_0 + b`` that adapters read is computed
only when the mixture holds an adapter.

Memory: with frozen base weights, backward needs no input of a base
projection. A step keeps each LoRA expert's pre-activations (``W_in x + ΔW_in,j x``)
and recomputes the rest of the per-expert path in backward
(:func:`torch.utils.checkpoint.checkpoint`: the activation, the weighted sum
and the output LoRA), instead of keeping every intermediate of every expert's
activation. The terms are summed in the naive implementation's order, so the
result matches it to the last bits that float rounding allows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ondevice_moe.experts.adapter import Adapter

Expert = nn.ModuleDict | Adapter
ExpertSet = list[Expert]
MixedForward = Callable[[nn.Module, ExpertSet, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MLPForm:
    """One model family's MLP: ``output(activation(inputs(x)))``, then ``finish``.

    ``inputs`` and ``output`` name the MLP's linear layers (the keys of a LoRA
    expert's ``ModuleDict``); ``activation`` maps the input projections'
    outputs to the activation that the output projection reads.
    """

    inputs: tuple[str, ...]
    output: str
    activation: Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor]
    finish: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda mlp, out: out


GPT2_MLP = MLPForm(("c_fc",), "c_proj", lambda mlp, pre: mlp.act(pre[0]), lambda mlp, out: mlp.dropout(out))
LLAMA_MLP = MLPForm(("gate_proj", "up_proj"), "down_proj", lambda mlp, pre: mlp.act_fn(pre[0]) * pre[1])


def gpt2_mixed_forward(mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """GPT-2 MLP ``dropout(c_proj(act(c_fc x)))``; LoRA experts adapt ``c_fc`` and ``c_proj``.

    Dropout (training only) applies once to the mixed output.
    """
    return mixed_mlp(GPT2_MLP, mlp, experts, weights, x)


def llama_mixed_forward(mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """LLaMA MLP ``down(act(gate x) · up x)``; LoRA experts adapt all three."""
    return mixed_mlp(LLAMA_MLP, mlp, experts, weights, x)


def mixed_mlp(form: MLPForm, mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor, x: torch.Tensor
              ) -> torch.Tensor:
    """``Σ_j w_j E_j(x)`` with the frozen MLP run once; ``weights`` (…, n) must sum to one per token."""
    flat = x.reshape(-1, x.shape[-1])
    flat_weights = weights.reshape(-1, weights.shape[-1])
    pre = [getattr(mlp, name)(flat) for name in form.inputs]
    expert_pre = [None if isinstance(expert, Adapter) else
                  [p + expert[name](flat).to(p.dtype) for p, name in zip(pre, form.inputs, strict=True)]
                  for expert in experts]
    base_pre = pre if any(isinstance(expert, Adapter) for expert in experts) else None
    experts_path = functools.partial(_expert_activations, form, mlp, experts)
    if torch.is_grad_enabled():
        mixed, residuals, base_activation = checkpoint(experts_path, flat_weights, base_pre, expert_pre,
                                                       use_reentrant=False, preserve_rng_state=False)
    else:
        mixed, residuals, base_activation = experts_path(flat_weights, base_pre, expert_pre)
    output = getattr(mlp, form.output)
    out = output(mixed)
    for residual in residuals:
        out = out + residual
    if base_activation is not None:
        base_out = output(base_activation)
        for j, expert in enumerate(experts):
            if isinstance(expert, Adapter):
                out = out + flat_weights[:, j : j + 1] * expert(base_out).to(out.dtype)
    out = form.finish(mlp, out)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _expert_activations(form: MLPForm, mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor,
                        base_pre: list[torch.Tensor] | None, expert_pre: list[list[torch.Tensor] | None]
                        ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """From the experts' pre-activations: ``Σ_j w_j a_j``, the terms ``w_j ΔW_out,j a_j`` and ``a_0``."""
    base_activation = form.activation(mlp, base_pre) if base_pre is not None else None
    mixed = None
    residuals = []
    for j, (expert, pre) in enumerate(zip(experts, expert_pre, strict=True)):
        weight = weights[:, j : j + 1]
        if pre is None:
            activation = base_activation
        else:
            activation = form.activation(mlp, pre)
            residuals.append(weight * expert[form.output](activation).to(activation.dtype))
        mixed = activation * weight if mixed is None else mixed + activation * weight
    return mixed, residuals, base_activation


class MixtureMLP(nn.Module):
    """A frozen MLP, its experts (keyed ``shared_0``, ``private_0``, …) and a router.

    Each expert is a ``ModuleDict`` of LoRAs keyed by the MLP's linear layers,
    or an :class:`~ondevice_moe.experts.adapter.Adapter`. After each forward
    pass ``last_balance_loss`` holds the router's balance term and
    ``last_scores`` the mean routing weight of each expert (the "expert
    scores" of CoMiGS Fig. 4).
    """

    def __init__(
        self,
        base: nn.Module,
        experts: dict[str, Expert],
        router: nn.Module,
        mixed_forward: MixedForward,
    ) -> None:
        super().__init__()
        self.base = base
        self.experts = nn.ModuleDict(experts)
        self.router = router
        self._mixed_forward = mixed_forward
        self.last_balance_loss: torch.Tensor | None = None
        self.last_scores: torch.Tensor | None = None

    @property
    def expert_names(self) -> list[str]:
        return list(self.experts.keys())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        routing = self.router(hidden)
        self.last_balance_loss = routing.balance_loss
        self.last_scores = routing.weights.detach().reshape(-1, routing.weights.shape[-1]).float().mean(dim=0)
        return self._mixed_forward(self.base, list(self.experts.values()), routing.weights, hidden)


def mixtures(model: nn.Module) -> list[MixtureMLP]:
    """The model's mixture layers, in depth order."""
    return [module for module in model.modules() if isinstance(module, MixtureMLP)]

