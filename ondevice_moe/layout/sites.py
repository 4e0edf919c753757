"""Where experts go in each transformer family: module paths relative to a block."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.mixture import MixedForward, gpt2_mixed_forward, llama_mixed_forward


@dataclass(frozen=True)
class Sites:
    """Module paths of one model family, relative to a transformer block.

    ``attention_linears``: every attention projection (the always-on attention
    LoRA); ``routed_lora``: the projections a routed LoRA expert adapts under
    block mixing (Hermes: query and value); ``mlp`` / ``mlp_linears`` /
    ``mixed_forward``: the MLP and its exact mixture (``None`` where the
    architecture has no separable MLP module); ``ffn_output``: where adapter
    experts attach under block mixing.
    """

    blocks: tuple[str, ...]
    attention: str
    attention_linears: tuple[str, ...]
    routed_lora: tuple[str, ...]
    ffn_output: str
    mlp: str | None = None
    mlp_linears: tuple[str, ...] = ()
    mixed_forward: MixedForward | None = None


_BERT_LIKE = {
    "attention": "attention.self",
    "attention_linears": ("attention.self.query", "attention.self.key", "attention.self.value",
                          "attention.output.dense"),
    "routed_lora": ("attention.self.query", "attention.self.value"),
    "ffn_output": "output.dense",
}
SITES: dict[str, Sites] = {
    "gpt2": Sites(("transformer.h",), "attn", ("attn.c_attn", "attn.c_proj"), ("attn.c_attn",), "mlp",
                  "mlp", ("c_fc", "c_proj"), gpt2_mixed_forward),
    "llama": Sites(("model.layers",), "self_attn",
                   ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
                   ("self_attn.q_proj", "self_attn.v_proj"), "mlp",
                   "mlp", ("gate_proj", "up_proj", "down_proj"), llama_mixed_forward),
    "bert": Sites(("bert.encoder.layer", "encoder.layer"), **_BERT_LIKE),
    "roberta": Sites(("roberta.encoder.layer", "encoder.layer"), **_BERT_LIKE),
}


def sites_of(model: nn.Module) -> tuple[Sites, nn.ModuleList]:
    """The sites of ``model``'s architecture and its list of transformer blocks."""
    config = getattr(model, "config", None)
    if config is None:
        raise UserError(f"{type(model).__name__} is a small model without transformer blocks",
                        "put experts on its layers with `mixing: every-layer` (kind `layers`), or use "
                        "a GPT-2, LLaMA, BERT or RoBERTa model")
    model_type = getattr(config, "model_type", None)
    sites = SITES.get(model_type)
    if sites is None:
        raise UserError(f"model type {model_type!r} has no expert sites", f"use one of {sorted(SITES)}")
    for path in sites.blocks:
        try:
            return sites, model.get_submodule(path)
        except AttributeError:
            continue
    raise UserError(f"cannot find the transformer blocks of this {model_type} model", "load it with a standard class")
