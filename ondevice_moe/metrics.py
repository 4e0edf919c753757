"""Task metrics, computed by scikit-learn and scipy.

Accuracy for most tasks, F1 of the positive class for MRPC, Matthews
correlation for CoLA and Spearman rank correlation for STS-B (Hermes Table 1);
mean squared error for the synthetic regression tasks (FLoRAL Table 3,
FedSoft Table 1), where lower is better. Undefined correlations (a constant
input) score 0.0, as scikit-learn's Matthews correlation does; inputs are
checked here, so that a bad pair of arrays fails the same way for every metric.

scikit-learn and scipy are imported where a score is computed: the report
reads :data:`LOWER_IS_BETTER` from here and should not wait for them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ondevice_moe.errors import UserError

Values = Sequence[float] | np.ndarray


def accuracy(predictions: Values, labels: Values) -> float:
    """Share of predictions equal to their label."""
    from sklearn.metrics import accuracy_score

    predicted, expected = _paired(predictions, labels)
    return float(accuracy_score(expected, predicted))


def binary_f1(predictions: Values, labels: Values, positive: int = 1) -> float:
    """F1 of the ``positive`` class, ``2 tp / (2 tp + fp + fn)``, whatever other classes there are;
    0.0 when there is no positive at all."""
    from sklearn.metrics import f1_score

    predicted, expected = _paired(predictions, labels)
    return float(f1_score(expected, predicted, labels=[positive], average=None, zero_division=0.0)[0])


def matthews_correlation(predictions: Values, labels: Values) -> float:
    """Matthews correlation, multi-class as Gorodkin's R_K (Gorodkin 2004); 0.0 when undefined."""
    from sklearn.metrics import matthews_corrcoef

    predicted, expected = _paired(predictions, labels)
    if np.unique(np.concatenate([predicted, expected])).size == 1:
        return 0.0  # one class in all: undefined (scikit-learn says 0.0 too, after a warning)
    return float(matthews_corrcoef(expected, predicted))


def spearman(predictions: Values, labels: Values) -> float:
    """Spearman rank correlation with average ranks for ties; 0.0 when an input is constant
    (where scipy warns and returns nan)."""
    from scipy.stats import spearmanr

    predicted, expected = _paired(predictions, labels)
    if np.ptp(predicted) == 0 or np.ptp(expected) == 0:
        return 0.0
    return float(spearmanr(predicted, expected).statistic)


def mean_squared_error(predictions: Values, labels: Values) -> float:
    """Mean over examples and outputs of the squared error; ``(N,)`` and ``(N, 1)`` arrays pair up.
    nan when a prediction is not finite (a diverged model), where scikit-learn refuses the input."""
    from sklearn.metrics import mean_squared_error as squared_error

    predicted, expected = np.asarray(predictions, dtype=float), np.asarray(labels, dtype=float)
    if predicted.size == 0 or predicted.size != expected.size or len(predicted) != len(expected):
        raise ValueError(f"need two equally sized, non-empty arrays of examples, got {predicted.shape} and "
                         f"{expected.shape}")
    if not np.isfinite(predicted).all():
        return float("nan")
    return float(squared_error(expected, predicted.reshape(expected.shape)))


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


__all__ = ["LOWER_IS_BETTER", "METRICS", "accuracy", "binary_f1", "lower_is_better", "matthews_correlation",
           "mean_squared_error", "spearman", "task_score"]
