"""ondevice-moe: on-device, collaborative fine-tuning of Hugging Face language
models with mixtures of PEFT experts, coordinated through Flower.

The Python API (docs/api.md):

* :func:`finetune` — run a recipe (a file, a bundled recipe's name, or a ``Recipe``)
  as ``ondevice-moe finetune`` does, with overrides; returns the run folder and results.
* :func:`load_recipe` — read and validate a recipe, with overrides, without running it.
* :func:`get_mixture_model` and :class:`MixtureConfig` — attach experts and routers to a
  Hugging Face or torch model for a training loop of your own, without federation.
* :func:`load_adapted` — a user's trained model from an ``ondevice-moe export`` folder.

They are imported on first use, so ``import ondevice_moe`` stays light (no torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ondevice_moe.distribution import BUNDLED_RECIPES, VERSION
from ondevice_moe.quiet import silence_dependency_noise

__version__ = VERSION
silence_dependency_noise()

if TYPE_CHECKING:
    from ondevice_moe.api import FinetuneResult, MixtureConfig, finetune, get_mixture_model, load_recipe
    from ondevice_moe.export.toolkit_format import load_adapted

_LAZY = {
    "finetune": "ondevice_moe.api",
    "FinetuneResult": "ondevice_moe.api",
    "get_mixture_model": "ondevice_moe.api",
    "MixtureConfig": "ondevice_moe.api",
    "load_recipe": "ondevice_moe.api",
    "load_adapted": "ondevice_moe.export.toolkit_format",
}

__all__ = [
    "BUNDLED_RECIPES",
    "FinetuneResult",
    "MixtureConfig",
    "__version__",
    "finetune",
    "get_mixture_model",
    "load_adapted",
    "load_recipe",
]


def __getattr__(name: str) -> Any:
    """The API's functions and classes, imported on first use so that ``import ondevice_moe`` stays light."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ondevice_moe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
