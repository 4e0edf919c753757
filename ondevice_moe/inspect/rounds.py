"""What ``metrics.jsonl`` says about one user over the rounds: expert scores per layer
(CoMiGS Fig. 4/8) and the bytes the user's device sent and received.

Each round, every device's ``train`` record holds ``layer_<l>/expert_<name>_score``: the mean
routing weight of each expert at layer ``l`` over the round's iterations (for a per-token
router, the share of routing mass the expert took), FLoRAL's ``pi_<c>`` and Flow's
``q0_layer_<j>`` (the mean probability of the global copy of layer ``j``). Since this
feature, the record also holds the device's ``bytes_up`` and ``bytes_down`` of the round;
runs made before only have the ``comm`` records' totals over all devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

SCORE_KEY = re.compile(r"layer_(\d+)/expert_(.+)_score")
PI_KEY = re.compile(r"pi_(\d+)")
PI_ROW = "π (all layers)"
Q0_KEY = re.compile(r"q0_layer_(\d+)")
FLOW_EXPERTS = ["global", "local"]


@dataclass(frozen=True)
class ScoreGrid:
    """``scores[expert, layer, round]`` (NaN where a round logged nothing), with their labels."""

    experts: list[str]
    layers: list[str]
    rounds: list[int]
    scores: np.ndarray


@dataclass(frozen=True)
class DeviceBytes:
    """Bytes per round of one device (``per_device``), or each device's mean from the
    ``comm`` totals (``per_device`` False: a run from before per-device bytes were logged)."""

    rounds: list[int]
    up: list[float]
    down: list[float]
    per_device: bool


def train_records(records: list[dict], method: str, user: str) -> list[dict]:
    """The ``train`` records of ``user``'s device (``all`` for a centralized method), by round."""
    mine = [r for r in records if r.get("method") == method and r["kind"] == "train" and r.get("user") in (user, "all")]
    return sorted(mine, key=lambda r: r["round"])


def score_grid(records: list[dict], method: str, user: str, experts: list[str]) -> ScoreGrid | None:
    """Each expert's score per layer and round (CoMiGS Fig. 4/8), FLoRAL's ``π`` per round as
    one row ``π (all layers)``, or Flow's global and local shares per layer; ``None`` when the
    records hold none of them."""
    trains = train_records(records, method, user)
    rounds = [r["round"] for r in trains]
    by_layer = {(int(m[1]), m[2]): key for r in trains for key in r if (m := SCORE_KEY.fullmatch(key))}
    pis = sorted({int(m[1]) for r in trains for key in r if (m := PI_KEY.fullmatch(key))})
    q0 = sorted({int(m[1]) for r in trains for key in r if (m := Q0_KEY.fullmatch(key))})
    if q0:  # Flow: the global copy's q_0 and the local copy's 1 - q_0
        global_share = np.array([[r.get(f"q0_layer_{j}", np.nan) for r in trains] for j in q0], dtype=float)
        return ScoreGrid(FLOW_EXPERTS, [f"layer {j}" for j in q0], rounds, np.stack([global_share, 1 - global_share]))
    if by_layer:
        layers = sorted({layer for layer, _ in by_layer})
        keys = [[by_layer.get((layer, name)) for layer in layers] for name in experts]
        labels = [f"layer {layer}" for layer in layers]
    elif pis:
        keys = [[f"pi_{index}"] for index in pis]
        labels = [PI_ROW]
    else:
        return None
    scores = np.array([[[r.get(key, np.nan) if key else np.nan for r in trains] for key in row] for row in keys],
                      dtype=float)
    return ScoreGrid(experts if by_layer else experts[: len(pis)], labels, rounds, scores)


def device_bytes(records: list[dict], method: str, user: str) -> DeviceBytes | None:
    """The bytes ``user``'s device uploaded and downloaded each round; ``None`` without a round."""
    trains = train_records(records, method, user)
    if trains and all("bytes_up" in r for r in trains):
        return DeviceBytes([r["round"] for r in trains], [r["bytes_up"] for r in trains],
                           [r["bytes_down"] for r in trains], True)
    comm = sorted((r for r in records if r.get("method") == method and r["kind"] == "comm"), key=lambda r: r["round"])
    if not comm:
        return None
    return DeviceBytes([r["round"] for r in comm], [r["bytes_up"] / max(r["devices"], 1) for r in comm],
                       [r["bytes_down"] / max(r["devices"], 1) for r in comm], False)
