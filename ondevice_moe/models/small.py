"""Small torch models trained whole: a linear model, an MLP and a small CNN.

They serve the small-data experiments of FLoRAL (§6: "a 2-layer ReLU net" for
MNIST, "two convolution layers followed by a 2-layer ReLU net classifier" for
CIFAR-10, and the linear / MLP regressors of App. G), FedSoft (§5 and App. C:
"a conventional linear regression model without the intercept term") and Flow.

Each speaks the trainer's Hugging Face interface: ``model(inputs=x, labels=y)``
returns an object with ``.loss`` and ``.logits``; cross-entropy against class
indices for classification, mean squared error for regression.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.errors import UserError

SMALL_MODELS = ("linear", "mlp", "cnn")


@dataclass
class SmallOutput:
    """What the trainer reads from a forward pass: ``loss`` (when labels were given) and ``logits``."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class SmallModel(nn.Module):
    """A network ``net`` with the HF-style forward: cross-entropy, or MSE when ``regression``;
    ``input_shape``: one example's shape (Flow's policy network reads the flattened input)."""

    def __init__(self, net: nn.Sequential, regression: bool, input_shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.net = net
        self.regression = regression
        self.input_shape = input_shape

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> SmallOutput:
        logits = self.net(inputs)
        if labels is None:
            return SmallOutput(logits)
        if self.regression:
            loss = nn.functional.mse_loss(logits, labels.to(logits.dtype).view_as(logits))
        else:
            loss = nn.functional.cross_entropy(logits, labels.long())
        return SmallOutput(logits, loss)


def small_model(
    kind: str,
    input_shape: Sequence[int],
    num_outputs: int,
    regression: bool = False,
    seed: int = 0,
    hidden: Sequence[int] = (64,),
    channels: Sequence[int] = (16, 32),
    bias: bool = True,
) -> SmallModel:
    """A seeded ``linear`` / ``mlp`` / ``cnn`` for examples of ``input_shape`` with ``num_outputs`` logits.

    ``hidden``: widths of the MLP's ReLU layers (and of the CNN's classifier);
    ``channels``: the CNN's 3×3 convolutions, each followed by ReLU and 2×2
    max-pooling, so ``input_shape`` is ``(channels, height, width)``;
    ``bias=False`` gives FedSoft's regression "without the intercept term".
    """
    if kind not in SMALL_MODELS:
        raise UserError(f"unknown small model '{kind}'", f"use one of {', '.join(SMALL_MODELS)}")
    if num_outputs < 1 or not input_shape or min(input_shape) < 1:
        raise UserError(f"model '{kind}' needs positive sizes, got input_shape={tuple(input_shape)} and "
                        f"{num_outputs} outputs", "check the task's input shape and number of labels")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind == "cnn":
            net = _cnn(tuple(input_shape), num_outputs, tuple(channels), tuple(hidden), bias)
        else:
            widths = (math.prod(input_shape), *(hidden if kind == "mlp" else ()), num_outputs)
            net = nn.Sequential(nn.Flatten(), *_relu_layers(widths, bias))
    return SmallModel(net, regression, tuple(input_shape))


def _relu_layers(widths: Sequence[int], bias: bool) -> list[nn.Module]:
    """Linear layers between consecutive ``widths``, with a ReLU after every one but the last."""
    layers: list[nn.Module] = []
    for index, (width_in, width_out) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(width_in, width_out, bias=bias))
        if index < len(widths) - 2:
            layers.append(nn.ReLU())
    return layers


def _cnn(input_shape: tuple[int, ...], num_outputs: int, channels: tuple[int, ...], hidden: tuple[int, ...],
         bias: bool) -> nn.Sequential:
    if len(input_shape) != 3:
        raise UserError(f"the cnn needs (channels, height, width) inputs, got shape {input_shape}",
                        "use `mlp` or `linear` for vector inputs")
    in_channels, height, width = input_shape
    shrink = 2 ** len(channels)
    if height < shrink or width < shrink:
        raise UserError(f"{len(channels)} pooled convolutions cannot shrink {height}×{width} images",
                        "use fewer convolution channels or larger images")
    layers: list[nn.Module] = []
    for out_channels in channels:
        layers += [nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=bias), nn.ReLU(), nn.MaxPool2d(2)]
        in_channels = out_channels
    features = in_channels * (height // shrink) * (width // shrink)
    return nn.Sequential(*layers, nn.Flatten(), *_relu_layers((features, *hidden, num_outputs), bias))


__all__ = ["SMALL_MODELS", "SmallModel", "SmallOutput", "small_model"]
