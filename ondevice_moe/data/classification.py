"""Per-client classification data: a task's examples dealt to clients by a
Dirichlet label-skew partition (Hermes §5.1), or the user's own files, one per
client; tokenized once per process.

The same label proportions split the training and the test examples, so each
client is tested on data with its own label skew; a client reading its own
file is tested on that file's held-out rows. With ``valid_examples`` a
validation split is held out of the task's training split
(:func:`~ondevice_moe.data.tasks.load_train_and_valid`) and dealt by the
same proportions: a learning rate is chosen on it, never on the test split. With ``clusters`` = C,
client ``k`` belongs to cluster ``c = k mod C`` and sees every label ``y`` as
``(y + c) mod L`` in training and test: a concept shift (FLoRAL §6's label
shift, after Ghosh et al. 2020) that no single model fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ondevice_moe.data.partition import check_dealt, dirichlet_partition, label_bins, partition_by_proportions
from ondevice_moe.data.tasks import (
    LabelledExamples,
    TaskSpec,
    get_task,
    load_client_tasks,
    load_client_train_and_valid,
    load_task,
    load_train_and_valid,
)
from ondevice_moe.errors import UserError


@dataclass
class ClientExamples:
    """One client's tokenized examples: ``input_ids``/``attention_mask`` (N × L) and ``labels`` (N)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows, cut to the longest of them (padding is on the right)."""
        mask = self.attention_mask[rows]
        length = max(int(mask.sum(dim=1).max()), 1) if len(rows) else 1
        return {"input_ids": self.input_ids[rows, :length], "attention_mask": mask[:, :length],
                "labels": self.labels[rows]}


# Each client's train, test and validation examples (no validation split: None).
ClientSplits = tuple[list[LabelledExamples], list[LabelledExamples], list[LabelledExamples] | None]


@dataclass
class FederatedTask:
    """A task dealt to clients: each client's ``train`` and ``test`` examples, and ``valid`` ones
    where the task holds a validation split out of its training split."""

    task: TaskSpec
    train: list[ClientExamples]
    test: list[ClientExamples]
    valid: list[ClientExamples] | None = None


def build_federated_task(
    name: str | TaskSpec,
    num_clients: int,
    alpha: float,
    tokenizer,
    max_length: int,
    seed: int,
    max_train_examples: int | None = None,
    max_test_examples: int | None = None,
    clusters: int | None = None,
    valid_examples: int | None = None,
) -> FederatedTask:
    """Load a task and deal it to ``num_clients``: client ``k`` reads file ``k`` of a task read one
    file per client, else a Dirichlet(α) label-skew partition; tokenize; with ``clusters``, shift the
    labels of cluster ``c = k mod clusters`` by ``c``. ``max_*_examples`` cap the task's split, or
    each client's under one file per client; ``valid_examples`` holds that many out of the training
    split as a validation split (each client's, under one file per client)."""
    task = get_task(name)
    train, test, valid = deal_task(task, num_clients, alpha, seed, max_train_examples, max_test_examples,
                                   valid_examples)
    label_dtype = torch.float32 if task.is_regression else torch.long
    shifts = [client % clusters if clusters else 0 for client in range(num_clients)]

    def prepared(split: list[LabelledExamples]) -> list[ClientExamples]:
        return [_shifted(_tokenize(examples, tokenizer, max_length, label_dtype), shift, task.num_labels)
                for examples, shift in zip(split, shifts, strict=True)]

    return FederatedTask(task=task, train=prepared(train), test=prepared(test),
                         valid=None if valid is None else prepared(valid))


def deal_task(task: TaskSpec, num_clients: int, alpha: float, seed: int, max_train_examples: int | None = None,
              max_test_examples: int | None = None, valid_examples: int | None = None) -> ClientSplits:
    """Each client's train, test (and validation) examples, untokenized: one file per client, or a
    Dirichlet(α) label-skew partition (what :func:`build_federated_task` tokenizes)."""
    if task.file is not None and task.file.client_files:
        return _one_file_per_client(task, num_clients, seed, max_train_examples, max_test_examples, valid_examples)
    return _dirichlet_clients(task, num_clients, alpha, seed, max_train_examples, max_test_examples, valid_examples)


def _dirichlet_clients(task: TaskSpec, num_clients: int, alpha: float, seed: int, max_train_examples: int | None,
                       max_test_examples: int | None, valid_examples: int | None) -> ClientSplits:
    """Each client's train, test (and validation) examples, dealt by the same Dirichlet(α) label proportions."""
    if valid_examples is None:
        train, valid = load_task(task, "train", max_train_examples, seed), None
    else:
        train, valid = load_train_and_valid(task, max_train_examples, valid_examples, seed)
    test = load_task(task, "test", max_test_examples, seed)
    held_out = [_classes(task, split.labels) for split in (test, valid) if split is not None]
    parts, proportions = dirichlet_partition(_classes(task, train.labels), num_clients, alpha, seed, held_out=held_out)
    test_parts = partition_by_proportions(_classes(task, test.labels), proportions, seed)
    check_dealt(test_parts, len(test.labels), alpha, "test", "raise task.max_test_examples (or remove it)")
    valid_parts = None
    if valid is not None:
        valid_parts = partition_by_proportions(_classes(task, valid.labels), proportions, seed)
        check_dealt(valid_parts, len(valid.labels), alpha, "validation", "raise task.valid_examples")
    return ([_rows(train, rows) for rows in parts], [_rows(test, rows) for rows in test_parts],
            None if valid is None else [_rows(valid, rows) for rows in valid_parts])


def _one_file_per_client(task: TaskSpec, num_clients: int, seed: int, max_train_examples: int | None,
                         max_test_examples: int | None, valid_examples: int | None) -> ClientSplits:
    """Each client's train, test (and validation) examples: client ``k``'s are file ``k``'s rows."""
    files = task.file.client_files
    if num_clients != len(files):
        raise UserError(f"task '{task.name}' has {num_clients} clients and {len(files)} files, one per client",
                        "give as many clients as files (task.clients may be left out), or name one file per client")
    test = load_client_tasks(task, "test", max_test_examples, seed)
    if valid_examples is None:
        return load_client_tasks(task, "train", max_train_examples, seed), test, None
    held = load_client_train_and_valid(task, max_train_examples, valid_examples, seed)
    return [train for train, _ in held], test, [valid for _, valid in held]


def _rows(examples: LabelledExamples, rows: list[int]) -> LabelledExamples:
    return LabelledExamples([examples.texts[i] for i in rows], [examples.labels[i] for i in rows])


def _shifted(examples: ClientExamples, shift: int, num_labels: int) -> ClientExamples:
    """The examples with every label ``y`` read as ``(y + shift) mod num_labels``."""
    if shift:
        examples.labels = (examples.labels + shift) % num_labels
    return examples


def _classes(task: TaskSpec, labels: list[float]) -> list[int]:
    """Class indices to partition on; regression scores are binned (STS-B)."""
    return label_bins(labels) if task.is_regression else [int(label) for label in labels]


def _tokenize(examples: LabelledExamples, tokenizer, max_length: int, label_dtype) -> ClientExamples:
    columns = list(zip(*examples.texts, strict=True)) if examples.texts else [[]]
    encoded = tokenizer(*columns, truncation=True, max_length=max_length, padding="max_length",
                        return_tensors="pt")
    return ClientExamples(encoded["input_ids"], encoded["attention_mask"],
                          torch.tensor(examples.labels, dtype=label_dtype))
