"""A model's task head: the modules that turn its features into a task's outputs.

A sequence classifier of ``transformers`` keeps its head in ``classifier`` (BERT, RoBERTa) or
``score`` (LLaMA, GPT-2), with BERT's ``pooler`` before it; a small model of the toolkit
(:mod:`ondevice_moe.models.small`) ends in its ``net``'s last layer. The federation trains a
classifier's head with the experts; a method may keep it on the device (FedPer: ``HEAD`` in
``Sharing.private_modules``)."""

from __future__ import annotations

from torch import nn

from ondevice_moe.models.small import SmallModel


def head_paths(model: nn.Module) -> tuple[str, ...]:
    """The task head of a sequence classifier, as module paths of ``model``; none for a language model."""
    return tuple(name for name, _ in model.named_modules()
                 if name in ("classifier", "score") or name.endswith(".pooler"))


def output_layer_paths(model: nn.Module) -> tuple[str, ...]:
    """The layers that produce the outputs: a classifier's head, or a small model's last layer with
    weights (wherever the model sits in ``model``, an expert layout's host included)."""
    heads = head_paths(model)
    if heads:
        return heads
    for name, module in model.named_modules():
        if isinstance(module, SmallModel):
            last = max((index for index, layer in enumerate(module.net) if any(True for _ in layer.parameters())),
                       default=None)
            if last is not None:
                return (f"{name}.net.{last}".lstrip("."),)
    return ()
