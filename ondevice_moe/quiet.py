"""Messages of dependencies that a user of the toolkit cannot act on, silenced when the package loads.

Each is named here, with why, so that nothing else is hidden: a warning that says something about the
user's own run (a dtype, a device, data) still prints.

* bitsandbytes' CPU backend logs, on every import on a CPU with AVX-512 BF16, that it could not fetch
  an optional kernel from the Hugging Face hub (``No module named 'kernels'``): the offline toolkit never
  fetches it and bitsandbytes falls back to its own.
* PEFT calls transformers' ``is_gradient_checkpointing``, which transformers 5 renamed (a FutureWarning on
  every adapter attached).
* torch deprecates ``torch.jit.script_method``, which a dependency's import still uses.
"""

from __future__ import annotations

import logging
import warnings

SILENCED_LOGGERS = ("bitsandbytes.backends.cpu.ops",)
SILENCED_WARNINGS = (
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    (DeprecationWarning, r"`torch\.jit\.script_method` is deprecated"),
)


def silence_dependency_noise() -> None:
    """Install the filters above (idempotent: ``warnings.filterwarnings`` replaces an equal filter)."""
    for name in SILENCED_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category, message in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


__all__ = ["SILENCED_LOGGERS", "SILENCED_WARNINGS", "silence_dependency_noise"]
