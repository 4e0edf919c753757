"""Server-side aggregation of shared tensors, and the checks that keep one
misbehaving device from spoiling the global model.

* CoMiGS Alg. 1 line 498: θ^G = (1/N) Σ_i θ_i^G, the plain mean of the
  devices' generalists; ``weighting="num_examples"`` gives the FedAvg
  weighting of McMahan et al. (2017) instead.
* A method's own weights (Hermes' inverse frequencies, FLoRAL's π) come from
  its server rule, in its folder, reading the records its devices sent.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

MAX_EXAMPLES = 2**31 - 1  # a device reporting more examples than this is lying or broken
MAX_RECORDS = 8  # records besides the tensors and metrics: a method sends one or two
MAX_RECORD_VALUES = 1_000_000  # numbers in all of an update's records together
PROBABILITY_TOLERANCE = 1e-3  # how far a reported probability vector may sum from 1

Record = dict[str, float | list[float]]


@dataclass
class Update:
    """The shared tensors one device sent back, with its example count and the records its method's
    procedure sent with them (record name → entries), which the strategy passes to the method's server
    rule unread, once they are numbers in bounds (:func:`check_update`): Hermes' ``usage`` (tensor name
    → tokens routed), FLoRAL's ``mixture`` (``pi``: the client's π over its experts), FedSoft's and
    IFCA's ``mixture`` (its weights over the server's centres)."""

    device: int
    tensors: dict[str, torch.Tensor]
    num_examples: int
    records: dict[str, Record] = field(default_factory=dict)


Weighting = Callable[[Update, str], float]

MEDIAN_BOUND = 2.0  # where the server cannot know what a device holds: a claim counts up to this × the round's median


def bounded_counts(updates: list[Update], held: dict[int, int] | None) -> tuple[list[Update], dict[int, int]]:
    """The updates with each claimed example count capped: at what the device's data holds (``held``, device →
    its training examples, where the server knows it: a task dealt from the recipe), else at
    :data:`MEDIAN_BOUND` × the round's median claim. A claimed count is a device's word, and under
    ``weighting: num_examples`` it is the device's weight: two devices claiming a billion examples each
    would own the average. Returns the updates and ``{device: its claim}`` for the capped ones. An honest
    device never claims more than it holds, so an honest round is unchanged."""
    if not updates:
        return updates, {}
    median = statistics.median(update.num_examples for update in updates)
    capped: dict[int, int] = {}
    bounded = []
    for update in updates:
        bound = held[update.device] if held is not None and update.device in held else int(MEDIAN_BOUND * median)
        if update.num_examples > bound:
            capped[update.device] = update.num_examples
            update = replace(update, num_examples=max(bound, 1))
        bounded.append(update)
    return bounded, capped


def example_weighting(kind: str) -> Weighting:
    """``uniform`` (CoMiGS) or ``num_examples`` (FedAvg) weights per device."""
    return (lambda update, _: float(update.num_examples)) if kind == "num_examples" else (lambda _u, _n: 1.0)


def check_update(update: Update, reference: dict[str, torch.Tensor] | None, partial: bool = False) -> str | None:
    """Why ``update`` must be rejected, or ``None`` when it is sound.

    A sound update has a positive example count, records of finite numbers within bounds
    (:func:`records_problem`; what they mean is its server rule's to check), finite values and the
    reference's names and shapes (a subset of the names when ``partial``:
    Hermes clients upload only the experts they used). No tensor may take more
    bytes than its reference (an *oversized* upload, e.g. float64 for float32).
    ``reference`` may hold meta tensors: only names, shapes and dtypes are read.
    """
    if not 0 < update.num_examples <= MAX_EXAMPLES:
        return f"device {update.device} reported {update.num_examples} training examples"
    problem = records_problem(update.records)
    if problem is not None:
        return f"device {update.device} {problem}"
    for name, tensor in update.tensors.items():
        if not torch.isfinite(tensor).all():
            return f"device {update.device} sent non-finite values in {name}"
    if not reference:
        return None
    missing, extra = set(reference) - set(update.tensors), set(update.tensors) - set(reference)
    if extra or (missing and not partial):  # a partial upload may leave tensors out, never add others
        return (f"device {update.device} sent unexpected tensors "
                f"(missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})")
    for name, tensor in update.tensors.items():
        if name not in reference:
            continue
        expected = reference[name]
        if tensor.shape != expected.shape:
            return (f"device {update.device} sent {name} with shape {tuple(tensor.shape)}, "
                    f"expected {tuple(expected.shape)}")
        if _nbytes(tensor) > _nbytes(expected):
            return (f"device {update.device} sent an oversized {name} ({_nbytes(tensor)} bytes as {tensor.dtype}, "
                    f"expected {_nbytes(expected)} as {expected.dtype})")
    return None


def records_problem(records: dict[str, Record]) -> str | None:
    """Why an update's records cannot be passed on, or ``None``: at most :data:`MAX_RECORDS` records
    of :data:`MAX_RECORD_VALUES` numbers in all, every one finite."""
    if len(records) > MAX_RECORDS:
        return f"sent {len(records)} records beside its tensors, more than {MAX_RECORDS}"
    count = 0
    for record, entries in records.items():
        for key, value in entries.items():
            values = value if isinstance(value, list) else [value]
            count += len(values)
            if count > MAX_RECORD_VALUES:
                return f"sent records of more than {MAX_RECORD_VALUES:,} numbers"
            if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
                return f"reported a non-finite or non-numeric {record} entry for {key}"
    return None


def record_values(update: Update, record: str, key: str) -> list[float]:
    """The numbers of entry ``key`` of ``update``'s ``record`` as a list (none when it did not send it)."""
    value = update.records.get(record, {}).get(key, [])
    return value if isinstance(value, list) else [value]


def probability_problem(values: list[float] | tuple[float, ...], what: str) -> str | None:
    """Why ``values`` (a device's ``what``) is no probability vector, or ``None``."""
    if all(value >= 0 for value in values) and abs(sum(values) - 1) <= PROBABILITY_TOLERANCE:
        return None
    return f"reported a {what} {list(values)[:4]} that is no probability vector"


def norm_outliers(updates: list[Update], held: float | None, bound: float) -> dict[int, str]:
    """The updates whose L2 norm exceeds ``bound`` times a reference norm (at least 1): the norm of what
    the server holds (``held``), or before it holds anything, the median norm of the round's updates.
    A device cannot then blow the global up with huge finite values and lock every honest device out."""
    norms = {update.device: update_norm(update) for update in updates}
    if not norms:
        return {}
    reference = held if held is not None else statistics.median(norms.values())
    limit = bound * max(reference, 1.0)
    return {device: f"device {device} sent an update of norm {norm:.3g}, over {bound:g} × {max(reference, 1.0):.3g}"
                    f" (federation.update_norm_bound)" for device, norm in norms.items() if norm > limit}


def update_norm(update: Update) -> float:
    """The L2 norm of all of an update's tensors together."""
    return math.sqrt(sum(float(tensor.detach().double().pow(2).sum()) for tensor in update.tensors.values()))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def average(updates: list[Update], weighting: Weighting | None = None) -> dict[str, torch.Tensor]:
    """Weighted average of each shared tensor over the devices that sent it (Hermes eq. 10).

    A name held by a subset of devices (CoMiGS-1GXs users with different
    expert counts, Hermes clients that used different experts) is averaged
    over that subset. ``weighting`` defaults to the plain mean. A tensor whose
    weights sum to zero (FLoRAL's adaptor of a cluster no sampled client
    belongs to, under π*) is left out, so it keeps its last value.
    """
    weighting = weighting or example_weighting("uniform")
    sums: dict[str, torch.Tensor] = {}
    totals: dict[str, float] = {}
    dtypes: dict[str, torch.dtype] = {}
    for update in updates:
        for name, tensor in update.tensors.items():
            weight = weighting(update, name)
            value = tensor.detach().double() * weight
            sums[name] = sums[name] + value if name in sums else value
            totals[name] = totals.get(name, 0.0) + weight
            dtypes[name] = tensor.dtype
    return {name: (sums[name] / totals[name]).to(dtypes[name]) for name in sums if totals[name] > 0}
