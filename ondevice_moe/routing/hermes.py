"""The Hermes dual-view router (Hermes §4.2.2).

Per token, with ``M`` experts at a layer:

* feature view, eq. (4): ``s_f = softmax(G_f(h))``, ``G_f`` a linear gate on
  the block input;
* ``n`` counts tokens (eq. 6 and the usage of eq. 11): positions that the
  attention mask marks as padding are routed but not counted
  (:meth:`HermesRouter.forward_pass`);
* gradient view, eq. (5): ``s_g`` = EMA over steps of each expert's gradient
  norm, normalised to sum to one across the layer's experts (the paper says
  "Norm(‖∇‖)" without the form; a sum-normalisation keeps ``s_g`` on the same
  scale as ``s_f``);
* loss-free bias, eq. (6): ``b ← b + γ_b (n̄ − n)/n̄`` outside the graph, with
  ``n`` the tokens each expert took in the batch and ``n̄ = kT/M``;
* fused score, eq. (7): ``r = γ·s_f + (1 − γ)·s_g + b``;
* top-k and sparse softmax at temperature τ, eq. (8).

The ablations of Table 2 switch parts off: ``use_feature=False`` (w/o-F),
``use_gradient=False`` (w/o-G), ``top_k = M`` (w/o-K). ``gating="sigmoid"``
gives FedUniPELT's dense gates (Mao et al., 2022): one sigmoid gate per
expert, no top-k, no balancing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Literal

import torch
from torch import nn

from ondevice_moe.models.checkpointing import recording
from ondevice_moe.routing.lifecycle import RoundAware
from ondevice_moe.routing.routers import Routing, linear_gate
from ondevice_moe.routing.topk import top_k_softmax


class HermesRouter(RoundAware, nn.Module):
    """Routes each token of one layer over that layer's experts (e.g. lora, adapter, prefix).

    ``expert_params`` (set when the experts are attached) maps each expert's
    name to its parameters, for the gradient view and the upload of used experts.
    """

    def __init__(
        self,
        hidden_size: int,
        experts: tuple[str, ...],
        top_k: int = 2,
        temperature: float = 0.1,
        gamma: float = 0.5,
        bias_rate: float = 0.05,
        gradient_ema: float = 0.9,
        use_feature: bool = True,
        use_gradient: bool = True,
        gating: Literal["hermes", "sigmoid"] = "hermes",
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= len(experts):
            raise ValueError(f"top_k must be between 1 and the number of experts ({len(experts)}), got {top_k}")
        self.experts = experts
        self.top_k = top_k
        self.temperature = temperature
        self.gamma = gamma if use_feature and use_gradient else (1.0 if use_feature else 0.0)
        self.bias_rate = bias_rate
        self.gradient_ema = gradient_ema
        self.gating = gating
        self.gate = (linear_gate(hidden_size, len(experts), generator) if use_feature or gating == "sigmoid"
                     else None)
        self.register_buffer("bias", torch.zeros(len(experts)))
        self.register_buffer("gradient_score", torch.full((len(experts),), 1.0 / len(experts)))
        self.register_buffer("usage", torch.zeros(len(experts)))
        self.expert_params: dict[str, list[nn.Parameter]] = {}
        self._batch_counts: torch.Tensor | None = None
        self.token_mask: torch.Tensor | None = None  # (batch, tokens), 1 for real tokens

    def forward(self, hidden: torch.Tensor) -> Routing:
        if self.gating == "sigmoid":
            weights = torch.sigmoid(self.gate(hidden.to(self.gate.weight.dtype)))
            selected = torch.ones_like(weights)
        else:
            scores = self.fused_scores(hidden)
            weights, selected = top_k_softmax(scores, self.top_k, self.temperature)
        if self.token_mask is not None:
            selected = selected * self.token_mask.reshape(*selected.shape[:-1], 1).to(selected.dtype)
        counts = selected.detach().reshape(-1, len(self.experts)).sum(dim=0)
        if self.training and recording():  # once per step, not again in a checkpointed replay
            self._batch_counts = counts
            self.usage += counts
        return Routing(weights=weights.to(hidden.dtype), balance_loss=hidden.new_zeros(()))

    def fused_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``r = γ·s_f + (1 − γ)·s_g + b`` (Hermes eq. 7), per token."""
        shape = (*hidden.shape[:-1], len(self.experts))
        fused = (self.bias + (1.0 - self.gamma) * self.gradient_score).expand(shape)
        if self.gate is not None and self.gamma > 0:
            feature = torch.softmax(self.gate(hidden.to(self.gate.weight.dtype)).float(), dim=-1)
            fused = fused + self.gamma * feature
        return fused

    @torch.no_grad()
    def after_backward(self) -> None:
        """Drop the gradients of experts no token selected (only selected experts are
        updated, §4.1), then feed the gradient norms to the gradient view."""
        expert_params = self.expert_params
        if self._batch_counts is None or not expert_params:
            return
        norms = self.gradient_score.new_zeros(len(self.experts))  # on the router's device (CUDA too)
        for index, expert in enumerate(self.experts):
            params = expert_params.get(expert, [])
            if self._batch_counts[index] == 0:
                for param in params:
                    param.grad = None
                continue
            grads = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
            norms[index] = torch.stack(grads).sum().sqrt() if grads else 0.0
        self.update_gradient_view(norms)

    def begin_round(self) -> None:
        """Usage counts restart: each upload reports one round's usage (Hermes eq. 11's ``h``)."""
        self.usage.zero_()

    @contextmanager
    def forward_pass(self, batch: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """Count only the tokens that the batch's attention mask keeps: Hermes eq. (6) and (11)
        count tokens, and right padding is not a token."""
        self.token_mask = batch.get("attention_mask")
        try:
            yield
        finally:
            self.token_mask = None

    def after_step(self) -> None:
        self.update_bias()

    def kept_home(self) -> set[int]:
        """Hermes §4.3: "each client uploads only the parameters of its selected top-k PEFT modules".
        With per-token routing some token selects nearly every expert in a round, so counting any
        selection would save nothing: the router's ``top_k`` experts with the most tokens this round
        travel (never one that no token selected); the others stay home."""
        ranked = torch.argsort(self.usage, descending=True, stable=True).tolist()
        uploaded = {index for index in ranked[: self.top_k] if self.usage[index] > 0}
        return {id(param) for index, expert in enumerate(self.experts) if index not in uploaded
                for param in self.expert_params.get(expert, [])}

    def upload_records(self, name_of: Mapping[int, str]) -> dict[str, dict[str, float]]:
        """``usage``: the tokens routed to each expert this round, per tensor of that expert (eq. 11's ``h``)."""
        return {"usage": {name_of[id(param)]: float(self.usage[index]) for index, expert in enumerate(self.experts)
                          for param in self.expert_params.get(expert, []) if id(param) in name_of}}

    @torch.no_grad()
    def update_bias(self) -> None:
        """Loss-free balancing, Hermes eq. (6), from the last training batch's counts."""
        if self.gating == "sigmoid" or self._batch_counts is None:
            return
        ideal = self._batch_counts.sum() / len(self.experts)  # n̄ = kT/M
        self.bias += self.bias_rate * (ideal - self._batch_counts) / ideal

    @torch.no_grad()
    def update_gradient_view(self, gradient_norms: torch.Tensor) -> None:
        """EMA of the experts' normalised gradient norms, Hermes eq. (5)."""
        total = gradient_norms.sum()
        if total <= 0:
            return
        self.gradient_score.mul_(self.gradient_ema).add_((1 - self.gradient_ema) * gradient_norms / total)
