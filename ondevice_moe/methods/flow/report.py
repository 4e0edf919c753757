"""What Flow's family (Flow, FedAvgFT, Ditto, APFL: a global and a personalised model each) adds to a
run's summary, report and comparison (§5, eq. 6–7, Tables 2–3, Fig. 2).

Each client's ``score_global`` (Acc_g) beside ``score`` (Acc_p) and the per-instance breakdown
(:mod:`.metrics`) are summarised like any value; the entry adds ``benefiting_pct``, the % of clients
whose personalised model beats the global one (Table 3; on a language model, whose own perplexity
falls). The report's "Global and personalised models" section and ``compare``'s table show them.
"""

from __future__ import annotations

import statistics
from types import MappingProxyType
from typing import Any

from ondevice_moe.methods.flow.metrics import BREAKDOWN
from ondevice_moe.report.across_runs import common_methods, is_number, spread
from ondevice_moe.report.reporter import Records, Reporter

PERSONALISATION_COLUMNS = {"Acc_g": "mean_score_global", "Acc_p": "mean_score",
                           "% clients Acc_p > Acc_g": "benefiting_pct", "global only": "mean_global_only",
                           "personalised only": "mean_personal_only", "both": "mean_both_correct",
                           "neither": "mean_neither_correct"}
PERPLEXITY_PERSONALISATION_COLUMNS = {"ppl_g in": "mean_in_global", "ppl_p in": "mean_in",
                                      "% users ppl_p < ppl_g": "benefiting_pct", "ppl_g out": "mean_out_global",
                                      "ppl_p out": "mean_out"}


class PersonalisationReporter(Reporter):
    """Acc_g beside Acc_p, the breakdown and the % of clients helped (module docstring)."""

    value_keys = MappingProxyType({"score_global": "score_global", **{case: case for case in BREAKDOWN},
                                   "test_ppl_in_global": "in_global", "test_ppl_out_global": "out_global"})
    compared = ("score_global", "in_global", "out_global")

    def entry_fields(self, final: Records, users: list[str]) -> dict[str, Any]:
        first = final[users[0]]
        if "score_global" in first:  # Table 3: the share of clients with Acc_p > Acc_g
            return {"benefiting_pct": 100.0 * statistics.fmean(
                final[u]["score"] > final[u]["score_global"] for u in users)}
        if "test_ppl_in_global" in first:  # ... and on a language model, with ppl_p < ppl_g
            return {"benefiting_pct": 100.0 * statistics.fmean(
                final[u]["test_ppl_in"] < final[u]["test_ppl_in_global"] for u in users)}
        return {}

    def sections(self, summary: dict[str, Any]) -> list[str]:
        return _personalisation_section(summary)

    def compare_tables(self, summaries: list[dict[str, Any]]) -> list[str]:
        if any("benefiting_pct" in m for m in summaries[0]["methods"].values()):
            return [personalisation_table(summaries)]
        return []

    def entry_problem(self, name: str, entry: dict[str, Any]) -> str | None:
        value = entry.get("benefiting_pct")
        if value is not None and not is_number(value):
            return f"method '{name}' holds a value that is neither a number nor null"
        return None


def personalisation_table(summaries: list[dict[str, Any]]) -> str:
    """Flow Tables 2–3 over runs: per method with a global and a personalised model, the
    clients' mean Acc_g and Acc_p (eq. 6–7), the % of clients with Acc_p > Acc_g and the
    per-instance breakdown, each mean (std) over runs; on a language model, the perplexities
    of both models in and out of distribution and the % of users whose own perplexity falls."""
    columns = PERPLEXITY_PERSONALISATION_COLUMNS if summaries[0].get("metric") == "perplexity" \
        else PERSONALISATION_COLUMNS
    header = ["method", *columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in common_methods(summaries):
        entries = [s["methods"][method] for s in summaries]
        if all("benefiting_pct" in e for e in entries):
            cells = [spread([e.get(key) for e in entries]) for key in columns.values()]
            lines.append(f"| {method} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _personalisation_section(summary: dict[str, Any]) -> list[str]:
    """Flow's measures, for methods with a global and a personalised model: Acc_g and Acc_p
    (eq. 6-7, Table 2), the share of clients they benefit (Table 3) and the per-instance
    breakdown (Fig. 2), mean (std) over clients; on a language model, both models' test
    perplexity in and out of distribution and the % of users whose own perplexity falls."""
    methods = {name: m for name, m in summary["methods"].items() if "benefiting_pct" in m}
    if not methods:
        return []
    if all("mean_in_global" in m for m in methods.values()):
        return _personalisation_table(methods, ("in_global", "in", "out_global", "out"), (
            "ppl_g: every token on the global experts; ppl_p: the personalised model (Flow: routed with the hard "
            "policy; APFL: the interpolation; FedAvgFT, Ditto: the local experts); in: the user's own test split, "
            "out: every user's; mean (std) over users."),
            ["ppl_g in", "ppl_p in", "ppl_g out", "ppl_p out", "% users ppl_p in < ppl_g in"])
    return _personalisation_table(
        methods, ("score_global", "score", "global_only", "personal_only", "both_correct", "neither_correct"), (
            "Acc_g: every instance on the global layers; Acc_p: the personalised model (Flow: routed with the "
            "hard policy); then the % of each client's test instances correct by the global model only, the "
            "personalised model only, both, neither; and the % of clients with Acc_p > Acc_g."),
        ["Acc_g", "Acc_p", "global only", "personalised only", "both", "neither", "% clients Acc_p > Acc_g"])


def _personalisation_table(methods: dict[str, Any], shorts: tuple[str, ...], note: str, header: list[str]
                           ) -> list[str]:
    """The section: ``note``, then per method the mean (std) of each value and the % benefiting."""
    rows = [f"| {name} | " + " | ".join(f"{m[f'mean_{s}']:.2f} ({m[f'std_{s}']:.2f})" for s in shorts)
            + f" | {m['benefiting_pct']:.1f} |" for name, m in methods.items()]
    return ["## Global and personalised models", "", note, "", "| method | " + " | ".join(header) + " |",
            "|---" * (len(header) + 1) + "|", *rows, ""]




REPORTER = PersonalisationReporter()
