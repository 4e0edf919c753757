"""LoRA experts in HF PEFT's adapter format.

An adapter is ``adapter_config.json`` (PEFT's own ``LoraConfig.save_pretrained``) and
``adapter_model.safetensors`` with PEFT's key names (``base_model.model.<module>.lora_A.weight``),
loadable with ``PeftModel.from_pretrained(base, folder)`` and, where the base has a name that
loads (:mod:`~ondevice_moe.export.base_model`), ``AutoPeftModelForCausalLM.from_pretrained(folder)``.
It holds LoRA experts together with the always-on attention LoRA they were trained with, and
the task head of a classifier (``modules_to_save``).

Which adapters an export holds (:func:`peft_adapters`):

* experts mixed with fixed weights (a ``uniform`` router, or none: FedAvg and the other
  baselines without routing): one adapter, ``merged``, the experts side by side at their
  weights, one LoRA of rank ``Σ r_j`` per layer (:mod:`~ondevice_moe.export.merge`) —
  exactly the model where the experts share a layer, the closest PEFT form for an MLP
  mixture;
* experts mixed by a router token by token (CoMiGS): one adapter per expert, the expert
  as if the router sent every token to it; no adapter is the routed model
  (:mod:`~ondevice_moe.export.mixture_gap`);
* one expert, or the attention LoRA alone: one adapter, the model.

The toolkit's ``A`` (r × in) and ``B`` (out × r) are PEFT's ``lora_A.weight`` and
``lora_B.weight`` as they are; CoMiGS's scaling α/√r is PEFT's ``use_rslora``, Hu
et al.'s α/r its default; a merged layer keeps α, its rank ``Σ r_j`` going to
``rank_pattern``, and PEFT's scaling is divided out of its ``B``.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts import LoRA
from ondevice_moe.experts.layer_copy import layer_name
from ondevice_moe.experts.lora import is_gpt2_conv1d
from ondevice_moe.export.base_model import BaseModel
from ondevice_moe.export.experts import Part
from ondevice_moe.export.merge import expert_loras, merged_lora
from ondevice_moe.models.heads import head_paths
from ondevice_moe.run_model import UserModel
from ondevice_moe.safe_files import plain_folder, save_tensors, write_bytes

NOT_EXPRESSIBLE = ("router", "model")  # routers mix experts; whole-model weights are no adapter
MERGED = "merged"
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class PeftAdapter:
    """One PEFT adapter of an export: its name, the experts it holds (the attention LoRA
    among them), whether they are ``merged`` at the mixture's fixed weights (otherwise each is
    taken at weight 1: one expert as if every token were sent to it), and, merged, whether
    that merge is ``exact``ly the model."""

    name: str
    experts: tuple[str, ...]
    merged: bool = False
    exact: bool = True


@dataclass(frozen=True)
class PeftLoRA:
    """One adapted module as PEFT stores it: ``A`` (r × in), ``B`` (out × r) and α."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    alpha: float

    @property
    def rank(self) -> int:
        return int(self.lora_A.shape[0])


def routed_experts(parts: dict[str, Part]) -> list[str]:
    """The experts a router (or fixed weights) mixes: every expert but the attention LoRA."""
    return [name for name, part in parts.items()
            if part.kind not in ("router", "head", "model") and not part.is_attention_lora]


def peft_adapters(model: nn.Module, parts: dict[str, Part], selected: dict[str, Part]) -> list[PeftAdapter]:
    """The PEFT adapters of an export of the ``selected`` parts of a model made of ``parts``
    (see the module docstring)."""
    attention = tuple(name for name, part in selected.items() if part.is_attention_lora)
    routed = [name for name in routed_experts(selected) if selected[name].kind == "lora"]
    mixed = [lora for lora in expert_loras(model) if lora.expert in routed]
    if len(routed) > 1 and routed == routed_experts(parts) and all(lora.weight is not None for lora in mixed):
        return [PeftAdapter(MERGED, (*routed, *attention), merged=True,
                            exact=not any(lora.in_mlp_mixture for lora in mixed))]
    if routed:
        return [PeftAdapter(name, (name, *attention)) for name in routed]
    return [PeftAdapter(name, (name,)) for name in attention]


def check_peft_expressible(parts: dict[str, Part]) -> None:
    """A :class:`UserError` when the selected experts include a kind PEFT's LoRA format cannot hold."""
    foreign = [f"{name} ({part.kind})" for name, part in parts.items()
               if part.kind not in ("lora", "head", *NOT_EXPRESSIBLE)]
    if foreign or not any(part.kind == "lora" for part in parts.values()):
        what = ", ".join(foreign) or "no LoRA expert"
        raise UserError(f"PEFT's LoRA format cannot hold {what}",
                        "export in the toolkit's format (--format toolkit) and load it with "
                        "ondevice_moe.load_adapted, or select LoRA experts with --experts")


