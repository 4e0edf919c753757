"""Experts of several kinds in every transformer block, one router per block (Hermes §4.2).

Each expert adds its residual where it naturally sits, and the block's router
scales it token by token, so the mixture of Hermes eq. (9) costs one forward
pass:

* ``lora``: low-rank updates on the attention projections (r = 8);
* ``adapter``: a Houlsby bottleneck after the feed-forward sublayer (r = 16);
* ``prefix``: learned keys and values prepended in the block's attention
  (l_p = 16), gated through the registered attention function.

Works for BERT/RoBERTa encoders and for GPT-2 and LLaMA decoders.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts import LoRA, LoRAAdaptedLinear, linear_features
from ondevice_moe.experts.adapter import Adapter, AdapterAfter
from ondevice_moe.experts.prefix import Prefix, register_prefix_attention
from ondevice_moe.inject import expert_generator, frozen_copy
from ondevice_moe.routing.hermes import HermesRouter

EXPERT_KINDS = ("lora", "adapter", "prefix")


@dataclass(frozen=True)
class BlockSites:
    """Where each expert kind attaches, relative to one block."""

    blocks: tuple[str, ...]
    attention: str
    lora_targets: tuple[str, ...]
    ffn_output: str


BLOCK_SITES: dict[str, BlockSites] = {
    "bert": BlockSites(("bert.encoder.layer", "encoder.layer"), "attention.self",
                       ("attention.self.query", "attention.self.value"), "output.dense"),
    "roberta": BlockSites(("roberta.encoder.layer", "encoder.layer"), "attention.self",
                          ("attention.self.query", "attention.self.value"), "output.dense"),
    "gpt2": BlockSites(("transformer.h",), "attn", ("attn.c_attn",), "mlp"),
    "llama": BlockSites(("model.layers",), "self_attn", ("self_attn.q_proj", "self_attn.v_proj"), "mlp"),
}


@dataclass(frozen=True)
class BlockLayout:
    """The experts of every block and how they are routed.

    ``router``: ``none`` (one expert kind, always on: the single-PEFT
    baselines), ``hermes`` (Hermes router) or ``sigmoid`` (FedUniPELT gates).
    """

    experts: tuple[str, ...] = EXPERT_KINDS
    router: Literal["none", "hermes", "sigmoid"] = "hermes"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    adapter_rank: int = 16
    prefix_length: int = 16
    top_k: int = 2
    temperature: float = 0.1
    gamma: float = 0.5
    bias_rate: float = 0.05
    gradient_ema: float = 0.9
    use_feature: bool = True
    use_gradient: bool = True

    def __post_init__(self) -> None:
        unknown = [kind for kind in self.experts if kind not in EXPERT_KINDS]
        if unknown:
            raise UserError(f"unknown expert kind(s) {unknown}", f"use some of {list(EXPERT_KINDS)}")
        if self.router == "hermes" and not 1 <= self.top_k <= len(self.experts):
            raise UserError(
                f"top_k = {self.top_k} but each block holds {len(self.experts)} expert(s) {list(self.experts)}",
                f"set top_k between 1 and {len(self.experts)}",
            )


def block_sites(model: nn.Module) -> tuple[BlockSites, nn.ModuleList]:
    model_type = getattr(model.config, "model_type", None)
    sites = BLOCK_SITES.get(model_type)
    if sites is None:
        raise UserError(f"model type {model_type!r} has no expert sites", f"use one of {sorted(BLOCK_SITES)}")
    for path in sites.blocks:
        try:
            return sites, model.get_submodule(path)
        except AttributeError:
            continue
    raise UserError(f"cannot find the transformer blocks of this {model_type} model", "load it with a standard class")


def attach_block_experts(base_model: nn.Module, layout: BlockLayout, *, seed: int, own: tuple[str, ...] = ()
                         ) -> nn.Module:
    """A copy of ``base_model`` (sharing frozen weights, except the modules in ``own``)
    with the layout's experts in every block."""
    model = frozen_copy(base_model, own)
    sites, blocks = block_sites(model)
    config = model.config
    if "prefix" in layout.experts:
        _use_prefix_attention(model)
    for index, block in enumerate(blocks):
        router = _router(layout, config.hidden_size) if layout.router != "none" else None
        expert_params: dict[str, list[nn.Parameter]] = {kind: [] for kind in layout.experts}
        if "lora" in layout.experts:
            for target in sites.lora_targets:
                parent_path, _, name = target.rpartition(".")
                parent = block.get_submodule(parent_path)
                lora = LoRA(*linear_features(getattr(parent, name)), layout.lora_rank, layout.lora_alpha,
                            expert_generator(seed, index, target, "shared"), rank_stabilised=False)
                setattr(parent, name, LoRAAdaptedLinear(getattr(parent, name), {"shared": lora},
                                                        router.slot("lora") if router else None))
                expert_params["lora"] += list(lora.parameters())
        if "adapter" in layout.experts:
            parent_path, _, name = sites.ffn_output.rpartition(".")
            parent = block.get_submodule(parent_path) if parent_path else block
            adapter = Adapter(config.hidden_size, layout.adapter_rank,
                              expert_generator(seed, index, sites.ffn_output, "shared"))
            setattr(parent, name, AdapterAfter(getattr(parent, name), {"shared": adapter},
                                               router.slot("adapter") if router else None))
            expert_params["adapter"] += list(adapter.parameters())
        if "prefix" in layout.experts:
            attention = block.get_submodule(sites.attention)
            heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            prefix = Prefix(heads, layout.prefix_length, head_dim, expert_generator(seed, index, "prefix", "shared"))
            attention.prefix = nn.ModuleDict({"shared": prefix})
            attention.prefix_gate = router.slot("prefix") if router else None
            expert_params["prefix"] += list(prefix.parameters())
        if router is not None:
            block.router = router
            router.expert_params = expert_params
            block.register_forward_pre_hook(_route_block_input, with_kwargs=True)
    return model


def _router(layout: BlockLayout, hidden_size: int) -> HermesRouter:
    top_k = layout.top_k if layout.router == "hermes" else len(layout.experts)
    return HermesRouter(hidden_size, layout.experts, top_k, layout.temperature, layout.gamma, layout.bias_rate,
                        layout.gradient_ema, layout.use_feature, layout.use_gradient,
                        "sigmoid" if layout.router == "sigmoid" else "hermes")


def _route_block_input(block: nn.Module, args: tuple, kwargs: dict) -> None:
    """Route on the block input ``h^(l-1)`` before the block runs (Hermes eq. 4)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    block.router(hidden)


def _use_prefix_attention(model: nn.Module) -> None:
    name = register_prefix_attention()
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError) as error:
        raise UserError(
            f"prefix experts need a model whose attention takes registered attention functions; "
            f"{type(model).__name__} does not ({error})",
            "drop `prefix` from the expert kinds, or use a BERT/RoBERTa, GPT-2 or LLaMA model",
        ) from None


def block_routers(model: nn.Module) -> list[HermesRouter]:
    return [module for module in model.modules() if isinstance(module, HermesRouter)]
