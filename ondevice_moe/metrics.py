"""Task metrics in plain numpy.

Accuracy for most tasks, F1 of the positive class for MRPC, Matthews
correlation for CoLA and Spearman rank correlation for STS-B (Hermes Table 1);
mean squared error for the synthetic regression tasks (FLoRAL Table 3,
FedSoft Table 1), where lower is better. Each agrees with its scikit-learn /
scipy counterpart (see ``tests/test_tasks.py``); undefined correlations (a
constant input) score 0.0, as in scikit-learn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ondevice_moe.errors import UserError

Values = Sequence[float] | np.ndarray


def accuracy(predictions: Values, labels: Values) -> float:
    """Share of predictions equal to their label."""
    predicted, expected = _paired(predictions, labels)
    return float(np.mean(predicted == expected))


def binary_f1(predictions: Values, labels: Values, positive: int = 1) -> float:
    """F1 of the ``positive`` class: ``2 tp / (2 tp + fp + fn)``, 0.0 when there is no positive at all."""
    predicted, expected = _paired(predictions, labels)
    predicted_positive, actual_positive = predicted == positive, expected == positive
    true_positives = np.sum(predicted_positive & actual_positive)
    denominator = np.sum(predicted_positive) + np.sum(actual_positive)
    return float(2 * true_positives / denominator) if denominator else 0.0


def matthews_correlation(predictions: Values, labels: Values) -> float:
    """Matthews correlation, multi-class as Gorodkin's R_K; 0.0 when undefined."""
    predicted, expected = _paired(predictions, labels)
    confusion = _confusion_matrix(predicted, expected).astype(float)  # n**4 overflows int64 for n > 55k
    total, correct = confusion.sum(), np.trace(confusion)
    true_counts, predicted_counts = confusion.sum(axis=1), confusion.sum(axis=0)
    covariance = correct * total - true_counts @ predicted_counts
    variance_predicted = total**2 - predicted_counts @ predicted_counts
    variance_true = total**2 - true_counts @ true_counts
    denominator = np.sqrt(variance_predicted * variance_true)
    return float(covariance / denominator) if denominator else 0.0


def spearman(predictions: Values, labels: Values) -> float:
    """Spearman rank correlation with average ranks for ties; 0.0 when an input is constant."""
    predicted, expected = _paired(predictions, labels)
    rank_x, rank_y = _average_ranks(predicted), _average_ranks(expected)
    rank_x, rank_y = rank_x - rank_x.mean(), rank_y - rank_y.mean()
    denominator = np.sqrt((rank_x @ rank_x) * (rank_y @ rank_y))
    return float(rank_x @ rank_y / denominator) if denominator else 0.0


def mean_squared_error(predictions: Values, labels: Values) -> float:
    """Mean over examples and outputs of the squared error; ``(N,)`` and ``(N, 1)`` arrays pair up."""
    predicted, expected = np.asarray(predictions, dtype=float), np.asarray(labels, dtype=float)
    if predicted.size == 0 or predicted.size != expected.size or len(predicted) != len(expected):
        raise ValueError(f"need two equally sized, non-empty arrays of examples, got {predicted.shape} and "
                         f"{expected.shape}")
    return float(np.mean((predicted.reshape(expected.shape) - expected) ** 2))


METRICS: dict[str, Callable[[Values, Values], float]] = {
    "accuracy": accuracy,
    "f1": binary_f1,
    "mcc": matthews_correlation,
    "spearman": spearman,
    "mse": mean_squared_error,
}


LOWER_IS_BETTER = frozenset({"mse"})


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value of ``metric`` is better: an error, or a language model's perplexity."""
    return metric in LOWER_IS_BETTER or metric == "perplexity"


def task_score(metric: str, predictions: Values, labels: Values) -> float:
    """The named metric (a key of :data:`METRICS`) of ``predictions`` against ``labels``."""
    if metric not in METRICS:
        raise UserError(f"unknown metric '{metric}'", f"choose one of {', '.join(METRICS)}")
    return METRICS[metric](predictions, labels)


def _paired(predictions: Values, labels: Values) -> tuple[np.ndarray, np.ndarray]:
    predicted, expected = np.asarray(predictions, dtype=float), np.asarray(labels, dtype=float)
    if predicted.shape != expected.shape or predicted.ndim != 1 or predicted.size == 0:
        raise ValueError(f"need two equally long, non-empty 1-d arrays, got {predicted.shape} and {expected.shape}")
    return predicted, expected


def _confusion_matrix(predicted: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Counts of (true class, predicted class) pairs over the classes seen in either array."""
    _, codes = np.unique(np.concatenate([expected, predicted]), return_inverse=True)
    num_classes = int(codes.max()) + 1
    true_codes, predicted_codes = codes[: expected.size], codes[expected.size :]
    return np.bincount(true_codes * num_classes + predicted_codes, minlength=num_classes**2).reshape(
        num_classes, num_classes
    )


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks; tied values share the mean of the ranks they span."""
    _, groups, counts = np.unique(values, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1
    return (first_rank + (counts - 1) / 2)[groups]


__all__ = ["LOWER_IS_BETTER", "METRICS", "accuracy", "binary_f1", "lower_is_better", "matthews_correlation",
           "mean_squared_error", "spearman", "task_score"]
