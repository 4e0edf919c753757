"""The user's own data files, read through Hugging Face ``datasets`` where they lie.

A path is a file, a glob (``data/*.csv``) or a folder. A folder written by
``save_to_disk`` is read with ``load_from_disk`` (a ``DatasetDict`` by one of
its splits); any other folder stands for the data files below it (hidden and
empty files skipped), which must share one format. The format follows the
extension:

* ``.csv`` / ``.tsv``: ``load_dataset("csv")``, a header row, every cell read as the text it is
  (no guessed numbers, no ``NA`` turned into a missing value);
* ``.json`` / ``.jsonl``: ``load_dataset("json")``, JSON lines or one JSON array of objects;
* ``.parquet``: ``load_dataset("parquet")``;
* ``.txt`` / ``.md``: ``load_dataset("text", sample_by="document")``, one row per file, column ``text``.

Files are streamed (``streaming=True``) where they lie: nothing is written to the
Hugging Face cache and nothing is downloaded. Every problem (a missing or empty file, an
unknown column, a corrupt file, a missing text) is one :class:`UserError` naming
the file, and the row where there is one.
"""

from __future__ import annotations

import glob
import tempfile
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

from ondevice_moe.errors import UserError

FORMATS: dict[str, str] = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "json",
                           ".parquet": "parquet", ".txt": "text", ".md": "text"}
SAVED = "saved"  # a folder written by ``save_to_disk``
_FORMAT_NAMES = {"csv": "CSV", "tsv": "TSV", "json": "JSON", "parquet": "Parquet", "text": "UTF-8 text",
                 SAVED: "a dataset saved by `datasets`"}
ANY_FORMAT = frozenset({*FORMATS.values(), SAVED})

_BUILDERS: dict[str, tuple[str, dict[str, object]]] = {
    "csv": ("csv", {"na_filter": False, "index_col": False}),
    "tsv": ("csv", {"sep": "\t", "na_filter": False, "index_col": False}),
    "json": ("json", {"parse_agent_traces": False}),
    "parquet": ("parquet", {}),
    "text": ("text", {"sample_by": "document"}),
}
_BATCH_ROWS = 1024
_GLOB_CHARACTERS = frozenset("*?[")
_VALUE_KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", list: "a list",
                dict: "an object"}


@dataclass(frozen=True)
class DataFiles:
    """What a path points at: ``files`` of one ``format``, or (``format`` ``saved``) the folder
    ``where``, written by ``save_to_disk``."""

    where: Path
    format: str
    files: tuple[Path, ...] = ()

    @property
    def name(self) -> str:
        """How messages name the data: the folder or file, or the files found under the path."""
        if self.format == SAVED:
            return str(self.where)
        if len(self.files) == 1:
            return str(self.files[0])
        return f"the {len(self.files)} {self.format} files of {self.where}"


def find_data(path: str | Path | None, what: str, formats: Collection[str] = ANY_FORMAT) -> DataFiles:
    """The data at ``path`` (a file, a glob or a folder) in one of ``formats``; ``what`` names the
    recipe entry in messages. Where ``formats`` is one format, a file of an unknown extension is read
    in it (the ``jsonl`` source reads any file as JSON lines)."""
    if not path:
        raise UserError(f"{what} needs `path`", "set `path` to a file, a glob or a folder on this machine")
    given = Path(path).expanduser()
    if given.is_dir():
        if SAVED in formats and is_saved_dataset(given):
            return DataFiles(given, SAVED)
        found = [file for file in sorted(given.rglob("*")) if _is_visible_data(file, given)]
        return _one_format(given, found, what, formats, in_folder=True)
    if given.exists():
        if not given.is_file():  # a FIFO, socket or device would block or never end
            raise UserError(f"{what}: {given} is not a regular file or folder", "point it at your data file")
        if given.stat().st_size == 0:
            raise UserError(f"{what}: {given} is empty", "give it your data, or point `path` at another file")
        return _one_format(given, [given], what, formats, in_folder=False)
    if not _GLOB_CHARACTERS & set(str(given)):
        raise UserError(f"{what}: {given} does not exist",
                        "check the path in the recipe (relative to where you run the command)")
    matches = [Path(name) for name in sorted(glob.glob(str(given), recursive=True))]
    found = [file for file in matches if file.is_file() and file.stat().st_size > 0]
    if not found:
        raise UserError(f"{what}: the glob {given} matches no file with data",
                        "check the pattern in the recipe (relative to where you run the command)")
    return _one_format(given, found, what, formats, in_folder=False)


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` was written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``)."""
    return (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()


def read_columns(data: DataFiles, text_columns: Sequence[str], other_columns: Sequence[str] = (),
                 column_fix: str = "name columns the data has", split: str = "train") -> dict[str, list]:
    """Every row's values of ``text_columns`` (each must be a string) and ``other_columns``, in file
    order. ``split`` picks the split of a saved ``DatasetDict``; ``column_fix`` is the fix offered
    for a missing column."""
    try:
        with _quiet_datasets():
            return _read(data, text_columns, other_columns, column_fix, split)
    except UserError:
        if len(data.files) > 1:  # read them one at a time, to name the file at fault
            for file in data.files:
                read_columns(DataFiles(file, data.format, (file,)), text_columns, other_columns, column_fix)
        raise


def _read(data: DataFiles, text_columns: Sequence[str], other_columns: Sequence[str], column_fix: str,
          split: str) -> dict[str, list]:
    columns = [*text_columns, *other_columns]
    batches = _batches(data, split)
    first = next(batches, None)
    if first is None:
        raise UserError(f"{data.name} holds no rows", "give it at least one row of data (under a header row)")
    missing = [column for column in columns if column not in first]
    if missing:
        raise UserError(f"{data.name} has no column {missing}; its columns are {list(first)}", column_fix)
    # CSV is read again, its needed columns as the text they hold, now that they are known to be there
    rows = _batches(data, split, text_cells=columns) if data.format in ("csv", "tsv") else chain([first], batches)
    values: dict[str, list] = {column: [] for column in columns}
    for batch in rows:
        for column in columns:
            values[column].extend(batch[column])
    for column in text_columns:
        _check_texts(values[column], column, data.name)
    return values


def _batches(data: DataFiles, split: str, text_cells: Sequence[str] = ()) -> Iterator[dict[str, list]]:
    """The rows, in batches of columns; any failure of ``datasets`` to read them is one UserError.
    ``text_cells``: CSV columns to read as the text they hold."""
    try:
        with _opened(data, split, text_cells) as dataset:
            yield from dataset.iter(batch_size=_BATCH_ROWS)
    except UserError:
        raise
    except Exception as error:  # pandas, pyarrow and datasets raise many types; all mean "cannot read it"
        kind = _FORMAT_NAMES[data.format]
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if data.format == SAVED:
            fix = "write it again with `save_to_disk`, or point `path` at your data files"
        elif len(data.files) == 1:
            fix = f"check that it is valid {kind}"
        else:
            fix = f"check that each file is valid {kind}, with the same columns as the others"
        raise UserError(f"cannot read {data.name} as {kind} ({reason})", fix) from None


@contextmanager
def _opened(data: DataFiles, split: str, text_cells: Sequence[str]) -> Iterator[Any]:
    """The data as a ``datasets`` ``Dataset`` (a saved folder, memory-mapped) or ``IterableDataset``
    (files, streamed; its builder's lock file goes to a scratch folder, not the Hugging Face cache)."""
    import datasets
    from datasets.data_files import DataFilesList

    if data.format == SAVED:
        yield _saved_split(datasets.load_from_disk(str(data.where)), data.where, split)
        return
    builder, options = _BUILDERS[data.format]
    if text_cells:
        options = {**options, "features": datasets.Features({c: datasets.Value("string") for c in text_cells})}
    # The files as found, taken literally: datasets would glob each name again (slow for thousands of
    # files, and wrong for a name holding [ or *). Streaming caches nothing their metadata would key.
    files = DataFilesList([str(file.resolve()) for file in data.files], [()] * len(data.files))
    with tempfile.TemporaryDirectory(prefix="ondevice-moe-") as scratch:
        yield datasets.load_dataset(builder, data_files={"train": files}, split="train", streaming=True,
                                    cache_dir=scratch, **options)


def _saved_split(dataset, folder: Path, split: str):
    """A saved ``Dataset`` as it is, or the split ``split`` of a saved ``DatasetDict``."""
    from datasets import DatasetDict

    if not isinstance(dataset, DatasetDict):
        return dataset
    if split not in dataset:
        raise UserError(f"the saved dataset {folder} has no split '{split}' (it has {list(dataset)})",
                        "set `split` to one of them, or save the split to use as 'train'")
    return dataset[split]


def _check_texts(values: list, column: str, where: str) -> None:
    for row, value in enumerate(values, start=1):
        if not isinstance(value, str):
            kind = _VALUE_KINDS.get(type(value), type(value).__name__)
            raise UserError(f"{where}, row {row}: '{column}' is {kind}, not text",
                            "give every row text in that column, or drop the row")


def _is_visible_data(file: Path, root: Path) -> bool:
    hidden = any(part.startswith(".") for part in file.relative_to(root).parts)
    return not hidden and file.is_file() and file.stat().st_size > 0


def _one_format(where: Path, files: list[Path], what: str, formats: Collection[str], in_folder: bool) -> DataFiles:
    """``files`` as data of one format among ``formats``. In a folder, files of other kinds are left
    out; a file named on its own (or by a glob) must be data."""
    forced = next(iter(formats)) if len(formats) == 1 and not in_folder and SAVED not in formats else None
    kinds = {file: FORMATS.get(file.suffix.lower(), forced) for file in files}
    unknown = [file for file, kind in kinds.items() if kind is None]
    if unknown and not in_folder:
        raise UserError(f"{what}: {unknown[0]} is not a data file (its extension is none of {', '.join(FORMATS)})",
                        "give a file of one of these kinds, or leave it out of the glob")
    kept = {file: kind for file, kind in kinds.items() if kind in formats}
    found = sorted(set(kept.values()))
    if not found:
        suffixes = [suffix for suffix, kind in FORMATS.items() if kind in formats]
        kinds = [f"{' or '.join(suffixes)} files"] if suffixes else []
        kinds += ["folder written by `save_to_disk`"] if SAVED in formats else []
        raise UserError(f"{what}: found no {' or '.join(kinds)} at {where}", "point `path` at your data")
    if len(found) > 1:
        example = next(file for file, kind in kept.items() if kind == found[0])
        raise UserError(f"{what}: {where} holds files of {len(found)} formats ({', '.join(found)})",
                        f"keep one format, or point `path` at one with a glob, e.g. {where / '*'}{example.suffix}")
    return DataFiles(where, found[0], tuple(kept))


@contextmanager
def _quiet_datasets() -> Iterator[None]:
    """``datasets`` logs each read failure before raising it; the UserError says it once."""
    from datasets.utils import logging as datasets_logging

    level = datasets_logging.get_verbosity()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(level)


__all__ = ["ANY_FORMAT", "FORMATS", "SAVED", "DataFiles", "find_data", "is_saved_dataset", "read_columns"]
