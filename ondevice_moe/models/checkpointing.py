"""Activation checkpointing of a device's model, with routers that record once.

A checkpointed decoder block keeps only its input in the forward pass and runs again in the
backward pass to rebuild what its gradients need (Chen et al. 2016, "Training deep nets with
sublinear memory cost"): one more forward per step for the block activations a device no
longer holds. On a quantized base these activations and the experts' optimiser state are most
of what is left (docs/quantization.md).

transformers checkpoints each block's ``forward`` through ``torch.utils.checkpoint`` (so the
forward hooks that route a block's input, Hermes eq. 4, run once, outside it). The replay runs
the routers inside the block again: what they compute is the same (the random state is
replayed too), but what they *record* must be counted once — Hermes' token counts (eq. 6 and
eq. 11) would double, and the replay no longer sees the batch's padding mask. The replay runs
under :func:`replaying`, and a router records only when :func:`recording` says so.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from torch import nn

from ondevice_moe.errors import UserError

_replaying = contextvars.ContextVar("ondevice_moe_replaying", default=False)


def recording() -> bool:
    """False while a checkpointed block is replayed in the backward pass."""
    return not _replaying.get()


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Mark the code inside as the backward pass's replay of a checkpointed block."""
    token = _replaying.set(True)
    try:
        yield
    finally:
        _replaying.reset(token)


def _forward_and_replay_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn``: nothing around the forward, :func:`replaying`
    around the recomputation."""
    return contextlib.nullcontext(), replaying()


def enable_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Checkpoint every block of a transformers model (non-reentrant, so gradients also reach
    the experts' and routers' tensors that a block reads from outside it); a no-op in eval mode.

    Raises :class:`UserError` for models without blocks to checkpoint (the small torch models).
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(f"{type(model).__name__} has no blocks to checkpoint (model.activation_checkpointing)",
                        "use activation checkpointing with a transformers model, or set "
                        "model.activation_checkpointing: false")
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": _forward_and_replay_contexts})
    return model
