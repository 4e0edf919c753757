"""Where a command writes (``inspect --to``, ``export --to``, ``eval --out``), checked before anything
is loaded: a destination that cannot be written fails at once, not after the model has loaded.

Only the standard library here, so the command line can check a destination before it imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from ondevice_moe.errors import UserError


def check_file_destination(path: Path, option: str, example: str) -> None:
    """``path`` must name a file (not a folder) in an existing folder this user can write;
    ``option`` is the flag that named it and ``example`` a file name to suggest."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {path} is a folder", f"name the file, e.g. {option} {path / example}")
    folder = path.parent
    if not folder.is_dir():
        raise UserError(f"folder {folder} does not exist", f"create it first, or choose another {option}")
    if not _writable(folder) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"cannot write {path}", f"choose a {option} in a folder you can write")


def check_folder_destination(folder: Path, option: str) -> None:
    """``folder`` must be a folder, or a path where one can be made: its nearest existing ancestor
    (or itself) a folder this user can write, with no file in the way."""
    folder = Path(folder)
    existing = folder.absolute()
    while not (existing.exists() or existing.is_symlink()):
        existing = existing.parent
    if not existing.is_dir():
        where = f"{option} {folder} is a file" if existing == folder.absolute() else \
            f"{option} {folder} lies under {existing}, a file"
        raise UserError(where, f"choose a folder for {option}")
    if not _writable(existing):
        raise UserError(f"cannot write in {existing}", f"choose a {option} in a folder you can write")


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


__all__ = ["check_file_destination", "check_folder_destination"]
