"""The user's own files through Hugging Face ``datasets`` (ondevice_moe/data/local_files.py): every
format gives the same rows, folders and globs read their files in name order, nothing is copied into
the Hugging Face cache, and every bad input is one message."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pandas as pd
import pytest

from ondevice_moe.data.local_files import ANY_FORMAT, find_data, read_columns
from ondevice_moe.errors import UserError

TEXTS = ["a plain sentence", 'commas, and "quotes"', "NA", "007", "two\nlines", "ünïcödé ✓", "None"]
ROWS = pd.DataFrame({"body": TEXTS, "id": range(len(TEXTS))})


def _texts(path: Path | str, column: str = "text", formats=ANY_FORMAT, split: str = "train") -> list[str]:
    """The texts of ``column`` at ``path``, as a source reads them."""
    return read_columns(find_data(path, "a test", formats), [column], split=split)[column]


def _write(kind: str, folder: Path) -> Path:
    """``TEXTS`` in column ``body`` (a text file per text for ``text``), written as ``kind``."""
    writers = {
        "csv": lambda path: ROWS.to_csv(path, index=False),
        "tsv": lambda path: ROWS.to_csv(path, sep="\t", index=False),
        "jsonl": lambda path: ROWS.to_json(path, orient="records", lines=True, force_ascii=False),
        "json": lambda path: path.write_text(json.dumps(ROWS.to_dict("records")), encoding="utf-8"),
        "parquet": lambda path: ROWS.to_parquet(path),
        "saved": lambda path: datasets.Dataset.from_pandas(ROWS).save_to_disk(str(path)),
        "saved-dict": lambda path: datasets.DatasetDict(
            {"train": datasets.Dataset.from_dict({"body": ["not these"]}), "mine": datasets.Dataset.from_pandas(ROWS)}
        ).save_to_disk(str(path)),
    }
    if kind == "text":
        for index, text in enumerate(TEXTS):
            (folder / f"{index:02}.txt").write_text(text, encoding="utf-8")
        return folder
    path = folder / f"data.{kind}"
    writers[kind](path)
    return path


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl", "json", "parquet", "saved", "saved-dict", "text"])
def test_every_format_reads_the_same_rows(tmp_path, kind):
    path = _write(kind, tmp_path)
    split = "mine" if kind == "saved-dict" else "train"
    assert _texts(path, "text" if kind == "text" else "body", split=split) == TEXTS


def test_folders_and_globs_read_their_files_in_name_order(tmp_path):
    folder = tmp_path / "shards"
    (folder / "later").mkdir(parents=True)
    for name, text in (("b[1].jsonl", "second"), ("a.jsonl", "first"), ("later/c.jsonl", "third")):
        (folder / name).write_text(json.dumps({"text": text}) + "\n")
    (folder / ".hidden.jsonl").write_text('{"text": "hidden"}\n')
    (folder / "notes.xlsx").write_bytes(b"not data")  # an unknown kind of file in a folder is left out
    (folder / "empty.jsonl").write_text("")
    assert _texts(folder) == ["first", "second", "third"]
    assert _texts(folder / "*.jsonl") == ["first", "second"]
    assert _texts(folder / "b[1].jsonl") == ["second"]


def test_a_reader_held_to_one_format(tmp_path):
    (tmp_path / "a.txt").write_text("a text file")
    (tmp_path / "b.md").write_text("a markdown file")
    ROWS.to_csv(tmp_path / "table.csv", index=False)  # not text: a folder read as text leaves it out
    assert _texts(tmp_path, formats={"text"}) == ["a text file", "a markdown file"]
    lines = tmp_path / "records.log"  # a file of unknown extension is read in the one format allowed
    lines.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert _texts(lines, formats={"json"}) == ["one", "two"]
    with pytest.raises(UserError, match=r"records\.log is not a data file"):
        _texts(lines)


def test_files_are_read_where_they_lie(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    assert _texts(_write("csv", tmp_path), "body") == TEXTS
    assert not cache.exists() or list(cache.rglob("*")) == []


def _bad_inputs(tmp_path: Path) -> list[tuple[dict, str]]:
    """(path, column and split, the message expected) for each kind of bad input."""
    csv = _write("csv", tmp_path)
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "header.csv").write_text("body,id\n")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    (tmp_path / "data.xlsx").write_bytes(b"PK\x03\x04")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "holes.jsonl").write_text('{"body": "fine"}\n{"body": null}\n{"body": 7}\n')
    (tmp_path / "numbers.jsonl").write_text('{"body": 7}\n')
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.csv").write_text("body\nx\n")
    (mixed / "b.jsonl").write_text('{"body": "y"}\n')
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "1.jsonl").write_text('{"body": "fine"}\n')
    (shards / "2.jsonl").write_text('{"body": "fine"}\n{"body": null}\n')
    saved = _write("saved-dict", tmp_path / "dict")
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    (crafted / "dataset_dict.json").write_text("{not json")
    return [
        ({"path": str(tmp_path / "missing.csv")}, r"missing\.csv does not exist"),
        ({"path": str(tmp_path / "empty.csv")}, r"empty\.csv is empty"),
        ({"path": str(tmp_path / "header.csv"), "text_field": "body"}, r"header\.csv holds no rows"),
        ({"path": str(csv)}, r"data\.csv has no column \['text'\]; its columns are \['body', 'id'\]"),
        ({"path": str(tmp_path / "broken.parquet")}, r"cannot read .*broken\.parquet as Parquet \(ArrowInvalid: "),
        ({"path": str(tmp_path / "data.xlsx")}, r"data\.xlsx is not a data file"),
        ({"path": str(tmp_path / "latin1.txt")}, r"cannot read .*latin1\.txt as UTF-8 text \(UnicodeDecodeError"),
        ({"path": str(tmp_path / "holes.jsonl"), "text_field": "body"}, r"holes\.jsonl, row 2: 'body' is null, not"),
        ({"path": str(tmp_path / "numbers.jsonl"), "text_field": "body"}, r"row 1: 'body' is a number, not text"),
        ({"path": str(mixed)}, r"holds files of 2 formats \(csv, json\)"),
        ({"path": str(tmp_path / "nothing" / "*.csv")}, r"the glob .*\*\.csv matches no file"),
        ({"path": str(shards), "text_field": "body"}, r"shards/2\.jsonl, row 2: 'body' is null"),
        ({"path": str(saved), "split": "valid"}, r"has no split 'valid' \(it has \['train', 'mine'\]\)"),
        ({"path": str(crafted)}, r"cannot read .*crafted as a dataset saved by `datasets` \(JSONDecodeError"),
        ({"path": ""}, r"a test needs `path`"),
    ]


def test_each_bad_input_is_one_message_with_a_fix(tmp_path):
    for options, expected in _bad_inputs(tmp_path):
        with pytest.raises(UserError, match=expected) as raised:
            _texts(options["path"], options.get("text_field", "text"), split=options.get("split", "train"))
        assert raised.value.fix, expected
