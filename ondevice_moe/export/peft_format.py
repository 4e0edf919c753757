"""LoRA experts in HF PEFT's adapter format.

One folder per LoRA expert: ``adapter_config.json`` and ``adapter_model.safetensors``
with PEFT's key names (``base_model.model.<module>.lora_A.weight``), loadable with
``PeftModel.from_pretrained(base, folder)``. A folder holds the expert together
with the always-on attention LoRA it was trained with, and the task head of a
classifier (``modules_to_save``).

The toolkit's ``A`` (r × in) and ``B`` (out × r) are PEFT's ``lora_A.weight`` and
``lora_B.weight`` as they are; CoMiGS's scaling α/√r is PEFT's ``use_rslora``, Hu
et al.'s α/r its default. A folder is the user's model exactly only when nothing
routes between experts; otherwise it is one expert of a mixture (see
:mod:`ondevice_moe.export.mixture_gap`).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts import LoRA
from ondevice_moe.experts.layer_copy import layer_name
from ondevice_moe.experts.lora import is_gpt2_conv1d
from ondevice_moe.export.experts import Part, part_of
from ondevice_moe.federation.device import head_paths
from ondevice_moe.run_model import UserModel

NOT_EXPRESSIBLE = ("router", "model")  # routers mix experts; whole-model weights are no adapter


def peft_experts(parts: dict[str, Part]) -> list[str]:
    """The parts that get a PEFT folder: every routed LoRA expert, or the attention LoRA
    alone when nothing else is routed."""
    routed = [name for name, part in parts.items() if part.kind == "lora" and not part.is_attention_lora]
    return routed or [name for name, part in parts.items() if part.is_attention_lora]


def check_peft_expressible(parts: dict[str, Part]) -> None:
    """A :class:`UserError` when the selected experts include a kind PEFT's LoRA format cannot hold."""
    foreign = [f"{name} ({part.kind})" for name, part in parts.items()
               if part.kind not in ("lora", "head", *NOT_EXPRESSIBLE)]
    if foreign or not peft_experts(parts):
        what = ", ".join(foreign) or "no LoRA expert"
        raise UserError(f"PEFT's LoRA format cannot hold {what}",
                        "export in the toolkit's format (--format toolkit) and load it with "
                        "ondevice_moe.load_adapted, or select LoRA experts with --experts")


def peft_target(lora_path: str) -> str:
    """The base model's module that a toolkit LoRA module adapts: ``…c_attn.adapters.shared``
    → ``…c_attn``; ``…mlp.experts.shared_0.c_fc`` → ``…mlp.c_fc``."""
    parts = lora_path.split(".")
    for segment in ("adapters", "experts"):
        if segment in parts:
            index = parts.index(segment)
            return ".".join(parts[:index] + parts[index + 2 :])
    raise ValueError(f"{lora_path} is not a LoRA expert's module")


def expert_loras(model: nn.Module, names: set[str]) -> dict[str, LoRA]:
    """The LoRA modules of the experts ``names``, keyed by the base module they adapt."""
    return {peft_target(path): module for path, module in model.named_modules()
            if isinstance(module, LoRA) and part_of(path, ()) in names}


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


def adapter_config(user_model: UserModel, loras: dict[str, LoRA], base_name: str) -> dict:
    """PEFT's ``LoraConfig`` for one folder, as JSON."""
    ranks = {target: int(lora.lora_A.shape[0]) for target, lora in loras.items()}
    alphas = {target: float(lora.alpha) for target, lora in loras.items()}
    rank = Counter(ranks.values()).most_common(1)[0][0]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    stabilised = {math.isclose(lora.scaling, lora.alpha / math.sqrt(lora.rank)) and lora.rank > 1
                  for lora in loras.values()}
    model = user_model.model
    recipe = user_model.recipe
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if recipe.is_language_modelling else "SEQ_CLS",
        "base_model_name_or_path": base_name,
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": stabilised == {True},
        "rank_pattern": {t: r for t, r in ranks.items() if r != rank},
        "alpha_pattern": {t: a for t, a in alphas.items() if a != alpha},
        "target_modules": sorted(loras),
        "fan_in_fan_out": any(is_gpt2_conv1d(base_module(model, t)) for t in loras),
        "lora_dropout": 0.0,
        "bias": "none",
        "modules_to_save": None if recipe.is_language_modelling else sorted(head_paths(model)),
        "inference_mode": True,
    }


def write_peft_folder(user_model: UserModel, parts: dict[str, Part], expert: str, folder: Path,
                      base_name: str) -> Path:
    """Write ``expert`` (with the attention LoRA it was trained with, and the head) as a PEFT adapter."""
    from safetensors.torch import save_file

    with_attention = {expert, *(name for name, part in parts.items() if part.is_attention_lora)}
    loras = expert_loras(user_model.model, with_attention)
    tensors: dict[str, torch.Tensor] = {}
    for target, lora in sorted(loras.items()):
        tensors[f"base_model.model.{target}.lora_A.weight"] = lora.lora_A.detach()
        tensors[f"base_model.model.{target}.lora_B.weight"] = lora.lora_B.detach()
    for name, tensor in parts["head"].tensors.items() if "head" in parts else ():
        tensors[f"base_model.model.{layer_name(user_model.model, name)}"] = tensor
    folder.mkdir(parents=True, exist_ok=True)
    config = adapter_config(user_model, loras, base_name)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder
