"""Model folders that ask to run their own code are refused, never loaded quietly without it.

A ``config.json`` or ``tokenizer_config.json`` with an ``auto_map`` names Python files of the folder
that ``transformers`` would import with ``trust_remote_code=True``. ondevice-moe never passes that
flag, and without it ``transformers`` either refuses such a model or, where the ``model_type`` is
one it knows, silently loads its own class instead of the one the folder names: a model that may
not be the one its author meant. Both are refused here with one message, before anything loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from ondevice_moe.errors import UserError

CODE_NAMING_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
MAX_CONFIG_BYTES = 16 * 2**20  # a config is kilobytes; a larger one is left to the loader's own checks


def refuse_custom_code(name: str, folder: Path) -> None:
    """:class:`UserError` when a file of the model ``folder`` maps classes to the folder's own code."""
    for file in CODE_NAMING_FILES:
        path = folder / file
        try:
            if not path.is_file() or path.stat().st_size > MAX_CONFIG_BYTES:
                continue
            found = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue  # unreadable: the loader says so in its own words
        if isinstance(found, dict) and found.get("auto_map"):
            refuse_mapped_code(name, f"{path}", found["auto_map"])


def refuse_mapped_code(name: str, where: str, auto_map: object) -> None:
    """The refusal of a model whose ``where`` (a file, or a hub model's config) carries ``auto_map``."""
    classes = ", ".join(sorted(map(str, auto_map))) if isinstance(auto_map, dict) else str(auto_map)
    raise UserError(f"model '{name}' asks to run its own code ({where} maps {classes} to Python files); "
                    "ondevice-moe runs only the model classes transformers ships",
                    "use a model of a standard architecture (its config without auto_map), or port the model's "
                    "code into transformers' classes and save it with save_pretrained")