def base_module(model: nn.Module, target: str) -> nn.Module:
    """The base model's module at ``target`` inside an adapted model, looking through the
    wrappers a layout puts around base modules (each keeps the wrapped module as ``base``)."""
    module = model
    for segment in [*target.split("."), None]:
        while segment not in module._modules and "base" in module._modules:
            module = module._modules["base"]
        if segment is not None:
            module = module._modules[segment]
    return module


def adapter_loras(model: nn.Module, adapter: PeftAdapter, rank_stabilised: bool) -> dict[str, PeftLoRA]:
    """The adapter's LoRA on each module it adapts: a module's LoRAs of the adapter's experts at
    their weights, merged where there are several (PEFT's scaling divided out of ``B``)."""
    found: dict[str, list[tuple[LoRA, float]]] = {}
    for lora in expert_loras(model):
        if lora.expert in adapter.experts:
            weight = lora.weight if adapter.merged else 1.0
            found.setdefault(lora.target, []).append((lora.lora, weight))
    return {target: _peft_lora(loras, rank_stabilised) for target, loras in sorted(found.items())}


def _peft_lora(loras: list[tuple[LoRA, float]], rank_stabilised: bool) -> PeftLoRA:
    [(first, weight), *_] = loras
    if len(loras) == 1 and weight == 1.0:
        return PeftLoRA(first.lora_A.detach(), first.lora_B.detach(), float(first.alpha))
    merged = merged_lora(loras)
    scaling = first.alpha / (math.sqrt(merged.rank) if rank_stabilised else merged.rank)
    return PeftLoRA(merged.lora_A.detach(), merged.lora_B.detach() / scaling, float(first.alpha))


def is_rank_stabilised(model: nn.Module, adapter: PeftAdapter) -> bool:
    """Whether the adapter's LoRAs scale by α/√r (PEFT's ``use_rslora``) rather than α/r."""
    scalings = {math.isclose(lora.lora.scaling, lora.lora.alpha / math.sqrt(lora.lora.rank)) and lora.lora.rank > 1
                for lora in expert_loras(model) if lora.expert in adapter.experts}
    return scalings == {True}


def lora_config(user_model: UserModel, loras: dict[str, PeftLoRA], rank_stabilised: bool, base: BaseModel):
    """PEFT's ``LoraConfig`` for one adapter."""
    from peft import LoraConfig

    ranks = {target: lora.rank for target, lora in loras.items()}
    alphas = {target: lora.alpha for target, lora in loras.items()}
    rank = Counter(ranks.values()).most_common(1)[0][0]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    model = user_model.model
    language_model = user_model.recipe.is_language_modelling
    return LoraConfig(
        task_type="CAUSAL_LM" if language_model else "SEQ_CLS",
        base_model_name_or_path=base.name_or_path,
        r=rank, lora_alpha=alpha, use_rslora=rank_stabilised,
        rank_pattern={t: r for t, r in ranks.items() if r != rank},
        alpha_pattern={t: a for t, a in alphas.items() if a != alpha},
        target_modules=sorted(loras),
        fan_in_fan_out=any(is_gpt2_conv1d(base_module(model, t)) for t in loras),
        lora_dropout=0.0, bias="none",
        modules_to_save=None if language_model else sorted(head_paths(model)),
        inference_mode=True,
    )


def write_peft_folder(user_model: UserModel, parts: dict[str, Part], adapter: PeftAdapter, folder: Path,
                      base: BaseModel) -> Path:
    """Write ``adapter`` (with a classifier's head) into ``folder`` in PEFT's format."""
    model = user_model.model
    rank_stabilised = is_rank_stabilised(model, adapter)
    loras = adapter_loras(model, adapter, rank_stabilised)
    tensors: dict[str, torch.Tensor] = {}
    for target, lora in loras.items():
        tensors[f"base_model.model.{target}.lora_A.weight"] = lora.lora_A
        tensors[f"base_model.model.{target}.lora_B.weight"] = lora.lora_B
    for name, tensor in parts["head"].tensors.items() if "head" in parts else ():
        tensors[f"base_model.model.{layer_name(model, name)}"] = tensor
    plain_folder(folder)
    with tempfile.TemporaryDirectory() as scratch:  # PEFT writes where it is told, links and all: copy it in
        lora_config(user_model, loras, rank_stabilised, base).save_pretrained(scratch)
        write_bytes(folder / CONFIG, (Path(scratch) / CONFIG).read_bytes())
    save_tensors(folder / WEIGHTS, {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                 metadata={"format": "pt"})
    return folder
