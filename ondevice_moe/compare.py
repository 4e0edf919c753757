"""Runs compared (``ondevice-moe compare``): a per-method table over several runs (seeds), as in
CoMiGS Table 2 and Hermes Table 1, and a paired comparison of every method against one of them.

Each run is a run folder with a ``summary.json``, or several folders of one seed joined by ``+``
(``runs/base-s0+runs/ablations-s0``: their methods side by side). A folder ending ``@LABEL`` has its
methods named ``<method>@LABEL`` (``runs/a-s0+runs/b-s0@32-steps``: FedAvg of two recipes side by
side). Where two joined folders hold one method name, the folder named first gives it (a method
swept at its own rate, joined before the study that also ran it at the shared rate), and the
output says which folder's copy was left out.

For every method found in all runs the table holds, over runs, the mean (std) of the users' mean
value — test perplexity in and out of distribution for language modelling, the task score for
classification — its mean std over users, and the upload per round.

A method family may add tables of its own (its reporter, :mod:`ondevice_moe.report.reporter`): the
centre-by-source table of clustered methods, the global and personalised models of methods that
have both.

For language modelling the table also holds the standard error of each user's mean test NLL over
the test blocks (mean over users and runs): a 1 % perplexity gap is a NLL gap of 0.01, so one run
resolves it only when this is well under 0.01.

The paired comparison against a reference method tests at the unit that is independent: the run
(seed). Per run, the method's per-user gap to the reference — for perplexities the relative gap
``100·ln(ppl / ppl_reference)`` in percent (users' perplexities differ by a factor of three, so raw
differences would weigh the hardest user most), for task scores the difference in points — is
averaged over the run's users; the runs' gaps are then paired by run: their mean and standard
error, and the two-sided p-values of a paired t-test and of a Wilcoxon signed-rank test over the
n runs. The users of one run share its global model, its training noise and its data partition,
so they are not independent draws: the (run, user) pairs are shown beside, as description only. A
gap counts as larger than its noise when the t-test's p < 0.05 and, from six runs on, the
Wilcoxon test's too; below six runs the Wilcoxon test cannot reach 0.05 (its smallest two-sided p
is 2/2ⁿ), and the table says so. Where the runs share one data partition (their recipes pin
``data_seed``), n counts training seeds only, and the table says that too. A user whose either
value diverged (no finite figure) is left out of its run's mean.

With ``per_round`` both tables follow the training: each round that every run evaluated is read
from the folders' ``metrics.jsonl`` (its ``eval`` records, and the uploads up to that round) and
summarised as if the run had stopped there, so a method that learns faster and one that only ends
higher can be told apart (Hermes' ablations at ten local epochs, docs/results/hermes.md).
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scipy import stats

from ondevice_moe.errors import UserError
from ondevice_moe.methods.registry import reporters
from ondevice_moe.metrics import LOWER_IS_BETTER
from ondevice_moe.report import DIVERGED, CorruptLog, MetricsLog, format_bytes, summarize
from ondevice_moe.report.across_runs import common_methods, is_number, number, spread

SIGNIFICANCE = 0.05
SHADOWED = "left_out"  # a joined summary's lines naming the methods an earlier folder of its ``A+B`` gave
SUMMARY_FIX = "pass run folders of finished `ondevice-moe finetune` runs (run the same command again to rewrite " \
              "a damaged summary.json)"
LOG_FIX = "pass run folders whose metrics.jsonl `ondevice-moe finetune` wrote, or leave out --per-round"


def comparison(runs: list[Path], against: str | None = None, per_round: bool = False) -> str:
    """Every table for ``runs`` (see the module docstring), as Markdown; ``against``: the paired
    comparison's reference method; ``per_round``: also the values after every evaluated round."""
    summaries = load_summaries(runs)
    parts = [seed_table(summaries), *(line for summary in summaries for line in summary[SHADOWED])]
    if summaries[0].get("eval_split") == "valid":
        parts.insert(0, "VALIDATION split (eval_split: valid): these are not test figures")
    for reporter in reporters():
        parts += reporter.compare_tables(summaries)
    if against is not None:
        parts.append(paired_table(summaries, against))
    if per_round:
        parts.append(round_tables(runs, summaries, against))
    return "\n\n".join(parts)


