"""The parts every mixing builds with: a frozen copy of the base, seeded experts, residual sites and
the layers a small model adapts."""

from __future__ import annotations

import copy
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.experts import LoRA, LoRAAdaptedLinear, linear_features
from ondevice_moe.experts.adapter import Adapter, AdapterAfter
from ondevice_moe.experts.prefix import Prefix
from ondevice_moe.layout.sites import Sites, sites_of
from ondevice_moe.layout.spec import Layout


def expert_generator(seed: int, *parts: object) -> torch.Generator:
    """A generator whose seed depends only on ``seed`` and the expert's identity."""
    key = ":".join(str(p) for p in (seed, *parts))
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def under(name: str, paths: tuple[str, ...]) -> bool:
    """Whether the module or parameter ``name`` is one of ``paths`` or inside one."""
    return any(name == path or name.startswith(path + ".") for path in paths)


def frozen_copy(base_model: nn.Module, own: tuple[str, ...] = ()) -> nn.Module:
    """A structural copy of ``base_model`` that shares its frozen weights.

    Parameters under the module paths in ``own`` (e.g. a classification head
    that each device trains) are copied instead, so training them never
    touches the shared base. Every parameter of the copy starts frozen.
    """
    shared: dict[int, object] = {
        id(tensor): tensor
        for name, tensor in (*base_model.named_parameters(), *base_model.named_buffers())
        if not under(name, own)
    }
    shared.update(_int8_states(base_model))
    model = copy.deepcopy(base_model, memo=shared)
    model.requires_grad_(False)
    return model


def _int8_states(model: nn.Module) -> dict[int, object]:
    """The ``state`` of every bitsandbytes int8 layer, to be shared by all copies.

    The first forward of a ``Linear8bitLt`` moves the quantized weight (``weight.CB``,
    ``weight.SCB``) into its own ``state`` and clears it on the weight. The weight is shared
    between copies, so a copy with a state of its own would leave every later copy with
    neither, and they would multiply by the int8 codes as if they were values.
    """
    return {id(module.state): module.state for module in model.modules() if type(module).__name__ == "Linear8bitLt"}


@dataclass
class ExpertBuilder:
    """Makes expert modules with reproducible initialisations."""

    layout: Layout
    config: object
    seed: int
    user: int

    def generator(self, index: int, where: str, name: str) -> torch.Generator:
        parts: tuple[object, ...] = (name,) if name.startswith("shared") else (name, "user", self.user)
        return expert_generator(self.seed, index, where, *parts)

    def router_generator(self, index: int) -> torch.Generator:
        """The router of block ``index`` starts the same on every device (shared routers need it)."""
        return expert_generator(self.seed, index, "router")

    def lora(self, block: nn.Module, path: str, index: int, name: str, rank: int | None = None) -> LoRA:
        sizes = self.layout.sizes
        layer = block.get_submodule(path)
        base = layer.base if isinstance(layer, LoRAAdaptedLinear) else layer
        return LoRA(*linear_features(base), rank or sizes.lora_rank, sizes.lora_alpha,
                    self.generator(index, path, name), rank_stabilised=sizes.rank_stabilised)

    def adapter(self, index: int, where: str, name: str) -> Adapter:
        return Adapter(self.config.hidden_size, self.layout.sizes.adapter_rank, self.generator(index, where, name))

    def prefix(self, index: int, name: str) -> Prefix:
        config = self.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return Prefix(heads, self.layout.sizes.prefix_length, head_dim, self.generator(index, "prefix", name))


def add_residual(block: nn.Module, path: str, name: str, expert: nn.Module, gate,
                  site: type[LoRAAdaptedLinear | AdapterAfter]) -> None:
    """Attach ``expert`` under ``name`` to the module at ``path``, wrapping that module in ``site``
    (a LoRA-adapted linear layer, or a sublayer followed by adapters) the first time."""
    parent_path, _, leaf = path.rpartition(".")
    parent = block.get_submodule(parent_path) if parent_path else block
    layer = getattr(parent, leaf)
    if not isinstance(layer, site):
        layer = site(layer, {})
        setattr(parent, leaf, layer)
    layer.add(name, expert, gate)


def blocks_with_attention_lora(model: nn.Module, layout: Layout, builder: ExpertBuilder
                               ) -> Iterator[tuple[Sites, int, nn.Module]]:
    """Each transformer block of ``model``, with the architecture's sites and the block's index, after
    its always-on attention LoRA (``layout.attention_lora``, CoMiGS App. B.1.2) is added; blocks are
    yielded only where the layout has routed experts to put in them."""
    sites, blocks = sites_of(model)
    for index, block in enumerate(blocks):
        if layout.attention_lora is not None:
            for path in sites.attention_linears:
                add_residual(block, path, layout.attention_lora,
                             builder.lora(block, path, index, layout.attention_lora), None, LoRAAdaptedLinear)
        if layout.experts:
            yield sites, index, block


def adaptable_layers(model: nn.Module, own: tuple[str, ...] = ()) -> list[tuple[str, nn.Module]]:
    """The layers FLoRAL adapts, with their paths: every leaf layer of a small model; of a Hugging
    Face model, those inside its transformer blocks and its task head ``own`` (the embeddings and
    the language-model head keep their weights)."""
    if hasattr(model, "config"):
        _, blocks = sites_of(model)
        prefix = next(name for name, module in model.named_modules() if module is blocks)
        scope = [(name, module) for name, module in model.named_modules()
                 if name.startswith(prefix + ".") or under(name, own)]
    else:
        scope = [(name, module) for name, module in model.named_modules() if name]
    return [(path, module) for path, module in scope if not list(module.children())]
