"""ondevice-moe: on-device, collaborative fine-tuning of Hugging Face language
models with mixtures of PEFT experts, coordinated through Flower."""

from pathlib import Path

__version__ = "0.1.0"

BUNDLED_RECIPES = Path(__file__).resolve().parent / "recipes"
"""The recipes that ship inside the package (``ondevice-moe recipes list``)."""


def __getattr__(name: str):
    """``ondevice_moe.load_adapted``, imported on first use so that ``import ondevice_moe`` stays light."""
    if name == "load_adapted":
        from ondevice_moe.export.toolkit_format import load_adapted

        return load_adapted
    raise AttributeError(f"module 'ondevice_moe' has no attribute {name!r}")
