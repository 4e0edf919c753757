"""``training.fused_experts`` (issue 64): every expert site of a model computes its experts batched.

A site with several experts launches a few small kernels per expert: on a GPU, where such a step is
bound by launches rather than arithmetic, that is what makes a mixture slower than the one adapter
it competes with. Fused, each site runs a fixed number of products however many experts it holds:
the MLP mixture (:func:`~ondevice_moe.mixture.stacked_mixed_mlp`), gated LoRAs on one layer
(:func:`~ondevice_moe.experts.lora.stacked_codes`) and adapters after a sublayer
(:func:`~ondevice_moe.experts.adapter.add_adapters`). Prefix experts are already one attention call.
The results equal the unfused ones to float rounding; parameter names, checkpoints and exports do
not change.
"""

from __future__ import annotations

from torch import nn

from ondevice_moe.experts.adapter import AdapterAfter
from ondevice_moe.experts.layer import AdaptedLayer
from ondevice_moe.experts.lora import LoRAAdaptedLinear
from ondevice_moe.mixture import MixtureMLP

FUSABLE_SITES = (MixtureMLP, LoRAAdaptedLinear, AdaptedLayer, AdapterAfter)


def fuse_experts(model: nn.Module, fused: bool = True) -> int:
    """Set every expert site of ``model`` to compute its experts batched (``fused``) or one by one;
    the number of sites set."""
    sites = [module for module in model.modules() if isinstance(module, FUSABLE_SITES)]
    for site in sites:
        site.fused = fused
    return len(sites)
