"""Where a model runs: the recipe's ``model.device`` (``auto`` | ``cpu`` | ``cuda``) as a :class:`torch.device`."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ondevice_moe.errors import UserError

DeviceName = Literal["auto", "cpu", "cuda"]
DEVICE_NAMES: tuple[str, ...] = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto``: CUDA when a GPU is visible, else CPU; ``cuda`` without a GPU raises :class:`UserError`."""
    if isinstance(name, torch.device):
        return name
    if name not in DEVICE_NAMES:
        raise UserError(f"unknown device '{name}'", f"use one of {', '.join(DEVICE_NAMES)}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("model.device is 'cuda' but torch sees no CUDA GPU on this machine",
                        "use `model.device: auto` (CUDA when present, else CPU) or `cpu`")
    return torch.device(name)


def native_bfloat16_cpu() -> bool:
    """Whether this CPU computes bfloat16 natively (oneDNN's check: AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def preferred_dtype(device: str) -> str:
    """``bfloat16`` where ``device`` (``auto`` | ``cpu`` | ``cuda``) computes it natively (a CUDA GPU that
    supports it; a CPU with AVX512-BF16 or AMX, where it runs twice as fast as float32), else ``float32``."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    else:
        native = native_bfloat16_cpu()
    return "bfloat16" if native else "float32"


def slow_bfloat16(dtype: str, device: str | torch.device) -> str | None:
    """Why a ``dtype`` base on ``device`` will be slow, where it computes bfloat16 on a CPU without native
    support (AVX512-BF16 or AMX): torch emulates it there, and a matrix product took 100 times float32's
    (an AVX2 AMD EPYC, one thread, 256 × 576 by 576 × 1536: 920 ms against 9 ms). ``None`` elsewhere."""
    if dtype != "bfloat16" or resolve_device(device).type != "cpu" or native_bfloat16_cpu():
        return None
    return ("this CPU has no native bfloat16 (AVX512-BF16 or AMX), so the recipe's bfloat16 base runs emulated, "
            "many times slower than float32 (100x per matrix product on an AVX2 CPU); for speed here add "
            "--set model.dtype=float32 (its figures then differ from a bfloat16 run's)")


def model_device(model: nn.Module) -> torch.device:
    """The device the model's (first) parameters live on."""
    return next(model.parameters()).device


__all__ = ["DEVICE_NAMES", "DeviceName", "model_device", "native_bfloat16_cpu", "preferred_dtype", "resolve_device",
           "slow_bfloat16"]
