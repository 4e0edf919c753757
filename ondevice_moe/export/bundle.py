"""One export: a user's trained model from a finished run, written to a folder (and pushed).

The folder holds, by ``fmt``: the toolkit's format (``toolkit``: the whole model,
:mod:`~ondevice_moe.export.toolkit_format`), PEFT adapters (``peft``:
:mod:`~ondevice_moe.export.peft_format`; one adapter at the top of the folder, so that
``AutoPeftModelForCausalLM.from_pretrained`` loads the folder or its Hub repository,
several — a routed mixture's experts — in ``<expert>/``), or both (the default); and
always the model card ``README.md``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ondevice_moe.destination import check_folder_destination
from ondevice_moe.errors import UserError
from ondevice_moe.export.base_model import base_model_of
from ondevice_moe.export.experts import Part, model_parts, select_parts
from ondevice_moe.export.hub import check_online, push_to_hub
from ondevice_moe.export.mixture_gap import GAP_BLOCKS, MixtureGap, mixture_gap
from ondevice_moe.export.model_card import model_card, write_model_card
from ondevice_moe.export.peft_format import WEIGHTS, check_peft_expressible, peft_adapters, write_peft_folder
from ondevice_moe.export.toolkit_format import MANIFEST, RECIPE, TENSORS, WRITTEN_LIST, write_toolkit_export
from ondevice_moe.folder_lock import FolderBusy, folder_held
from ondevice_moe.names import is_plain_name
from ondevice_moe.run_model import UserModel, open_user_model
from ondevice_moe.safe_files import plain_folder, write_text

FORMATS = ("both", "toolkit", "peft")
WRITTEN = ("README.md", MANIFEST, RECIPE, TENSORS, "adapter_config.json", WEIGHTS)


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: its folder, the parts it holds, its PEFT folders, the measured
    gap between a routed mixture and its merged experts, and the Hub URL when pushed."""

    folder: Path
    parts: tuple[str, ...]
    peft_folders: tuple[Path, ...]
    gap: MixtureGap | None
    url: str | None = None


def export_user(run_dir: Path, method: str, user: str, to: Path, experts: list[str] | None = None,
                fmt: str = "both", force: bool = False, push_to: str | None = None, private: bool = False,
                device: str | None = None, centre: int | None = None) -> ExportResult:
    """Export ``user``'s model of ``method`` from ``run_dir`` into ``to`` (see the module docstring).

    ``experts``: ``["shared"]`` (default), ``["all"]`` or expert names; ``device`` overrides
    the recipe's ``model.device``; ``centre``: FedSoft's, IFCA's or FedEM's cluster centre ``centre`` (the
    server's) in place of the user's shared tensors — for a new user, the centre that fits it
    (FedSoft §5). Bad input is a :class:`UserError` before anything is written.
    """
    check_folder_destination(Path(to), "--to")  # before the model loads
    if fmt not in FORMATS:
        raise UserError(f"unknown format '{fmt}'", f"use one of: {', '.join(FORMATS)}")
    if push_to is not None:
        check_online(push_to)
    _check_target(Path(to), force)
    user_model = open_user_model(Path(run_dir), method, user, device)
    if centre is not None:
        from ondevice_moe.federation.device import load_server_model

        load_server_model(user_model.job, centre, user_model.model)
    parts = model_parts(user_model)
    selected = select_parts(parts, experts or ["shared"])
    if fmt == "peft":
        check_peft_expressible(selected)
    folder = Path(to)
    plain_folder(folder)
    with _export_lock(folder):
        return _write_export(user_model, parts, selected, folder, fmt, force, push_to, private)


def _write_export(user_model: UserModel, parts: dict[str, Part], selected: dict[str, Part], folder: Path, fmt: str,
                  force: bool, push_to: str | None, private: bool) -> ExportResult:
    """Write the export into ``folder``, which this process holds."""
    _check_target(folder, force)  # again: another export may have written there since the first look
    _clear_previous(folder)
    if fmt != "peft":
        write_toolkit_export(user_model, parts, selected, folder)
    base = base_model_of(user_model.recipe.model.name)
    adapters = peft_adapters(user_model.model, parts, selected) if fmt != "toolkit" else []
    peft_folders = tuple(write_peft_folder(user_model, selected, adapter,
                                           folder if len(adapters) == 1 else folder / adapter.name, base)
                         for adapter in adapters)
    gap = _gap(user_model)
    write_model_card(folder, model_card(user_model, parts, selected, adapters, fmt != "peft", gap, base,
                                        push_to or folder.name, pushed=push_to is not None))
    _record_written(folder, peft_folders)
    url = push_to_hub(folder, push_to, private) if push_to is not None else None
    return ExportResult(folder, tuple(selected), peft_folders, gap, url)


@contextlib.contextmanager
def _export_lock(folder: Path) -> Iterator[None]:
    """Hold ``folder`` for this export: a second export into it at the same time is refused, not interleaved."""
    try:
        with folder_held(folder):
            yield
    except FolderBusy:
        raise UserError(f"another export is writing to {folder}", "wait for it to finish, or choose another "
                        "--to folder") from None


def _check_target(folder: Path, force: bool) -> None:
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file", "choose a folder for --to")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if not force:
        raise UserError(f"{folder} is not empty", "choose another --to folder, or pass --force to overwrite "
                        "an earlier export there")
    _written_before(folder)  # --force replaces an earlier export, never a folder of the user's


def _written_before(folder: Path) -> list[str]:
    """What an earlier export wrote into ``folder`` (its ``WRITTEN_LIST``); a folder without one was never an export."""
    record = folder / WRITTEN_LIST
    fix = "choose an empty or new --to folder: --force only replaces what an earlier export wrote"
    if not record.is_file() or record.is_symlink():
        raise UserError(f"{folder} holds files that no ondevice-moe export wrote", fix)
    try:
        names = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"{record} is damaged ({error})", fix) from None
    if not isinstance(names, list) or not all(isinstance(n, str) and is_plain_name(n) for n in names):
        raise UserError(f"{record} does not list plain names", fix)
    return names


def _clear_previous(folder: Path) -> None:
    """Remove what an earlier export wrote into ``folder`` (as it listed it), and nothing else: a link is
    removed as a link, never followed."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    for name in _written_before(folder):
        path = folder / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
    (folder / WRITTEN_LIST).unlink()


def _record_written(folder: Path, peft_folders: tuple[Path, ...]) -> None:
    names = [name for name in WRITTEN if (folder / name).is_file()] + [path.name for path in peft_folders
                                                                       if path != folder]
    write_text(folder / WRITTEN_LIST, json.dumps(names))


def _gap(user_model: UserModel) -> MixtureGap | None:
    """A routed LM mixture against its merged experts, on the user's first test blocks."""
    from ondevice_moe.federation.device import eval_blocks

    recipe = user_model.recipe
    if not recipe.is_language_modelling:
        return None
    blocks = eval_blocks(user_model.job, recipe.user_names.index(user_model.user))[:GAP_BLOCKS]
    return mixture_gap(user_model.model, blocks, recipe.data.eval_batch_size)
