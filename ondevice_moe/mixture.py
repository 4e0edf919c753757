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
and its activation ``a_j`` (read by the weighted sum and the output LoRA).
LLaMA's gated activation ``act(gate)·up`` recomputes ``act(gate)`` in
backward (:func:`torch.utils.checkpoint.checkpoint`) rather than keeping it,
so each expert keeps three ``(tokens × MLP width)`` tensors where the MLP of a
plain LoRA model keeps four (its input projections' outputs, ``act(gate)``
and the product).

Time: the routing weight and the LoRA scaling multiply the rank-r codes, not
the full activations, and each low-rank residual is added inside its
matrix product (``addmm``), so an expert costs few passes over
``(tokens × MLP width)`` tensors beside its activation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ondevice_moe.experts.adapter import Adapter, add_adapters
from ondevice_moe.experts.lora import LoRA, add_product, scaled
from ondevice_moe.experts.precision import low_rank, product_dtype

Expert = nn.ModuleDict | Adapter
ExpertSet = list[Expert]
MixedForward = Callable[[nn.Module, ExpertSet, torch.Tensor, torch.Tensor, bool], torch.Tensor]


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


def _gated_activation(mlp: nn.Module, pre: Sequence[torch.Tensor]) -> torch.Tensor:
    """LLaMA's ``act(gate)·up``; in training ``act(gate)`` is recomputed in backward, not kept."""
    def activation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return mlp.act_fn(gate) * up
    if torch.is_grad_enabled():
        return checkpoint(activation, *pre, use_reentrant=False, preserve_rng_state=False)
    return activation(*pre)


LLAMA_MLP = MLPForm(("gate_proj", "up_proj"), "down_proj", _gated_activation)


def gpt2_mixed_forward(mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor, x: torch.Tensor,
                       fused: bool = False) -> torch.Tensor:
    """GPT-2 MLP ``dropout(c_proj(act(c_fc x)))``; LoRA experts adapt ``c_fc`` and ``c_proj``.

    Dropout (training only) applies once to the mixed output. ``fused``: :func:`stacked_mixed_mlp`.
    """
    return (stacked_mixed_mlp if fused else mixed_mlp)(GPT2_MLP, mlp, experts, weights, x)


def llama_mixed_forward(mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor, x: torch.Tensor,
                        fused: bool = False) -> torch.Tensor:
    """LLaMA MLP ``down(act(gate x) · up x)``; LoRA experts adapt all three. ``fused``:
    :func:`stacked_mixed_mlp`."""
    return (stacked_mixed_mlp if fused else mixed_mlp)(LLAMA_MLP, mlp, experts, weights, x)


def mixed_mlp(form: MLPForm, mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor, x: torch.Tensor
              ) -> torch.Tensor:
    """``Σ_j w_j E_j(x)`` with the frozen MLP run once; ``weights`` (…, n) must sum to one per token."""
    flat = x.reshape(-1, x.shape[-1])
    flat_weights = weights.reshape(-1, weights.shape[-1])
    base_pre, expert_pre = _pre_activations(form, mlp, experts, flat)
    mixed, output_codes, base_activation = _expert_activations(form, mlp, experts, flat_weights, base_pre, expert_pre)
    out = getattr(mlp, form.output)(mixed)
    lora_experts = [expert for expert in experts if not isinstance(expert, Adapter)]
    for expert, codes in zip(lora_experts, output_codes, strict=True):
        out = expert[form.output].add_codes(out, codes)
    if base_activation is not None:
        base_out = getattr(mlp, form.output)(base_activation)
        for j, expert in enumerate(experts):
            if isinstance(expert, Adapter):
                out = expert.add_to(out, base_out, flat_weights[:, j : j + 1])
    out = form.finish(mlp, out)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _pre_activations(form: MLPForm, mlp: nn.Module, experts: ExpertSet, flat: torch.Tensor
                     ) -> tuple[list[torch.Tensor] | None, list[list[torch.Tensor] | None]]:
    """The frozen input projections' outputs, run once (returned only when an adapter
    expert reads the base MLP), and each LoRA expert's pre-activations ``W_in x + ΔW_in,j x``."""
    pre = [getattr(mlp, name)(flat) for name in form.inputs]
    expert_pre = [None if isinstance(expert, Adapter) else
                  [expert[name].add_to(p, flat) for p, name in zip(pre, form.inputs, strict=True)]
                  for expert in experts]
    return (pre if any(isinstance(expert, Adapter) for expert in experts) else None), expert_pre


