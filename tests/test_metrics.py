"""Task metrics (scikit-learn and scipy) against textbook values and against the plain-numpy
formulas they replaced, kept here only as the reference."""

import math

import numpy as np
import pytest

from ondevice_moe.errors import UserError
from ondevice_moe.metrics import METRICS, accuracy, binary_f1, matthews_correlation, spearman, task_score

# -- the replaced formulas ------------------------------------------------------


def reference_f1(predicted: np.ndarray, expected: np.ndarray, positive: int = 1) -> float:
    """``2 tp / (2 tp + fp + fn)`` of the positive class, 0.0 with no positive at all."""
    predicted_positive, actual_positive = predicted == positive, expected == positive
    denominator = np.sum(predicted_positive) + np.sum(actual_positive)
    return float(2 * np.sum(predicted_positive & actual_positive) / denominator) if denominator else 0.0


def reference_mcc(predicted: np.ndarray, expected: np.ndarray) -> float:
    """Gorodkin's R_K from the confusion matrix over the classes seen; 0.0 when undefined."""
    _, codes = np.unique(np.concatenate([expected, predicted]), return_inverse=True)
    classes = int(codes.max()) + 1
    confusion = np.bincount(codes[: expected.size] * classes + codes[expected.size :],
                            minlength=classes**2).reshape(classes, classes).astype(float)
    total, correct = confusion.sum(), np.trace(confusion)
    true_counts, predicted_counts = confusion.sum(axis=1), confusion.sum(axis=0)
    covariance = correct * total - true_counts @ predicted_counts
    denominator = np.sqrt((total**2 - predicted_counts @ predicted_counts) * (total**2 - true_counts @ true_counts))
    return float(covariance / denominator) if denominator else 0.0


def reference_spearman(predicted: np.ndarray, expected: np.ndarray) -> float:
    """Pearson correlation of average ranks (ties share the mean of their ranks); 0.0 for a constant."""

    def ranks(values: np.ndarray) -> np.ndarray:
        _, groups, counts = np.unique(values, return_inverse=True, return_counts=True)
        return (np.cumsum(counts) - counts + 1 + (counts - 1) / 2)[groups]

    rank_x, rank_y = ranks(predicted) - (predicted.size + 1) / 2, ranks(expected) - (expected.size + 1) / 2
    denominator = np.sqrt((rank_x @ rank_x) * (rank_y @ rank_y))
    return float(rank_x @ rank_y / denominator) if denominator else 0.0


# -- textbook values ------------------------------------------------------------


def test_metrics_known_values():
    # Binary: tp=3, tn=4, fp=1, fn=2 → MCC = (3·4 − 1·2) / sqrt(4·5·5·6) = 10 / sqrt(600)
    labels = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    predictions = [1, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    assert matthews_correlation(predictions, labels) == pytest.approx(10 / math.sqrt(600))
    assert binary_f1(predictions, labels) == pytest.approx(2 * 3 / (2 * 3 + 1 + 2))
    assert binary_f1(predictions, labels, positive=0) == pytest.approx(2 * 4 / (2 * 4 + 2 + 1))
    assert accuracy(predictions, labels) == pytest.approx(0.7)
    # 3 classes: confusion [[1,1,0],[0,2,0],[1,0,1]]; trace 4, n 6, true counts (2,2,2), predicted (2,3,1)
    # R_K = (4·6 − (2·2 + 2·3 + 2·1)) / sqrt((36 − (4+9+1)) · (36 − (4+4+4))) = 12 / sqrt(22·24)
    assert matthews_correlation([0, 1, 1, 1, 2, 0], [0, 0, 1, 1, 2, 2]) == pytest.approx(12 / math.sqrt(528))
    # ranks of y = (1, 2, 3.5, 5, 3.5); centred dot 8, norms² 10 and 9.5
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert METRICS["mse"]([1.0, 2.0], [[1.0], [4.0]]) == pytest.approx(2.0)  # (N,) predictions against (N, 1) labels


def test_metrics_are_zero_when_undefined():
    assert matthews_correlation([1, 1, 1], [0, 1, 0]) == 0.0
    assert matthews_correlation([2, 2], [2, 2]) == 0.0  # one class only
    assert spearman([2.0, 2.0, 2.0], [0.1, 0.5, 0.2]) == 0.0
    assert spearman([0.1, 0.5, 0.2], [3.0, 3.0, 3.0]) == 0.0
    assert spearman([4.0], [1.0]) == 0.0
    assert binary_f1([0, 0], [0, 0]) == 0.0
    assert binary_f1([0, 2, 2], [2, 0, 0]) == 0.0  # no positive in either, two other classes


def test_a_diverged_regression_scores_nan():
    assert math.isnan(METRICS["mse"]([1.0, float("nan")], [1.0, 2.0]))
    assert math.isnan(METRICS["mse"]([1.0, float("inf")], [1.0, 2.0]))


BAD_PAIRS = [([], []), ([1, 0], [1]), ([[1, 0]], [[1, 0]])]


@pytest.mark.parametrize(("metric", "predictions", "labels"),
                         [(metric, *pair) for metric in sorted(METRICS) for pair in BAD_PAIRS
                          if not (metric == "mse" and pair == BAD_PAIRS[2])])  # (N, k) outputs are mse's to pair
def test_bad_pairs_of_arrays_are_refused(metric, predictions, labels):
    with pytest.raises(ValueError, match="need two equally"):
        METRICS[metric](predictions, labels)


def test_task_score_dispatches_and_rejects_unknown_metrics():
    assert task_score("f1", [1, 0, 1], [1, 1, 1]) == pytest.approx(0.8)
    with pytest.raises(UserError, match="bleu"):
        task_score("bleu", [1], [1])


# -- the replaced formulas on random inputs -----------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_classification_metrics_equal_the_replaced_formulas(seed):
    rng = np.random.default_rng(seed)
    for classes, size in ((2, 200), (4, 300), (3, 7)):
        labels, predictions = rng.integers(0, classes, size), rng.integers(0, classes, size)
        predictions[: size // 2] = labels[: size // 2]  # better than chance
        assert accuracy(predictions, labels) == pytest.approx(np.mean(predictions == labels), rel=1e-12)
        assert matthews_correlation(predictions, labels) == pytest.approx(reference_mcc(predictions, labels),
                                                                          rel=1e-12)
        for positive in range(classes):
            assert binary_f1(predictions, labels, positive) == pytest.approx(
                reference_f1(predictions, labels, positive), rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_spearman_equals_the_replaced_formula_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = rng.uniform(0, 5, 100).round(1)  # rounding makes ties
    noisy = scores + rng.normal(0, 1, 100).round(0)
    assert spearman(noisy, scores) == pytest.approx(reference_spearman(noisy, scores), rel=1e-12)


@pytest.mark.parametrize("shape", [(50,), (50, 1), (50, 3)])
def test_mean_squared_error_equals_the_mean_of_squares(shape):
    rng = np.random.default_rng(0)
    labels, predictions = rng.normal(size=shape), rng.normal(size=shape)
    assert METRICS["mse"](predictions, labels) == pytest.approx(np.mean((predictions - labels) ** 2), rel=1e-12)
