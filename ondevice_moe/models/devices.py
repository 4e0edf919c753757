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


def model_device(model: nn.Module) -> torch.device:
    """The device the model's (first) parameters live on."""
    return next(model.parameters()).device


__all__ = ["DEVICE_NAMES", "DeviceName", "model_device", "resolve_device"]
