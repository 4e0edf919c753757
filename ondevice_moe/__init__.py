"""ondevice-moe: on-device, collaborative fine-tuning of Hugging Face language
models with mixtures of PEFT experts, coordinated through Flower."""

from pathlib import Path

__version__ = "0.1.0"

BUNDLED_RECIPES = Path(__file__).resolve().parent / "recipes"
"""The recipes that ship inside the package (``ondevice-moe recipes list``)."""
