"""Base models: an alias registry, offline-first loading, GGUF caching, quantization."""

from ondevice_moe.models.registry import MODEL_ALIASES, LoadedModel, load_base_model, load_base_structure

__all__ = ["MODEL_ALIASES", "LoadedModel", "load_base_model", "load_base_structure"]