def _expert_activations(form: MLPForm, mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor,
                        base_pre: list[torch.Tensor] | None, expert_pre: list[list[torch.Tensor] | None]
                        ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """From the experts' pre-activations: ``Σ_j w_j a_j``, each LoRA expert's output
    codes ``w_j·γ·A_out,j a_j`` (rank r: ``ΔW_out,j = γ·B_out,j A_out,j``) and ``a_0``."""
    base_activation = form.activation(mlp, base_pre) if base_pre is not None else None
    mixed = None
    output_codes = []
    for j, (expert, pre) in enumerate(zip(experts, expert_pre, strict=True)):
        weight = weights[:, j : j + 1]
        if pre is None:
            activation = base_activation
        else:
            activation = form.activation(mlp, pre)
            output_codes.append(expert[form.output].codes(activation, weight))
        weight = weight.to(activation.dtype)
        mixed = activation * weight if mixed is None else torch.addcmul(mixed, activation, weight)
    return mixed, output_codes, base_activation


def stacked_mixed_mlp(form: MLPForm, mlp: nn.Module, experts: ExpertSet, weights: torch.Tensor, x: torch.Tensor
                      ) -> torch.Tensor:
    """:func:`mixed_mlp` with the experts batched (issue 64's fused experts): the LoRA experts' ``A``s
    of a linear layer in one product, their ``B``s in one batched product (``torch.baddbmm`` over the
    experts), their activations mixed in one reduction, the output LoRAs' codes in one batched product
    and their ``B``s in one ``addmm``; the adapters' bottlenecks in two products
    (:func:`~ondevice_moe.experts.adapter.add_adapters`). A fixed number of kernels per MLP whatever
    the number of experts, where :func:`mixed_mlp` launches a few per expert; equal to it to float
    rounding (the sums run in another order). LoRA experts of different ranks cannot be stacked:
    they take :func:`mixed_mlp`."""
    loras = [j for j, expert in enumerate(experts) if not isinstance(expert, Adapter)]
    if len({experts[j][name].rank for j in loras for name in (*form.inputs, form.output)}) > 1:
        return mixed_mlp(form, mlp, experts, weights, x)
    adapters = [j for j, expert in enumerate(experts) if isinstance(expert, Adapter)]
    flat = x.reshape(-1, x.shape[-1])
    flat_weights = weights.reshape(-1, weights.shape[-1])
    pre = [getattr(mlp, name)(flat) for name in form.inputs]
    base_activation = form.activation(mlp, pre) if adapters else None
    mixed = None
    if loras:
        lora_weights = flat_weights[:, loras].t().unsqueeze(-1)  # (experts, tokens, 1)
        activations = form.activation(mlp, [_stacked_residuals(p, flat, [experts[j][name] for j in loras])
                                            for p, name in zip(pre, form.inputs, strict=True)])
        mixed = (activations * lora_weights.to(activations.dtype)).sum(dim=0)
    if base_activation is not None:
        share = flat_weights[:, adapters].sum(dim=-1, keepdim=True).to(base_activation.dtype)
        mixed = base_activation * share if mixed is None else torch.addcmul(mixed, base_activation, share)
    out = getattr(mlp, form.output)(mixed)
    if loras:
        outputs = [experts[j][form.output] for j in loras]
        dtype = product_dtype(activations)
        downs = torch.stack([lora.lora_A for lora in outputs]).to(dtype)  # (experts, r, width)
        codes = scaled(torch.bmm(activations.to(dtype), downs.transpose(1, 2)), _scalings(outputs, activations))
        codes = (codes * lora_weights.to(codes.dtype)).transpose(0, 1).reshape(flat.shape[0], -1)
        out = add_product(out, codes, torch.cat([lora.lora_B for lora in outputs], dim=1))
    if base_activation is not None:
        base_out = getattr(mlp, form.output)(base_activation)
        out = add_adapters(out, base_out, [(experts[j], flat_weights[:, j : j + 1]) for j in adapters])
    out = form.finish(mlp, out)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _stacked_residuals(pre: torch.Tensor, flat: torch.Tensor, loras: list[LoRA]) -> torch.Tensor:
    """``pre + γ_j·B_j(A_j x)`` for every LoRA ``j`` of one linear layer, shape ``(experts, tokens, width)``:
    every ``A`` in one product, every ``B`` in one batched product added onto the shared ``pre``."""
    rank = loras[0].rank
    codes = low_rank(flat, torch.cat([lora.lora_A for lora in loras]))
    codes = scaled(codes.reshape(flat.shape[0], len(loras), rank).transpose(0, 1), _scalings(loras, codes))
    dtype = product_dtype(pre)
    ups = torch.stack([lora.lora_B for lora in loras]).to(dtype)  # (experts, width, r)
    summed = torch.baddbmm(pre.to(dtype).unsqueeze(0).expand(len(loras), -1, -1), codes.to(dtype), ups.transpose(1, 2))
    return summed.to(pre.dtype)


def _scalings(loras: list[LoRA], like: torch.Tensor) -> torch.Tensor:
    """Each LoRA's scaling γ in float32, shape ``(experts, 1, 1)``, to scale a stack of their codes."""
    return torch.tensor([lora.scaling for lora in loras], dtype=torch.float32, device=like.device)[:, None, None]


class MixtureMLP(nn.Module):
    """A frozen MLP, its experts (keyed ``shared_0``, ``private_0``, …) and a router.

    Each expert is a ``ModuleDict`` of LoRAs keyed by the MLP's linear layers,
    or an :class:`~ondevice_moe.experts.adapter.Adapter`. After each forward
    pass ``last_balance_loss`` holds the router's balance term and
    ``last_scores`` the mean routing weight of each expert (the "expert
    scores" of CoMiGS Fig. 4). ``fused`` batches the experts (:func:`stacked_mixed_mlp`); it is set by
    ``training.fused_experts``.
    """

    fused = False

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
        return self._mixed_forward(self.base, list(self.experts.values()), routing.weights, hidden, self.fused)


def mixtures(model: nn.Module) -> list[MixtureMLP]:
    """The model's mixture layers, in depth order."""
    return [module for module in model.modules() if isinstance(module, MixtureMLP)]

