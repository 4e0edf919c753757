"""Per-client data of the small tasks, generated from a seed: float inputs, no tokenizer.

* ``floral-linear`` / ``floral-mlp`` — FLoRAL App. G: client ``k`` of cluster
  ``c = k mod C`` (the paper's diagonal router ``π^k_c = δ_{(k mod C) c}``)
  regresses ``y = (W + α U_c V_cᵀ) x`` (eq. 9 / 43) or
  ``y = Φ ((W + U_c V_cᵀ) x)_+`` (eq. 44), ``x ~ N(0, I)``, every weight drawn
  element-wise from ``N(0, 1/d_in)`` (``d_in``: the input size of its layer;
  App. G.1 writes ``N(0, 1/√d_in)``, which we read as the standard deviation
  ``1/√d_in``). Each client holds ``N^k ≈ 0.25 d`` (linear, ``d = d_y d_x``)
  or ``0.5 d`` (MLP, ``d = d_h d_x + d_y d_h``) training examples.
  The paper gives no sizes: we use ``d_x = d_y = d_h = 10``, and the rank
  ``r = 1`` and ``α = 2`` of the authors' code (zeligism/FLoRAL
  ``conf/task/synthetic_linear.yaml``: ``rank: 1``, ``uv_constant: 2.0``),
  whose outputs are ``d_y = 3`` (linear) and 1 (MLP) and whose hidden layer
  has a bias; eq. (44) has no ``α``, and neither has our MLP task.
* ``fedsoft-10-90`` / ``-30-70`` / ``-linear`` / ``-random`` — FedSoft §5:
  sources ``y = ⟨x, θ_s⟩ + ε`` with ``θ_s ~ N(0, σ₀² I_10)``, ``σ₀ = 10``,
  ``x ~ N(0, I_10)``, ``ε ~ N(0, 1)``; client ``k`` holds ``n_k ~ U{100..200}``
  examples mixed from the sources: half the clients 10:90 and half 90:10
  (or 30:70), ``(k + 0.5)/K`` from source A (linear, the paper's ``(0.5 + k) %``
  for K = 100), or ``S`` shares cut at ``S − 1`` uniform points (random).
* ``digits-*`` — scikit-learn's 1,797 8×8 digits (grey levels / 16), the
  fixed 80 / 20 split of :func:`~ondevice_moe.data.tasks.fixed_split`, each
  split dealt evenly to the clients; client ``k``'s cluster ``c = k mod C``
  rotates its images by 90°·c (``numpy.rot90``) and/or shifts its labels to
  ``(y + c) mod 10`` (FLoRAL §6, after Ghosh et al. 2020); ``digits-dirichlet``
  deals them by Dirichlet(α) label skew instead (:mod:`ondevice_moe.data.partition`).
  ``digits-rotate-10-90`` / ``-30-70`` are FedSoft's rotated mixtures: two sources,
  upright and turned by 90°, each client holding both in its partition's shares.
  ``data_fraction = 0.05`` is FLoRAL's *Reduced* variant: each client keeps 5 %
  of its training examples, at least 10.

Every client also has a test set from its own distribution; ``cluster_test``
holds one test set per cluster or source, on which FedSoft scores its cluster
models (and FLoRAL its optimal routing). With ``valid_examples`` the digits
tasks hold that many of the 80 % training images out (a seeded draw) as a
validation split, dealt to the clients as the training and test images are,
for choosing a setting without the test split; the synthetic tasks, whose
examples a generating model draws, have none (choose on another ``data_seed``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ondevice_moe.data.partition import check_dealt, dirichlet_partition, partition_by_proportions
from ondevice_moe.data.tasks import TASKS, TaskSpec, fixed_split, get_task
from ondevice_moe.errors import UserError

FLORAL_DIMS = {"x": 10, "y": 10, "hidden": 10, "rank": 1}
FLORAL_ALPHA = 2.0
FEDSOFT_SIGMA0 = 10.0
FEDSOFT_SIZES = (100, 200)
REDUCED_MINIMUM = 10
VALID_DRAW = 2       # the validation draw's stream beside the split seed
CLUSTER_TEST_EXAMPLES = 500
SMALL_TASKS = tuple(name for name, task in TASKS.items() if not task.is_text)


@dataclass
class TensorExamples:
    """One client's examples: float ``inputs`` (N × input shape) and ``labels`` (N class indices, or N × outputs)."""

    inputs: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows as model keyword arguments ``inputs`` and ``labels``."""
        return {"inputs": self.inputs[rows], "labels": self.labels[rows]}


@dataclass
class SmallFederatedTask:
    """A small task dealt to clients.

    ``mixtures[k, c]``: client ``k``'s share of cluster (or source) ``c``,
    one-hot for hard clusters; ``None`` without ground-truth clusters.
    ``cluster_test[c]``: held-out examples of cluster ``c`` alone.
    ``valid``: each client's validation examples, where the task holds them.
    """

    task: TaskSpec
    train: list[TensorExamples]
    test: list[TensorExamples]
    mixtures: np.ndarray | None
    cluster_test: list[TensorExamples]
    valid: list[TensorExamples] | None = None


def build_small_task(
    name: str,
    clients: int | None = None,
    seed: int = 0,
    clusters: int | None = None,
    alpha: float = 1.0,
    data_fraction: float = 1.0,
    valid_examples: int | None = None,
) -> SmallFederatedTask:
    """The small task ``name`` over ``clients`` (default: the paper's K) with ``clusters`` (default: C).

    ``alpha`` is the Dirichlet concentration of ``digits-dirichlet``;
    ``data_fraction`` keeps that share of each client's training examples
    (at least 10; 0.05 = FLoRAL's Reduced variant); ``valid_examples`` holds that
    many training images of a digits task out as a validation split. The same
    arguments give the same data.
    """
    task = get_task(name)
    clients, clusters = check_small_options(task, clients, clusters, data_fraction, valid_examples)
    rng = np.random.default_rng(seed)
    builder = _BUILDERS.get(name) or _BUILDERS[name.split("-", 1)[0]]
    built = builder(task, clients, clusters, rng, alpha, seed, valid_examples)
    if data_fraction < 1:
        built.train = [_reduced(examples, data_fraction, rng) for examples in built.train]
    return built


DIGITS_IMAGES = 1797  # scikit-learn's 8x8 digits
MIN_DIGITS_PER_CLIENT = 4  # a training and a test image at the least, with room for a skewed split


def check_small_options(task: TaskSpec, clients: int | None, clusters: int | None, data_fraction: float = 1.0,
                        valid_examples: int | None = None) -> tuple[int, int | None]:
    """``(clients, clusters)`` with the paper's defaults filled in; :class:`UserError` for what the task cannot do."""
    if task.is_text:
        raise UserError(f"task '{task.name}' is a text task, not a small task",
                        f"use one of {', '.join(SMALL_TASKS)}")
    if valid_examples is not None and not task.name.startswith("digits"):
        raise UserError(f"task '{task.name}' draws its examples from a generating model and holds no validation "
                        "split (task.valid_examples)",
                        "drop task.valid_examples, and choose a setting on data of another data_seed")
    clients = task.clients if clients is None else clients
    if task.clusters is None:
        if clusters is not None:
            raise UserError(f"task '{task.name}' has no clusters (clusters={clusters})", "leave `clusters` out")
    else:
        clusters = task.clusters if clusters is None else clusters
        most = _MAX_CLUSTERS.get(task.name, clients)
        fixed = task.name in TWO_SOURCE_TASKS
        if (fixed and clusters != 2) or not 1 <= clusters <= most:
            allowed = "exactly 2 sources (only fedsoft-random mixes more)" if fixed else f"1 to {most} clusters"
            raise UserError(f"task '{task.name}' with {clients} clients cannot have clusters={clusters}",
                            f"use {allowed}")
    if clients < 1 or not 0 < data_fraction <= 1:
        raise UserError(f"task '{task.name}': clients={clients}, data_fraction={data_fraction}",
                        "use at least one client and a data fraction in (0, 1]")
    if task.name.startswith("digits") and clients > DIGITS_IMAGES // MIN_DIGITS_PER_CLIENT:
        raise UserError(f"task '{task.name}' deals {DIGITS_IMAGES} images to {clients} clients: some would hold "
                        f"fewer than {MIN_DIGITS_PER_CLIENT} (train and test)",
                        f"use at most {DIGITS_IMAGES // MIN_DIGITS_PER_CLIENT} clients")
    return clients, clusters


# -- FLoRAL App. G -----------------------------------------------------------------------------------------------


def floral_synthetic(task: TaskSpec, clients: int, clusters: int, rng: np.random.Generator, *_) -> SmallFederatedTask:
    """FLoRAL eq. (9) / (43) (``floral-linear``) and eq. (44) (``floral-mlp``) with the diagonal router."""
    mlp = task.name == "floral-mlp"
    d_x, d_y, rank = FLORAL_DIMS["x"], FLORAL_DIMS["y"], FLORAL_DIMS["rank"]
    d_out = FLORAL_DIMS["hidden"] if mlp else d_y
    base = _normal(rng, (d_out, d_x), d_x)
    ups = [_normal(rng, (d_out, rank), rank) for _ in range(clusters)]
    downs = [_normal(rng, (d_x, rank), d_x) for _ in range(clusters)]
    scale = 1.0 if mlp else FLORAL_ALPHA  # eq. (44) has no α
    weights = [base + scale * up @ down.T for up, down in zip(ups, downs, strict=True)]
    phi = _normal(rng, (d_y, d_out), d_out) if mlp else None
    size = d_out * d_x + (d_y * d_out if mlp else 0)
    per_client = round((0.5 if mlp else 0.25) * size)

    def draw(cluster: int, count: int) -> TensorExamples:
        inputs = rng.standard_normal((count, d_x))
        outputs = inputs @ weights[cluster].T
        if phi is not None:
            outputs = np.maximum(outputs, 0.0) @ phi.T
        return _tensors(inputs, outputs)

    membership = [k % clusters for k in range(clients)]
    return SmallFederatedTask(
        task,
        train=[draw(c, per_client) for c in membership],
        test=[draw(c, per_client) for c in membership],
        mixtures=_one_hot(membership, clusters),
        cluster_test=[draw(c, CLUSTER_TEST_EXAMPLES) for c in range(clusters)],
    )


# -- FedSoft §5 --------------------------------------------------------------------------------------------------


def fedsoft_synthetic(task: TaskSpec, clients: int, sources: int, rng: np.random.Generator, *_
                      ) -> SmallFederatedTask:
    """FedSoft §5 linear-regression sources mixed per client by the task's partition pattern."""
    dim = task.input_shape[0]
    thetas = rng.normal(0.0, FEDSOFT_SIGMA0, (sources, dim))
    mixtures = fedsoft_mixtures(task.name.removeprefix("fedsoft-"), clients, sources, rng)

    def draw(shares: np.ndarray, count: int) -> TensorExamples:
        source = np.repeat(np.arange(sources), mixture_counts(shares, count))
        inputs = rng.standard_normal((count, dim))
        outputs = np.einsum("nd,nd->n", inputs, thetas[source]) + rng.standard_normal(count)
        return _tensors(inputs, outputs[:, None])

    sizes = rng.integers(FEDSOFT_SIZES[0], FEDSOFT_SIZES[1], size=clients, endpoint=True)
    return SmallFederatedTask(
        task,
        train=[draw(shares, int(n)) for shares, n in zip(mixtures, sizes, strict=True)],
        test=[draw(shares, int(n)) for shares, n in zip(mixtures, sizes, strict=True)],
        mixtures=mixtures,
        cluster_test=[draw(np.eye(sources)[s], CLUSTER_TEST_EXAMPLES) for s in range(sources)],
    )


def fedsoft_mixtures(pattern: str, clients: int, sources: int, rng: np.random.Generator) -> np.ndarray:
    """``(clients, sources)`` shares of FedSoft's 10:90, 30:70, linear and random partitions (§5)."""
    if pattern in ("10-90", "30-70"):
        minor = int(pattern[:2]) / 100
        first = -(-clients // 2)
        return np.array([[minor, 1 - minor]] * first + [[1 - minor, minor]] * (clients - first))
    if pattern == "linear":
        share = (np.arange(clients) + 0.5) / clients
        return np.stack([share, 1 - share], axis=1)
    cuts = np.sort(rng.uniform(0.0, 1.0, (clients, sources - 1)), axis=1)
    return np.diff(cuts, axis=1, prepend=0.0, append=1.0)


def mixture_counts(shares: np.ndarray, count: int) -> np.ndarray:
    """``count`` examples split by ``shares``: floors, then one more to the largest remainders."""
    exact = shares * count
    counts = np.floor(exact).astype(int)
    counts[np.argsort(counts - exact, kind="stable")[: count - counts.sum()]] += 1
    return counts


# -- digits ------------------------------------------------------------------------------------------------------


def digits_task(task: TaskSpec, clients: int, clusters: int | None, rng: np.random.Generator, alpha: float,
                seed: int, valid_examples: int | None = None) -> SmallFederatedTask:
    """Digits clustered by rotation / label shift (``clusters``), or by Dirichlet(``alpha``) label skew."""
    images, labels = _digits()
    train, test, valid = _digit_rows(seed, valid_examples)
    if clusters is None:
        held_out = [labels[rows].tolist() for rows in (test, valid) if rows is not None]
        train_parts, proportions = dirichlet_partition(labels[train].tolist(), clients, alpha, seed, held_out=held_out)

        def deal_like_train(rows: np.ndarray, split: str, more: str) -> list[TensorExamples]:
            parts = partition_by_proportions(labels[rows].tolist(), proportions, seed)
            check_dealt(parts, len(rows), alpha, split, more)
            return [_digit_examples(images, labels, rows[part]) for part in parts]

        return SmallFederatedTask(
            task,
            train=[_digit_examples(images, labels, train[part]) for part in train_parts],
            test=deal_like_train(test, "test", "lower task.valid_examples"),
            mixtures=None,
            cluster_test=[],
            valid=None if valid is None else deal_like_train(valid, "validation", "raise task.valid_examples"),
        )
    rotate, shift = "rotate" in task.name, "shift" in task.name
    membership = [k % clusters for k in range(clients)]

    def deal(rows: np.ndarray) -> list[TensorExamples]:
        parts = np.array_split(rng.permutation(rows), clients)
        return [_digit_examples(images, labels, part, c * rotate, c * shift)
                for part, c in zip(parts, membership, strict=True)]

    return SmallFederatedTask(
        task,
        train=deal(train),
        test=deal(test),
        mixtures=_one_hot(membership, clusters),
        cluster_test=[_digit_examples(images, labels, test, c * rotate, c * shift) for c in range(clusters)],
        valid=None if valid is None else deal(valid),
    )


def rotated_digit_mixture(task: TaskSpec, clients: int, sources: int, rng: np.random.Generator, _alpha: float,
                          seed: int, valid_examples: int | None = None) -> SmallFederatedTask:
    """FedSoft's rotated mixtures (§5, App. C's CIFAR-10 "original and rotated by 90°") on digits:
    source ``s`` turns its images by 90°·s, and each client's training and test examples are
    turned in the shares of the task's 10:90 or 30:70 partition (:func:`fedsoft_mixtures`)."""
    images, labels = _digits()
    train, test, valid = _digit_rows(seed, valid_examples)
    mixtures = fedsoft_mixtures(task.name.removeprefix("digits-rotate-"), clients, sources, rng)

    def deal(rows: np.ndarray) -> list[TensorExamples]:
        parts = np.array_split(rng.permutation(rows), clients)
        return [_mixed_digits(images, labels, part, shares) for part, shares in zip(parts, mixtures, strict=True)]

    return SmallFederatedTask(
        task,
        train=deal(train),
        test=deal(test),
        mixtures=mixtures,
        cluster_test=[_digit_examples(images, labels, test, s) for s in range(sources)],
        valid=None if valid is None else deal(valid),
    )


def _digit_rows(seed: int, valid_examples: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The training, test and validation rows of the digits: the fixed 80 / 20 split, and
    ``valid_examples`` of the training rows held out by a draw of their own (seeded by ``seed``), so
    the rest of the task's draws are those it makes without a validation split."""
    train, test = (np.array(rows) for rows in fixed_split(len(_digits()[1])))
    if valid_examples is None:
        return train, test, None
    if not 0 < valid_examples < len(train):
        raise UserError(f"task.valid_examples={valid_examples}: the digits tasks train on {len(train)} images",
                        f"hold out fewer, e.g. {len(train) // 5} (a fifth)")
    held = np.zeros(len(train), dtype=bool)
    held[np.random.default_rng([seed, VALID_DRAW]).choice(len(train), valid_examples, replace=False)] = True
    return train[~held], test, train[held]


def _mixed_digits(images: np.ndarray, labels: np.ndarray, rows: np.ndarray, shares: np.ndarray) -> TensorExamples:
    """The examples ``rows``, the first ``shares[0]`` of them upright, the next ``shares[1]`` turned by 90°, ..."""
    bounds = np.cumsum(mixture_counts(shares, len(rows)))[:-1]
    pieces = [_digit_examples(images, labels, part, turns) for turns, part in enumerate(np.split(rows, bounds))]
    return TensorExamples(torch.cat([p.inputs for p in pieces]), torch.cat([p.labels for p in pieces]))


def _digit_examples(images: np.ndarray, labels: np.ndarray, rows: np.ndarray, quarter_turns: int = 0,
                    label_shift: int = 0) -> TensorExamples:
    """Images ``rows`` rotated by 90° · ``quarter_turns``, labels shifted to ``(y + label_shift) mod 10``."""
    turned = np.rot90(images[rows], k=quarter_turns, axes=(1, 2))
    return TensorExamples(torch.tensor(turned[:, None].copy(), dtype=torch.float32),
                          torch.tensor((labels[rows] + label_shift) % 10, dtype=torch.long))


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (shipped with it): 1,797 images 8 × 8 scaled to [0, 1], and their labels.

    Read from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, what its
    ``load_digits`` reads) without importing scikit-learn, a second of every device worker's start-up."""
    import gzip
    from importlib.util import find_spec

    spec = find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise UserError("the digits tasks read scikit-learn's digits, and scikit-learn is not installed",
                        "pip install scikit-learn")
    with gzip.open(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz") as file:
        table = np.loadtxt(file, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8) / 16.0, table[:, -1].astype(int)


# -- shared helpers ----------------------------------------------------------------------------------------------


def _normal(rng: np.random.Generator, shape: tuple[int, int], fan_in: int) -> np.ndarray:
    return rng.normal(0.0, 1.0 / np.sqrt(fan_in), shape)


def _tensors(inputs: np.ndarray, outputs: np.ndarray) -> TensorExamples:
    return TensorExamples(torch.tensor(inputs, dtype=torch.float32), torch.tensor(outputs, dtype=torch.float32))


def _one_hot(membership: list[int], clusters: int) -> np.ndarray:
    return np.eye(clusters)[membership]


def _reduced(examples: TensorExamples, fraction: float, rng: np.random.Generator) -> TensorExamples:
    """A random ``fraction`` of the examples, at least :data:`REDUCED_MINIMUM` (or all if fewer)."""
    keep = min(len(examples), max(REDUCED_MINIMUM, round(fraction * len(examples))))
    rows = torch.from_numpy(np.sort(rng.permutation(len(examples))[:keep]))
    return TensorExamples(examples.inputs[rows], examples.labels[rows])


_BUILDERS: dict[str, Callable[..., SmallFederatedTask]] = {
    "floral": floral_synthetic,
    "fedsoft": fedsoft_synthetic,
    "digits": digits_task,
    "digits-rotate-10-90": rotated_digit_mixture,
    "digits-rotate-30-70": rotated_digit_mixture,
}
TWO_SOURCE_TASKS = ("fedsoft-10-90", "fedsoft-30-70", "fedsoft-linear", "digits-rotate-10-90", "digits-rotate-30-70")
_MAX_CLUSTERS = {"digits-rotate": 4, "digits-rotate-label-shift": 4, "digits-label-shift": 10}

__all__ = ["SMALL_TASKS", "SmallFederatedTask", "TensorExamples", "build_small_task", "check_small_options",
           "digits_task", "fedsoft_mixtures", "fedsoft_synthetic", "floral_synthetic", "mixture_counts",
           "rotated_digit_mixture"]
