"""PEFT experts: small modules that add a residual to a frozen base layer."""

from ondevice_moe.experts.lora import LoRA, LoRAAdaptedLinear, linear_features

__all__ = ["LoRA", "LoRAAdaptedLinear", "linear_features"]
