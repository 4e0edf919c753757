"""Flow's routed layer (Flow §3, eq. 3): a global copy ``g`` (the model's own layer, shared and
averaged) and a local copy ``ℓ`` (private, never sent), mixed per instance::

    w_p^(j)(x̂) = q_0^(j) · g_j(x̂) + q_1^(j) · ℓ_j(x̂)

With soft weights both copies run; with one-hot weights (the hard policy at inference, or
a fixed path) each instance runs through its chosen copy only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

InstanceGate = Callable[[], torch.Tensor]
LOCAL_NAME = "private_0"


class RoutedLayer(nn.Module):
    """``base`` (global ``g``) and ``private_0`` (local ``ℓ``), mixed by ``gate()``: one row
    ``(q_0, q_1)`` per instance of the batch."""

    def __init__(self, base: nn.Module, gate: InstanceGate) -> None:
        super().__init__()
        self.base = base
        self.add_module(LOCAL_NAME, copy.deepcopy(base))
        self.gate = gate

    @property
    def local(self) -> nn.Module:
        return getattr(self, LOCAL_NAME)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.gate()
        if bool(((q == 0) | (q == 1)).all()):
            return self._hard(x, q[:, 0].bool())
        shape = (-1,) + (1,) * (x.dim() - 1)
        return q[:, 0].view(shape).to(x.dtype) * self.base(x) + q[:, 1].view(shape).to(x.dtype) * self.local(x)

    def _hard(self, x: torch.Tensor, takes_global: torch.Tensor) -> torch.Tensor:
        """Each instance through its chosen copy only (the hard policy, §3)."""
        if bool(takes_global.all()):
            return self.base(x)
        if not bool(takes_global.any()):
            return self.local(x)
        global_out = self.base(x[takes_global])
        out = global_out.new_empty((x.shape[0], *global_out.shape[1:]))
        out[takes_global] = global_out
        out[~takes_global] = self.local(x[~takes_global])
        return out



def restart_local_copies(pairs: list[tuple[nn.Module, nn.Module]]) -> None:
    """``w_ℓ ← w_g`` (Alg. 1 line 5) for every (global, local) pair: whole layer copies, or a
    Hugging Face block's global and local LoRA experts."""
    for global_copy, local_copy in pairs:
        local_copy.load_state_dict(global_copy.state_dict())


def layer_name(model: nn.Module, name: str) -> str:
    """A global copy's parameter under the name of the layer it copies (``classifier.base.weight``
    → ``classifier.weight``): how Flow's routed task head is exported as the global model's head."""
    for path, module in model.named_modules():
        if isinstance(module, RoutedLayer) and name.startswith(path + ".base."):
            return path + name[len(path) + len(".base"):]
    return name


def routed_layers(model: nn.Module) -> list[RoutedLayer]:
    """The model's routed layers, in depth order (exit ``j`` of ψ drives the ``j``-th)."""
    return [module for module in model.modules() if isinstance(module, RoutedLayer)]


__all__ = ["RoutedLayer", "layer_name", "restart_local_copies", "routed_layers"]
