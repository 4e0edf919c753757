"""Dirichlet label-skew partitions of a labelled data set over federated clients.

Hermes §5.1 follows Lin et al. (2022) and Hsu et al. (2019): for every class
``k`` draw ``p_k ~ Dir(alpha * 1_clients)`` and give client ``j`` the share
``p_k[j]`` of class ``k``'s examples. A small ``alpha`` gives each client few
classes; a large one approaches an IID split.

The same proportions matrix splits the train and the test set
(:func:`dirichlet_partition` on train, then :func:`partition_by_proportions`
on test), so each client's test data has that client's label skew.

Flower's ``flwr-datasets`` ``DirichletPartitioner`` could not be used:
flwr-datasets 0.6.1 requires ``datasets<5`` while this project pins
``datasets==5.2.0`` (pip reports the conflict). The algorithm here follows the
same scheme (per-class Dirichlet over clients). Regression labels (STS-B
scores) are first put into equal-width bins with :func:`label_bins`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ondevice_moe.errors import UserError


def dirichlet_proportions(num_classes: int, num_clients: int, alpha: float, seed: int) -> np.ndarray:
    """A ``(num_classes, num_clients)`` matrix whose row ``k`` is a draw from ``Dir(alpha * 1_clients)``."""
    if num_classes < 1 or num_clients < 1:
        raise UserError(f"cannot partition {num_classes} classes over {num_clients} clients",
                        "use at least one class and one client")
    if not alpha > 0:
        raise UserError(f"Dirichlet alpha={alpha} is not positive", "use e.g. 0.1 (skewed) to 100 (near IID)")
    return np.random.default_rng(seed).dirichlet(np.full(num_clients, float(alpha)), size=num_classes)


def partition_by_proportions(labels: Sequence[int], proportions: np.ndarray, seed: int) -> list[list[int]]:
    """Example indices per client: each class's shuffled indices cut in chunks sized by its row of ``proportions``."""
    classes = np.asarray(labels, dtype=int)
    _check_classes(classes, proportions.shape[0])
    rng = np.random.default_rng(seed)
    clients: list[list[int]] = [[] for _ in range(proportions.shape[1])]
    for label, shares in enumerate(proportions):
        members = rng.permutation(np.flatnonzero(classes == label))
        cuts = np.round(np.cumsum(shares)[:-1] * len(members)).astype(int)
        for client, chunk in zip(clients, np.split(members, cuts), strict=True):
            client.extend(chunk.tolist())
    return [sorted(client) for client in clients]


def dirichlet_partition(
    labels: Sequence[int],
    num_clients: int,
    alpha: float,
    seed: int,
    min_examples: int = 2,
    max_tries: int = 100,
    held_out: Sequence[Sequence[int]] = (),
) -> tuple[list[list[int]], np.ndarray]:
    """Partition by Dirichlet proportions, redrawn (seed + try) until every client has ``min_examples``
    and, of each ``held_out`` split (the labels of a test or validation split that
    :func:`partition_by_proportions` deals with the same proportions and ``seed``), at least one. When
    no draw gives every client a held-out example, the first draw with ``min_examples`` is returned and
    :func:`check_dealt` names the empty split.

    Returns the example indices per client and the proportions matrix that made them.
    """
    needed = num_clients * min_examples
    first: tuple[list[list[int]], np.ndarray] | None = None
    if len(labels) >= needed:
        num_classes = int(max(labels)) + 1 if len(labels) else 1
        for attempt in range(max_tries):
            proportions = dirichlet_proportions(num_classes, num_clients, alpha, seed + attempt)
            clients = partition_by_proportions(labels, proportions, seed + attempt)
            if min(len(client) for client in clients) < min_examples:
                continue
            first = first or (clients, proportions)
            if all(min(map(len, partition_by_proportions(split, proportions, seed))) >= 1 for split in held_out):
                return clients, proportions
    if first is not None:
        return first
    raise UserError(
        f"could not give each of num_clients={num_clients} clients {min_examples} of the {len(labels)} examples "
        f"with Dirichlet alpha={alpha} in {max_tries} tries",
        "use fewer clients, more data, or a larger alpha",
    )


def check_dealt(parts: list[list[int]], total: int, alpha: float, split: str, more: str) -> None:
    """Every client needs examples to be scored on: its label proportions may give it none of a small split."""
    empty = [client for client, rows in enumerate(parts) if not rows]
    if empty:
        who = f"client {empty[0]}" if len(empty) == 1 else f"clients {', '.join(map(str, empty))}"
        raise UserError(
            f"{who} of {len(parts)} would get no {split} examples: the Dirichlet "
            f"(alpha={alpha}) label proportions deal the {total} {split} examples to the other clients",
            f"{more}, use fewer task.clients, or a larger task.dirichlet_alpha",
        )


def label_bins(values: Sequence[float], num_bins: int = 5) -> list[int]:
    """Equal-width bin indices over ``[min, max]`` of real-valued labels, so they can be Dirichlet-partitioned."""
    if num_bins < 1:
        raise UserError(f"num_bins={num_bins} is not positive", "use at least one bin")
    array = np.asarray(values, dtype=float)
    if array.size == 0:
        return []
    low, high = array.min(), array.max()
    if high == low:
        return [0] * array.size
    bins = np.floor((array - low) / (high - low) * num_bins).astype(int)
    return np.minimum(bins, num_bins - 1).tolist()


def _check_classes(classes: np.ndarray, num_classes: int) -> None:
    outside = np.flatnonzero((classes < 0) | (classes >= num_classes))
    if outside.size:
        index = int(outside[0])
        raise UserError(f"label {classes[index]} at index {index} is outside the {num_classes} partitioned classes",
                        f"use class indices in [0, {num_classes}), or proportions with a row per class")


__all__ = ["dirichlet_partition", "dirichlet_proportions", "label_bins", "partition_by_proportions"]
