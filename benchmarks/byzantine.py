"""Lying devices against every aggregation rule, side by side in one run.

On ``recipes/byzantine-digits.yaml`` (digits, 20 clients, FedAvg weighted by example counts) the
first 0, 10 and 20 % of the devices lie in every round (``federation.faults``), for every attack ×
every aggregation rule (``federation.aggregation``), each a real Flower simulation into its own
folder under ``--output`` (an interrupted benchmark resumes):

* attacks: ``sign-flip`` (scale ``--scale``), ``constant`` (``--value``), ``noise`` (std ``--std``),
  ``stale`` (the first round's update replayed), ``inflated-count`` (a billion examples claimed),
  ``label-flip`` (trained on classes ``9 − c``);
* rules: ``mean`` (the default, with the server's bound on claimed example counts), ``median``,
  ``trimmed-mean`` (β = 0.2), ``krum`` (f = the attackers' number, at least 1).

Per cell: the clients' mean test accuracy after the last round, and what the server flagged (updates
it rejected, counts it capped). The no-attack row is the reference; ``Δ`` is each cell against
its rule's no-attack accuracy. Writes ``byzantine.json`` and ``byzantine.md``; prints the table.

Usage:
    python benchmarks/byzantine.py [--recipe recipes/byzantine-digits.yaml] [--fractions 0.1 0.2]
        [--attacks ...] [--rules ...] [--rounds R] [--set key=value ...] [--output runs/byzantine]
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import simulations

from ondevice_moe.recipe import load_recipe
from ondevice_moe.report import MetricsLog

ATTACKS = ("sign-flip", "constant", "noise", "stale", "inflated-count", "label-flip")
RULES = ("mean", "median", "trimmed-mean", "krum")


def options(argv: Sequence[str] | None):
    parser = simulations.parser(__doc__, "byzantine")
    parser.set_defaults(recipe=simulations.ROOT / "recipes" / "byzantine-digits.yaml")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.1, 0.2], help="shares of lying devices")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--scale", type=float, default=4.0, help="sign-flip: how far the other way")
    parser.add_argument("--value", type=float, default=5.0, help="constant: the value sent")
    parser.add_argument("--std", type=float, default=5.0, help="noise: its standard deviation")
    return parser.parse_args(argv)


def attack_overrides(args, attack: str, liars: int) -> list[str]:
    """``federation.faults`` making the first ``liars`` devices lie by ``attack`` in every round."""
    extra = {"sign-flip": f", scale: {args.scale}", "constant": f", value: {args.value}",
             "noise": f", std: {args.std}"}.get(attack, "")
    faults = ", ".join(f"{{device: {device}, kind: {attack}{extra}}}" for device in range(liars))
    return [f"federation.faults=[{faults}]"]


def rule_overrides(rule: str, liars: int) -> list[str]:
    overrides = [f"federation.aggregation={rule}"]
    if rule == "krum":
        overrides.append(f"federation.byzantine={max(liars, 1)}")
    return overrides


def flagged(folder) -> dict[str, int]:
    """What the server caught in a run: updates rejected, claimed counts capped."""
    records = MetricsLog(folder / "metrics.jsonl").read()
    return {"rejected": sum(r["kind"] == "drop" and "rejected" in r["reason"] for r in records),
            "capped": sum(r["kind"] == "train" and "examples_counted" in r for r in records)}


def main(argv: Sequence[str] | None = None) -> dict[str, object]:
    args = options(argv)
    devices = len(load_recipe(args.recipe, args.overrides).user_names)
    cells: dict[str, dict[str, dict[str, float]]] = {}
    settings = [("no attack", 0, None)] + [(f"{attack} {round(100 * fraction)} %", round(fraction * devices), attack)
                                           for attack in args.attacks for fraction in args.fractions]
    for label, liars, attack in settings:
        for rule in args.rules:
            folder = f"{(attack or 'none')}-{liars}-{rule}"
            overrides = rule_overrides(rule, liars) + (attack_overrides(args, attack, liars) if attack else [])
            summary = simulations.run_variant(args, folder, overrides)
            method = next(iter(summary.values()))
            cells.setdefault(label, {})[rule] = {"accuracy": method["mean_score"], **flagged(args.output / folder)}
    return simulations.publish(args.output, "byzantine", cells, markdown(cells, args.rules))


def markdown(cells: dict[str, dict[str, dict[str, float]]], rules: list[str]) -> str:
    honest = cells["no attack"]
    lines = ["| attack | " + " | ".join(rules) + " |", "|---|" + "---|" * len(rules)]
    for label, by_rule in cells.items():
        row = []
        for rule in rules:
            cell = by_rule[rule]
            accuracy = cell["accuracy"]
            delta = "" if label == "no attack" or accuracy is None else f" ({accuracy - honest[rule]['accuracy']:+.1f})"
            caught = [f"{cell[kind]} {kind}" for kind in ("rejected", "capped") if cell[kind]]
            shown = "diverged" if accuracy is None or not math.isfinite(accuracy) else f"{accuracy:.1f}"
            row.append(shown + delta + (f", {', '.join(caught)}" if caught else ""))
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n\nMean test accuracy of the clients (%) after the last round; (Δ against the rule " \
                              "without attack); what the server flagged over the run."


if __name__ == "__main__":
    main()