def load_summaries(runs: list[Path]) -> list[dict[str, Any]]:
    """One summary per run; ``A+B`` joins the methods of run folders of one seed (the same users)."""
    summaries = _joined_summaries(runs)
    if not common_methods(summaries):
        raise UserError("no method is in every run", "compare runs that share a method")
    return summaries


def _joined_summaries(runs: list[Path], read: Callable[[Path], dict[str, Any]] | None = None
                      ) -> list[dict[str, Any]]:
    """:func:`load_summaries` without its check for a shared method; ``read``: a folder's summary
    (its ``summary.json`` where not given; a round's, in :func:`round_tables`)."""
    if not runs:
        raise UserError("no run to compare", "pass one run folder or more")
    summaries = []
    for run in runs:
        folders = str(run).split("+")
        parts = [_labelled_summary(folder, read or _read_summary) for folder in folders]
        joined = {**parts[0], "methods": {}, SHADOWED: []}
        given_by: dict[str, str] = {}
        for folder, part in zip(folders, parts, strict=True):
            if part.get("eval_split", "test") != parts[0].get("eval_split", "test"):
                raise UserError(f"the run folders in {run} were scored on different splits",
                                "join only folders of one split")
            if part["users"] != parts[0]["users"]:
                raise UserError(f"the run folders in {run} have different users",
                                "join only folders of one recipe and seed")
            for method, entry in part["methods"].items():
                if method in given_by:
                    joined[SHADOWED].append(f"{method}: from {given_by[method]}; its copy in {folder} is left out "
                                            f"(label that folder, {folder}@LABEL, to keep both)")
                else:
                    given_by[method] = folder
                    joined["methods"][method] = entry
        summaries.append(joined)
    if len({summary.get("eval_split", "test") for summary in summaries}) > 1:
        raise UserError("some runs were scored on the validation split and some on the test split "
                        "(summary.json's eval_split)", "compare runs of one split")
    return summaries


