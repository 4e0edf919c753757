"""Per-client classification data: a task's examples dealt to clients by a
Dirichlet label-skew partition (Hermes §5.1), tokenized once per process.

The same label proportions split the training and the test examples, so each
client is tested on data with its own label skew. With ``clusters`` = C,
client ``k`` belongs to cluster ``c = k mod C`` and sees every label ``y`` as
``(y + c) mod L`` in training and test: a concept shift (FLoRAL §6's label
shift, after Ghosh et al. 2020) that no single model fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ondevice_moe.data.partition import dirichlet_partition, label_bins, partition_by_proportions
from ondevice_moe.data.tasks import TaskSpec, get_task, load_task
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


@dataclass
class FederatedTask:
    task: TaskSpec
    train: list[ClientExamples]
    test: list[ClientExamples]


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
) -> FederatedTask:
    """Load a task, partition it over ``num_clients`` by Dirichlet(α) label skew, tokenize;
    with ``clusters``, shift the labels of cluster ``c = k mod clusters`` by ``c``."""
    task = get_task(name)
    train = load_task(name, "train", max_train_examples, seed)
    test = load_task(name, "test", max_test_examples, seed)
    train_classes = _classes(task, train.labels)
    parts, proportions = dirichlet_partition(train_classes, num_clients, alpha, seed)
    test_parts = partition_by_proportions(_classes(task, test.labels), proportions, seed)
    _check_test_parts(test_parts, len(test.labels), alpha)
    label_dtype = torch.float32 if task.is_regression else torch.long
    shifts = [client % clusters if clusters else 0 for client in range(num_clients)]
    return FederatedTask(
        task=task,
        train=[_shifted(_tokenize(train.texts, train.labels, rows, tokenizer, max_length, label_dtype), shift,
                        task.num_labels) for rows, shift in zip(parts, shifts, strict=True)],
        test=[_shifted(_tokenize(test.texts, test.labels, rows, tokenizer, max_length, label_dtype), shift,
                       task.num_labels) for rows, shift in zip(test_parts, shifts, strict=True)],
    )


def _shifted(examples: ClientExamples, shift: int, num_labels: int) -> ClientExamples:
    """The examples with every label ``y`` read as ``(y + shift) mod num_labels``."""
    if shift:
        examples.labels = (examples.labels + shift) % num_labels
    return examples


def _check_test_parts(parts: list[list[int]], total: int, alpha: float) -> None:
    """Every client needs test examples: its label proportions may give it none of a small test set."""
    empty = [client for client, rows in enumerate(parts) if not rows]
    if empty:
        who = f"client {empty[0]}" if len(empty) == 1 else f"clients {', '.join(map(str, empty))}"
        raise UserError(
            f"{who} of {len(parts)} would get no test examples: the Dirichlet "
            f"(alpha={alpha}) label proportions deal the {total} test examples to the other clients",
            "raise task.max_test_examples (or remove it), use fewer task.clients, or a larger task.dirichlet_alpha",
        )


def _classes(task: TaskSpec, labels: list[float]) -> list[int]:
    """Class indices to partition on; regression scores are binned (STS-B)."""
    return label_bins(labels) if task.is_regression else [int(label) for label in labels]


def _tokenize(texts, labels, rows, tokenizer, max_length: int, label_dtype) -> ClientExamples:
    columns = list(zip(*(texts[i] for i in rows), strict=True)) if rows else [[]]
    encoded = tokenizer(*columns, truncation=True, max_length=max_length, padding="max_length",
                        return_tensors="pt")
    return ClientExamples(encoded["input_ids"], encoded["attention_mask"],
                          torch.tensor([labels[i] for i in rows], dtype=label_dtype))
