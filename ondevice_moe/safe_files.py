"""Files the toolkit writes, never through a link someone planted.

A run folder, a device's state folder and an export folder may hold links a user or an attacker put
there (``report.md`` → ``~/.bashrc``). Every file the toolkit writes is first written to a new
temporary file in the same folder (created exclusively, without following a link) and then renamed
over its name: the rename replaces a link planted there and never writes where it points, and a
reader never sees half a file. A folder the toolkit writes into (``plots/``, ``checkpoints/<method>``)
is refused when it is a link. A full disk is the caller's ``OSError``, with nothing half-written left
behind.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ondevice_moe.errors import UserError


def plain_folder(folder: Path) -> Path:
    """``folder``, created if need be; a link in its place (or in place of a folder above it, up to
    the first one that exists) is a :class:`UserError`."""
    missing = []
    current = Path(folder)
    while not current.exists() and not current.is_symlink():
        missing.append(current)
        current = current.parent
    for path in [folder, *[path.parent for path in missing]]:
        if Path(path).is_symlink():
            raise UserError(f"{path} is a link, and the toolkit does not write through links",
                            f"remove the link {path} (it points to {os.readlink(path)}), or choose another folder")
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder)


def write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole, replacing a file or link of that name, never writing through a link."""
    path = Path(path)
    plain_folder(path.parent)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        raise


def write_text(path: Path, text: str) -> None:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def append_handle(path: Path):
    """``path`` opened to append text, created if missing; a link in its place is refused (``OSError``)."""
    handle = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(handle, "a", encoding="utf-8")


def save_tensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written by :func:`write_bytes`."""
    from safetensors.torch import save

    write_bytes(path, save(tensors, metadata=metadata))
