"""Per-method table over several runs (seeds), as in CoMiGS Table 2 and Hermes Table 1,
and a paired comparison of every method against one of them.

Usage: python eval/seed_table.py RUN [RUN ...] [--against METHOD]

Each RUN is a run folder with a ``summary.json``, or several folders of one
seed joined by ``+`` (``runs/base-s0+runs/ablations-s0``: their methods side by side). For every method found in
all runs it prints, over runs, the mean (std) of the users' mean value —
test perplexity in and out of distribution for language modelling, the task
score for classification — its mean std over users, and the upload per round.

For FedSoft and IFCA (methods whose summary has ``centres``) it also prints the
centre-by-source table over runs: in each run every source is matched to a centre by the
assignment with the best total score (centre indices are arbitrary, Table 1's "center
indices are assigned randomly"), then per source the matched centre's score, the other
centres' mean, and in how many runs the matched centre is the best on that source.

For methods with a global and a personalised model (Flow, FedAvgFT) it also prints
Acc_g, Acc_p, the % of clients with Acc_p > Acc_g and the per-instance breakdown over runs.

For language modelling it also prints the standard error of each user's mean
test NLL over the test blocks (mean over users and runs): a 1 % perplexity
gap is a NLL gap of 0.01, so one run resolves it only when this is well under 0.01.

``--against METHOD`` adds the paired comparison: for every (run, user) pair
the method's value against METHOD's — for perplexities the relative gap
``100·ln(ppl / ppl_METHOD)`` in percent (users' perplexities differ by a factor
of three, so raw differences would weigh the hardest user most), for task
scores the difference in points — their mean and standard error, and the
two-sided p-values of a paired t-test and of a Wilcoxon signed-rank test over
the pairs. A gap counts as larger than its noise when both p < 0.05. Pairing
removes what the methods share (the users' test blocks, the run's data); what
remains is training noise across seeds and users.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path

from scipy import stats

from ondevice_moe.metrics import lower_is_better
from ondevice_moe.report import CENTRE_KEY, format_bytes

SIGNIFICANCE = 0.05


def load_summaries(runs: list[Path]) -> list[dict]:
    """One summary per RUN; ``A+B`` joins the methods of run folders of one seed (the same users)."""
    summaries = []
    for run in runs:
        parts = [_read_summary(Path(part)) for part in str(run).split("+")]
        joined = {**parts[0], "methods": {}}
        for part in parts:
            if part.get("eval_split", "test") != parts[0].get("eval_split", "test"):
                raise SystemExit(f"error: the run folders in {run} were scored on different splits; fix: join "
                                 "only folders of one split")
            if part["users"] != parts[0]["users"]:
                raise SystemExit(f"error: the run folders in {run} have different users; fix: join only "
                                 "folders of one recipe and seed")
            joined["methods"].update({m: v for m, v in part["methods"].items() if m not in joined["methods"]})
        summaries.append(joined)
    if len({summary.get("eval_split", "test") for summary in summaries}) > 1:
        raise SystemExit("error: some runs were scored on the validation split and some on the test split "
                         "(summary.json's eval_split); fix: table runs of one split")
    return summaries


def _read_summary(run: Path) -> dict:
    path = run / "summary.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist; fix: pass run folders of finished runs")
    return json.loads(path.read_text(encoding="utf-8"))


def _spread(values: list[float]) -> str:
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{_number(statistics.fmean(values))} ({_number(deviation)})"


def _number(value: float, sign: str = "") -> str:
    """Two decimals, or three significant digits for values that two decimals would show as zero
    (the near-zero test losses of FLoRAL's synthetic tasks)."""
    return f"{value:{sign}.2e}" if value != 0 and abs(value) < 0.005 else f"{value:{sign}.2f}"


def _common_methods(summaries: list[dict]) -> list[str]:
    return [m for m in summaries[0]["methods"] if all(m in s["methods"] for s in summaries)]


def _value_keys(summaries: list[dict]) -> list[str]:
    language = any("mean_in" in m for m in summaries[0]["methods"].values())
    return ["in", "out"] if language else ["score"]


def seed_table(summaries: list[dict]) -> str:
    keys = _value_keys(summaries)
    runs = len(summaries)
    language = keys != ["score"]
    header = ["method", *(f"{k}: mean (std) over {runs} run(s)" for k in keys),
              *(f"{k}: std over users" for k in keys),
              *(f"{k}: NLL s.e. per user" for k in keys if language), "upload / round"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in _common_methods(summaries):
        entries = [s["methods"][method] for s in summaries]
        cells = [_spread([e[f"mean_{k}"] for e in entries]) for k in keys]
        cells += [_number(statistics.fmean(e[f"std_{k}"] for e in entries)) for k in keys]
        if language:
            cells += [_mean_standard_error(entries, k) for k in keys]
        cells.append(format_bytes(statistics.fmean(e["upload_bytes_per_round"] for e in entries)))
        lines.append(f"| {method} | {' | '.join(cells)} |")
    return "\n".join(lines)


def matched_centres(centres: dict[str, float], lower_is_better: bool) -> list[list[float]]:
    """One run's centre-by-source scores as rows per source, the centres reordered so that
    column ``j`` is the centre matched to source ``j`` (the assignment with the best sum of
    matched scores); unmatched centres follow."""
    scores: dict[tuple[int, int], float] = {}
    for key, value in centres.items():
        centre, source = (int(part) for part in CENTRE_KEY.fullmatch(key).groups())
        scores[centre, source] = value
    count_centres = 1 + max(centre for centre, _ in scores)
    count_sources = 1 + max(source for _, source in scores)
    sign = 1.0 if lower_is_better else -1.0
    match = min(itertools.permutations(range(count_centres), count_sources),
                key=lambda order: sign * sum(scores[centre, source] for source, centre in enumerate(order)))
    order = [*match, *(centre for centre in range(count_centres) if centre not in match)]
    return [[scores[centre, source] for centre in order] for source in range(count_sources)]


def centre_table(summaries: list[dict]) -> str:
    """Per clustered method and source: the matched centre's score and the other centres'
    mean, mean (std) over runs, and the runs in which the matched centre is the best."""
    lower = lower_is_better(summaries[0].get("metric", "perplexity"))
    header = ["method", "source", "matched centre", "other centres", "matched centre best"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in _common_methods(summaries):
        if not all("centres" in s["methods"][method] for s in summaries):
            continue
        tables = [matched_centres(s["methods"][method]["centres"], lower) for s in summaries]
        for source in range(len(tables[0])):
            own = [table[source][source] for table in tables]
            others = [statistics.fmean(v for c, v in enumerate(table[source]) if c != source) for table in tables]
            best = sum((min if lower else max)(table[source]) == table[source][source] for table in tables)
            lines.append(f"| {method} | θ_{source} | {_spread(own)} | {_spread(others)} | {best} of {len(tables)} |")
    return "\n".join(lines)


PERSONALISATION_COLUMNS = {"Acc_g": "mean_score_global", "Acc_p": "mean_score",
                           "% clients Acc_p > Acc_g": "benefiting_pct", "global only": "mean_global_only",
                           "personalised only": "mean_personal_only", "both": "mean_both_correct",
                           "neither": "mean_neither_correct"}
PERPLEXITY_PERSONALISATION_COLUMNS = {"ppl_g in": "mean_in_global", "ppl_p in": "mean_in",
                                      "% users ppl_p < ppl_g": "benefiting_pct", "ppl_g out": "mean_out_global",
                                      "ppl_p out": "mean_out"}


def personalisation_table(summaries: list[dict]) -> str:
    """Flow Tables 2–3 over runs: per method with a global and a personalised model, the
    clients' mean Acc_g and Acc_p (eq. 6–7), the % of clients with Acc_p > Acc_g and the
    per-instance breakdown, each mean (std) over runs; on a language model, the perplexities
    of both models in and out of distribution and the % of users whose own perplexity falls."""
    columns = PERPLEXITY_PERSONALISATION_COLUMNS if summaries[0].get("metric") == "perplexity" \
        else PERSONALISATION_COLUMNS
    header = ["method", *columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in _common_methods(summaries):
        entries = [s["methods"][method] for s in summaries]
        if all("benefiting_pct" in e for e in entries):
            cells = [_spread([e[key] for e in entries]) for key in columns.values()]
            lines.append(f"| {method} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _mean_standard_error(entries: list[dict], key: str) -> str:
    errors = [user[f"nll_se_{key}"] for e in entries for user in e["per_user"].values() if f"nll_se_{key}" in user]
    return f"{statistics.fmean(errors):.3f}" if errors else "–"


def paired_differences(summaries: list[dict], method: str, reference: str, key: str) -> list[float]:
    """``method`` against ``reference`` for every (run, user) pair, on the per-user value ``key``:
    ``100·ln(ours / theirs)`` (percent) for perplexities, ``ours − theirs`` for task scores."""
    gap = (lambda ours, theirs: 100.0 * math.log(ours / theirs)) if key in ("in", "out") else \
        (lambda ours, theirs: ours - theirs)
    differences = []
    for summary in summaries:
        ours, theirs = summary["methods"][method]["per_user"], summary["methods"][reference]["per_user"]
        differences += [gap(ours[user][key], theirs[user][key]) for user in summary["users"]]
    return differences


def paired_test(differences: list[float]) -> tuple[float, float, float, float]:
    """Mean difference, its standard error, and the p-values of the paired t-test and
    the Wilcoxon signed-rank test (``nan`` where the pairs cannot decide: fewer than
    two, or all equal)."""
    mean = statistics.fmean(differences)
    if len(differences) < 2 or all(d == differences[0] for d in differences):
        return mean, 0.0, math.nan, math.nan
    standard_error = statistics.stdev(differences) / math.sqrt(len(differences))
    t_p = float(stats.ttest_1samp(differences, 0.0).pvalue)
    wilcoxon_p = float(stats.wilcoxon(differences).pvalue) if any(differences) else math.nan
    return mean, standard_error, t_p, wilcoxon_p


def paired_table(summaries: list[dict], reference: str) -> str:
    if reference not in _common_methods(summaries):
        raise SystemExit(f"error: method '{reference}' is not in every run; "
                         f"fix: use one of {', '.join(_common_methods(summaries))}")
    unit = "%" if _value_keys(summaries) != ["score"] else " points"
    header = ["method", "value", f"mean Δ{unit} vs {reference} (s.e.)", "pairs", "paired t p", "Wilcoxon p",
              "gap larger than noise"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in _common_methods(summaries):
        if method == reference:
            continue
        for key in _value_keys(summaries):
            differences = paired_differences(summaries, method, reference, key)
            mean, error, t_p, wilcoxon_p = paired_test(differences)
            larger = t_p < SIGNIFICANCE and wilcoxon_p < SIGNIFICANCE
            lines.append(f"| {method} | {key} | {_number(mean, '+')} ({_number(error)}) | {len(differences)} | "
                         f"{t_p:.3g} | {wilcoxon_p:.3g} | {'yes' if larger else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("runs", nargs="+", type=Path,
                         help="run folders holding summary.json; A+B joins folders of one seed")
    options.add_argument("--against", metavar="METHOD", help="add the paired comparison against METHOD")
    args = options.parse_args(argv)
    summaries = load_summaries(args.runs)
    if summaries[0].get("eval_split") == "valid":
        print("VALIDATION split (data.eval_split: valid): these are not test figures\n")
    print(seed_table(summaries))
    if any("centres" in m for m in summaries[0]["methods"].values()):
        print()
        print(centre_table(summaries))
    if any("benefiting_pct" in m for m in summaries[0]["methods"].values()):
        print()
        print(personalisation_table(summaries))
    if args.against:
        print()
        print(paired_table(summaries, args.against))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