def _labelled_summary(part: str, read: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """A joined folder's summary as ``read`` gives it; ``FOLDER@LABEL`` (where no folder of that
    whole name exists) names its methods ``<method>@LABEL``."""
    folder, label = _folder_and_label(part)
    summary = read(folder)
    if not label:
        return summary
    return {**summary, "methods": {f"{method}@{label}": entry for method, entry in summary["methods"].items()}}


def _folder_and_label(part: str) -> tuple[Path, str]:
    """``FOLDER@LABEL`` split into the folder and its label (no label where a folder of the whole name exists)."""
    folder, _, label = part.rpartition("@")
    if not folder or not label or Path(part).exists():
        return Path(part), ""
    return Path(folder), label


def _summary_at_round(run: Path, at_round: int, summary: dict[str, Any], logged: list[dict[str, Any]]
                      ) -> dict[str, Any]:
    """The summary ``run`` would have written had it stopped after ``at_round``: ``logged`` (its
    ``metrics.jsonl``) up to that round, only that round's evaluations, summarised as ``finetune``
    does; ``summary``: its ``summary.json`` (the methods, users and metric)."""
    records = [record for record in logged
               if (record.get("round") == at_round if record["kind"] == "eval"
                   else not isinstance(record.get("round"), int) or record["round"] <= at_round)]
    try:
        at = summarize(records, list(summary["methods"]), summary["users"], summary.get("metric", "perplexity"),
                       summary.get("eval_split", "test"), reporters())
    except (KeyError, TypeError, ValueError, statistics.StatisticsError) as error:
        raise UserError(f"{run / 'metrics.jsonl'} has a record unlike those finetune writes ({error!r})",
                        LOG_FIX) from None
    problem = _shape_problem(at)
    if problem:
        raise UserError(f"{run / 'metrics.jsonl'} round {at_round} does not summarise: {problem}", LOG_FIX)
    return at


def _read_records(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{path} does not exist", LOG_FIX)
    try:
        return MetricsLog(path).read()
    except (OSError, CorruptLog) as error:
        raise UserError(f"cannot read {path} ({error})", LOG_FIX) from None


def _read_summary(run: Path) -> dict[str, Any]:
    """A run folder's ``summary.json``, checked to hold what the tables read; anything else is a UserError."""
    path = run / "summary.json"
    if not path.is_file():
        raise UserError(f"{path} does not exist", SUMMARY_FIX)
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:  # ValueError: not UTF-8, or not JSON
        raise UserError(f"cannot read {path} ({error})", SUMMARY_FIX) from None
    problem = _shape_problem(summary)
    if problem:
        raise UserError(f"{path} is not a run summary: {problem}", SUMMARY_FIX)
    return summary


def _shape_problem(summary: object) -> str | None:
    """What in ``summary`` does not have the shape the tables read, or ``None``."""
    if not isinstance(summary, dict):
        return "not a JSON object"
    users, methods = summary.get("users"), summary.get("methods")
    if not (isinstance(users, list) and all(isinstance(user, str) for user in users)):
        return "'users' is not a list of names"
    if not (isinstance(methods, dict) and all(isinstance(entry, dict) for entry in methods.values())):
        return "'methods' is not an object of methods"
    families = reporters()
    for name, entry in methods.items():
        per_user = entry.get("per_user", {})
        if not (isinstance(per_user, dict) and all(isinstance(values, dict) for values in per_user.values())):
            return f"method '{name}' has per_user values that are not objects"
        figures = [*(value for key, value in entry.items() if key.startswith(("mean_", "std_"))),
                   *(value for values in per_user.values() for value in values.values())]
        if not all(value is None or is_number(value) for value in figures):  # None: diverged
            return f"method '{name}' holds a value that is neither a number nor null"
        if not is_number(entry.get("upload_bytes_per_round", 0.0)):
            return f"method '{name}' has an upload that is not a number"
        problem = next(filter(None, (reporter.entry_problem(name, entry) for reporter in families)), None)
        if problem:
            return problem
    return None


def _value_keys(summaries: list[dict[str, Any]]) -> list[str]:
    """The values every method of every run has: ``in`` (and ``out``, off a single device) or ``score``."""
    entries = [s["methods"][m] for s in summaries for m in common_methods(summaries)]
    return [key for key in ("in", "out", "score") if all(f"mean_{key}" in entry for entry in entries)]


def _paired_keys(summaries: list[dict[str, Any]], method: str, reference: str) -> list[str]:
    """The values ``method`` is tested on against ``reference``: those of :func:`_value_keys`, then each
    family's ``compared`` values that both hold in every run (FedSoft's w̄ on training data, Flow's Acc_g)."""
    entries = [s["methods"][name] for s in summaries for name in (method, reference)]
    extra = [key for reporter in reporters() for key in reporter.compared
             if all(entry.get(f"mean_{key}") is not None for entry in entries)]
    return [*_value_keys(summaries), *extra]


def seed_table(summaries: list[dict[str, Any]]) -> str:
    """Per method: the users' mean value, mean (std) over runs, its std over users, the NLL's standard
    error per user (language modelling), and the upload per round."""
    keys = _value_keys(summaries)
    runs = len(summaries)
    language = "score" not in keys
    header = ["method", *(f"{k}: mean (std) over {runs} run(s)" for k in keys),
              *(f"{k}: std over users" for k in keys),
              *(f"{k}: NLL s.e. per user" for k in keys if language), "upload / round"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in common_methods(summaries):
        entries = [s["methods"][method] for s in summaries]
        cells = [spread([e[f"mean_{k}"] for e in entries]) for k in keys]
        cells += [_mean_or_diverged([e[f"std_{k}"] for e in entries]) for k in keys]
        if language:
            cells += [_mean_standard_error(entries, k) for k in keys]
        cells.append(format_bytes(statistics.fmean(e.get("upload_bytes_per_round", 0.0) for e in entries)))
        lines.append(f"| {method} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _mean_or_diverged(values: list[float | None]) -> str:
    return DIVERGED if any(value is None for value in values) else number(statistics.fmean(values))


def _mean_standard_error(entries: list[dict[str, Any]], key: str) -> str:
    errors = [user[f"nll_se_{key}"] for e in entries for user in e["per_user"].values()
              if user.get(f"nll_se_{key}") is not None]
    return f"{statistics.fmean(errors):.3f}" if errors else "–"


def paired_differences(summaries: list[dict[str, Any]], method: str, reference: str, key: str) -> list[float]:
    """``method`` against ``reference`` for every (run, user) pair with both values, on the per-user value
    ``key``: ``100·ln(ours / theirs)`` (percent) for perplexities, ``ours − theirs`` for task scores."""
    return [gap for run in run_differences(summaries, method, reference, key) for gap in run]


def run_differences(summaries: list[dict[str, Any]], method: str, reference: str, key: str) -> list[list[float]]:
    """Per run, the per-user gaps of :func:`paired_differences` (a run without a pair gives an empty list)."""
    perplexity = key in ("in", "out") or summaries[0].get("metric", "perplexity") == "perplexity"
    runs = []
    for summary in summaries:
        ours, theirs = summary["methods"][method]["per_user"], summary["methods"][reference]["per_user"]
        gaps = []
        for user in summary["users"]:
            mine, other = ours.get(user, {}).get(key), theirs.get(user, {}).get(key)
            if mine is None or other is None or (perplexity and min(mine, other) <= 0):
                continue  # not evaluated, or diverged
            gaps.append(100.0 * math.log(mine / other) if perplexity else mine - other)
        runs.append(gaps)
    return runs


def seed_differences(summaries: list[dict[str, Any]], method: str, reference: str, key: str) -> list[float]:
    """Per run (seed) with a pair, the mean over its users of the per-user gaps: the test's unit."""
    return [statistics.fmean(gaps) for gaps in run_differences(summaries, method, reference, key) if gaps]


def paired_test(differences: list[float]) -> tuple[float, float, float, float]:
    """Mean difference, its standard error, and the p-values of the paired t-test and
    the Wilcoxon signed-rank test (``nan`` where the pairs cannot decide: fewer than
    two, or all equal; the mean is ``nan`` without pairs)."""
    if not differences:
        return math.nan, math.nan, math.nan, math.nan
    mean = statistics.fmean(differences)
    if len(differences) < 2 or all(d == differences[0] for d in differences):
        return mean, 0.0, math.nan, math.nan
    standard_error = statistics.stdev(differences) / math.sqrt(len(differences))
    t_p = float(stats.ttest_1samp(differences, 0.0).pvalue)
    wilcoxon_p = float(stats.wilcoxon(differences).pvalue) if any(differences) else math.nan
    return mean, standard_error, t_p, wilcoxon_p


WILCOXON_RESOLVES = 6  # runs from which a two-sided Wilcoxon signed-rank test can reach p < 0.05 (2/2⁶ = 0.031)


def larger_than_noise(t_p: float, wilcoxon_p: float, runs: int) -> bool:
    """The decision rule: the t-test's p below :data:`SIGNIFICANCE`, and the Wilcoxon test's too where it can be."""
    return t_p < SIGNIFICANCE and (wilcoxon_p < SIGNIFICANCE or runs < WILCOXON_RESOLVES)


def unit_note(summaries: list[dict[str, Any]]) -> str:
    """What the paired test's unit and n are, and what they cannot show."""
    runs = len(summaries)
    note = (f"Paired test at the run (seed) level: n = {runs} run(s), each the mean over its users of the per-user "
            "gap; the users of one run share its global model and data, so the (run, user) pairs are description "
            "only.")
    if runs < 2:
        note += " One run: no test is possible; compare several seeds."
    elif runs < WILCOXON_RESOLVES:
        note += (f" With {runs} runs the Wilcoxon test's smallest p is {2 / 2 ** runs:.3g}: it cannot reach "
                 f"{SIGNIFICANCE} below {WILCOXON_RESOLVES} runs, so the t-test decides alone.")
    partitions = {summary.get("split_seed") for summary in summaries}
    if runs > 1 and len(partitions) == 1 and None not in partitions:
        note += (f" These runs share one data partition (data_seed {partitions.pop()}): n counts training seeds "
                 "only, and the partition's own variation is not in the test.")
    return note


def _gap_unit(summaries: list[dict[str, Any]]) -> str:
    """What a gap is measured in: percent of perplexity, points of a score scaled ×100 (accuracy, F1,
    ...), or the error itself (MSE), which the evaluation leaves unscaled."""
    if "score" not in _value_keys(summaries):
        return "%"
    metric = summaries[0].get("metric", "")
    return f" {metric.upper()}" if metric in LOWER_IS_BETTER else " points"


def paired_table(summaries: list[dict[str, Any]], reference: str) -> str:
    """Every other method against ``reference``, per value: the seed-level paired gap, the runs, both
    tests and the verdict, and the (run, user) pairs as description."""
    if reference not in common_methods(summaries):
        raise UserError(f"method '{reference}' is not in every run",
                        f"use one of {', '.join(common_methods(summaries))}")
    unit = _gap_unit(summaries)
    header = ["method", "value", f"mean Δ{unit} vs {reference} (s.e.), over runs", "runs", "paired t p",
              "Wilcoxon p", "gap larger than noise", "(run, user) pairs: mean Δ (s.e.), n"]
    lines = [unit_note(summaries), "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in common_methods(summaries):
        if method == reference:
            continue
        for key in _paired_keys(summaries, method, reference):
            seeds = seed_differences(summaries, method, reference, key)
            mean, error, t_p, wilcoxon_p = paired_test(seeds)
            pairs = paired_differences(summaries, method, reference, key)
            pair_mean, pair_error, _, _ = paired_test(pairs)
            larger = larger_than_noise(t_p, wilcoxon_p, len(seeds))
            lines.append(f"| {method} | {key} | {number(mean, '+')} ({number(error)}) | {len(seeds)} | "
                         f"{t_p:.3g} | {wilcoxon_p:.3g} | {'yes' if larger else 'no'} | "
                         f"{number(pair_mean, '+')} ({number(pair_error)}), {len(pairs)} |")
    return "\n".join(lines)


def evaluated_rounds(runs: list[Path], read_records: Callable[[Path], list[dict[str, Any]]] = _read_records
                     ) -> list[int]:
    """The rounds with evaluations in every run (in any of a joined run's folders)."""
    rounds: set[int] | None = None
    for run in runs:
        folders = [_folder_and_label(part)[0] for part in str(run).split("+")]
        evaluated = {record["round"] for folder in folders for record in read_records(folder)
                     if record["kind"] == "eval" and isinstance(record.get("round"), int)
                     and not isinstance(record["round"], bool)}
        rounds = evaluated if rounds is None else rounds & evaluated
    return sorted(rounds or ())


def round_tables(runs: list[Path], final: list[dict[str, Any]], reference: str | None) -> str:
    """The methods of ``final`` (the runs' summaries) after every round that every run evaluated:
    the users' mean value, mean (std) over runs, and with ``reference`` the paired gap (s.e.) with
    its t-test and Wilcoxon p-values, in bold where both are below :data:`SIGNIFICANCE`; "–" where
    a method was not evaluated that round."""
    summary_of, records_of = functools.cache(_read_summary), functools.cache(_read_records)  # each file read once
    rounds = evaluated_rounds(runs, records_of)
    if not rounds:
        return "Per round: no round was evaluated in every run (metrics.jsonl has no common eval round)"
    by_round = {r: _joined_summaries(runs, lambda folder, r=r: _summary_at_round(folder, r, summary_of(folder),
                                                                                  records_of(folder)))
                for r in rounds}
    methods, keys = common_methods(final), _value_keys(final)
    header = ["method", "value", *(f"round {r}" for r in rounds)]
    rule = "|" + "---|" * len(header)
    values = [f"Per round: mean (std) over {len(runs)} run(s)", "", "| " + " | ".join(header) + " |", rule]
    gaps = [f"Per round: mean Δ vs {reference} (s.e.) over runs, paired t p / Wilcoxon p; bold where the gap is "
            f"larger than its noise. {unit_note(final)}", "", "| " + " | ".join(header) + " |", rule]
    for method in methods:
        for key in keys:
            cells, gap_cells = [], []
            for r in rounds:
                summaries = by_round[r]
                present = method in common_methods(summaries)
                cells.append(spread([s["methods"][method].get(f"mean_{key}") for s in summaries]) if present
                             else "–")
                if reference is not None and method != reference:
                    gap_cells.append(_round_gap(summaries, method, reference, key) if present else "–")
            values.append(f"| {method} | {key} | {' | '.join(cells)} |")
            if gap_cells:
                gaps.append(f"| {method} | {key} | {' | '.join(gap_cells)} |")
    return "\n".join(values) + ("\n\n" + "\n".join(gaps) if reference is not None else "")


def _round_gap(summaries: list[dict[str, Any]], method: str, reference: str, key: str) -> str:
    if reference not in common_methods(summaries):
        return "–"
    seeds = seed_differences(summaries, method, reference, key)
    mean, error, t_p, wilcoxon_p = paired_test(seeds)
    gap = f"{number(mean, '+')} ({number(error)})"
    if larger_than_noise(t_p, wilcoxon_p, len(seeds)):
        gap = f"**{gap}**"
    return f"{gap}, {t_p:.2g} / {wilcoxon_p:.2g}"


__all__ = ["comparison", "evaluated_rounds", "larger_than_noise", "load_summaries",
           "paired_differences", "paired_table", "paired_test", "round_tables", "run_differences", "seed_differences",
           "seed_table", "unit_note"]
