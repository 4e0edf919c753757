"""A user's whole model in the toolkit's own format, and its loader.

An export folder holds ``recipe.yaml`` (the run's recipe), ``export.json`` (the
method, the user's device and which parts were exported) and
``experts.safetensors`` (the exported tensors under the toolkit's names).
:func:`load_adapted` attaches the device's layout to a base model — seeded
exactly as in training — and loads the tensors, so an export of every part
(``--experts all``) reproduces the user's model, routers included, for any
method: LoRA, adapter and prefix experts, FLoRAL's adaptors, Flow's layer copies,
FedSoft's and other whole-model weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from torch import nn

from ondevice_moe import strict_yaml
from ondevice_moe.errors import UserError
from ondevice_moe.export.experts import Part
from ondevice_moe.run_model import UserModel
from ondevice_moe.safe_files import save_tensors, write_text

MANIFEST = "export.json"
WRITTEN_LIST = ".ondevice-moe-written.json"  # what an export wrote, so that `export --force` removes only that
TENSORS = "experts.safetensors"
RECIPE = "recipe.yaml"
FORMAT = "ondevice-moe-export"
FORMAT_VERSION = 1


def write_toolkit_export(user_model: UserModel, parts: dict[str, Part], selected: dict[str, Part],
                         folder: Path) -> None:
    """Write the selected parts, the recipe and the manifest into ``folder``."""
    job = user_model.job
    tensors = {name: tensor.detach().contiguous().cpu() for part in selected.values()
               for name, tensor in part.tensors.items()}
    save_tensors(folder / TENSORS, tensors, metadata={"format": "pt"})
    write_text(folder / RECIPE, yaml.safe_dump(user_model.recipe.model_dump(mode="json"), sort_keys=False))
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "method": job.method.name, "method_index": job.method_index,
        "user": user_model.user, "device": user_model.device,
        "parts": {name: {"kind": part.kind, "role": part.role.value, "exported": name in selected}
                  for name, part in parts.items()},
    }
    write_text(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def read_manifest(folder: Path) -> dict:
    """The manifest of an export folder; anything else is a :class:`UserError`."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"{folder} is not an ondevice-moe export ({MANIFEST}: {error})",
                        "pass a folder written by `ondevice-moe export`") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise UserError(f"{path} is not an {FORMAT} of version {FORMAT_VERSION}",
                        "re-export it with this version of ondevice-moe")
    kinds = {"method": str, "method_index": int, "device": int}
    wrong = [key for key, kind in kinds.items() if not isinstance(manifest.get(key), kind)
             or isinstance(manifest.get(key), bool) or (kind is int and manifest[key] < 0)]
    if wrong:
        raise UserError(f"{path} is damaged: {wrong} missing or of the wrong kind", "re-export the folder")
    return manifest


def load_adapted(base: nn.Module | None, folder: str | Path, device: str | None = None) -> nn.Module:
    """The exported model in ``folder``: ``base`` (default: the recipe's model, loaded as in
    training) with the user's experts and routers attached and loaded, in eval mode.

    ``device`` (``auto`` | ``cpu`` | ``cuda``) overrides the recipe's ``model.device`` when
    the base is loaded here. Parts left out of the export (``--experts shared`` leaves the
    private ones) keep their seeded initial values: a fresh LoRA or adapter adds nothing.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ondevice_moe.federation.device import build_model, shape_mismatch
    from ondevice_moe.federation.job import Job
    from ondevice_moe.overrides import apply_override
    from ondevice_moe.recipe import validate_recipe

    folder = Path(folder)
    manifest = read_manifest(folder)
    raw = strict_yaml.read_mapping(folder / RECIPE, "re-export the folder; do not edit its recipe.yaml")
    if device is not None:
        apply_override(raw, f"model.device={device}")
    recipe = validate_recipe(raw, source=str(folder / RECIPE))
    if manifest["method_index"] >= len(recipe.methods) or manifest["device"] >= len(recipe.user_names):
        raise UserError(f"{folder}: {MANIFEST} names a method or device its {RECIPE} does not have",
                        "re-export the folder; do not edit its files")
    job = Job(recipe, manifest["method_index"], folder)
    if job.method.name != manifest["method"]:
        raise UserError(f"{folder}: {RECIPE} does not hold method '{manifest['method']}'",
                        "re-export the folder; do not edit its recipe.yaml")
    model = build_model(job, int(manifest["device"]), base)
    try:
        state = load_file(str(folder / TENSORS))
    except (SafetensorError, OSError) as error:
        raise UserError(f"{folder / TENSORS} is unreadable ({error})", "re-export the folder") from None
    unexpected = sorted(set(state) - set(model.state_dict()))
    mismatch = shape_mismatch(model.state_dict(), state)
    if unexpected or mismatch:
        raise UserError(f"{folder} does not fit this base model ({mismatch or f'e.g. {unexpected[:2]}'})",
                        "pass the base model the run was trained on (see the export's README.md)")
    target = next(model.parameters()).device
    model.load_state_dict({name: tensor.to(target) for name, tensor in state.items()}, strict=False)
    return model.eval()
