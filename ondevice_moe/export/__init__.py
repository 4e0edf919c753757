"""Export a user's trained model: PEFT adapters for LoRA experts, the toolkit's own
format for the whole model (:func:`load_adapted` reloads it), a model card, and the Hub."""

from ondevice_moe.export.bundle import ExportResult, export_user
from ondevice_moe.export.toolkit_format import load_adapted

__all__ = ["ExportResult", "export_user", "load_adapted"]
