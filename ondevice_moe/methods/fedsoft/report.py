"""What FedSoft's family (FedSoft, IFCA, FedEM) adds to a run's summary, report and comparison.

* **Centres on every source** (Tables 1, 3 and 7): device 0 scores every centre on every source's
  held-out set (``procedure.centre_scores``); the summary keeps them as ``centres``
  (``centre_<s>_source_<j>``), the report prints them as a table per method, the best centre of a
  source in bold, and ``compare`` matches each source to a centre in every run (centre indices are
  arbitrary, Table 1's "center indices are assigned randomly") before averaging.
* **Local models on their training data** (§5: w̄ of Tables 3 and 8): ``score_train`` /
  ``train_in`` beside the test figures.
* **FedEM's own prediction** (``<method>-mixture``): each client's π-mixture of the centres'
  outputs, a row of its own beside FedEM's centre of largest π.
"""

from __future__ import annotations

import itertools
import re
import statistics
from types import MappingProxyType
from typing import Any

from ondevice_moe.errors import UserError
from ondevice_moe.methods.fedsoft.prediction import MIXTURE_SUFFIX
from ondevice_moe.metrics import lower_is_better
from ondevice_moe.report.across_runs import common_methods, is_number, spread
from ondevice_moe.report.reporter import Records, Reporter, Values

CENTRE_KEY = re.compile(r"centre_(\d+)_source_(\d+)")
MIXTURE_ROW = "-mixture"


class CentresReporter(Reporter):
    """FedSoft's, IFCA's and FedEM's figures (module docstring)."""

    value_keys = MappingProxyType({"score_train": "score_train", "train_ppl_in": "train_in"})
    compared = ("score_train", "train_in")

    def entry_fields(self, final: Records, users: list[str]) -> dict[str, Any]:
        centres = {key: value for key, value in final[users[0]].items() if CENTRE_KEY.fullmatch(key)}
        return {"centres": centres} if centres else {}

    def extra_methods(self, name: str, entry: dict[str, Any], final: Records, users: list[str],
                      values: Values) -> dict[str, dict[str, Any]]:
        mixed = {u: {key.removesuffix(MIXTURE_SUFFIX): value for key, value in final[u].items()
                     if key.endswith(MIXTURE_SUFFIX)} for u in users}
        if not mixed[users[0]]:
            return {}
        shared = {key: value for key, value in entry.items()  # the run's figures, not the centre's values
                  if key not in ("centres", "per_user", "diverged") and not key.startswith(("mean_", "std_"))}
        return {name + MIXTURE_ROW: {**shared, **values(mixed, users)}}

    def sections(self, summary: dict[str, Any]) -> list[str]:
        return [*_mixture_note(summary), *_centres_section(summary), *_training_fit_section(summary)]

    def compare_tables(self, summaries: list[dict[str, Any]]) -> list[str]:
        if any("centres" in m for m in summaries[0]["methods"].values()):
            return [compared_centres(summaries)]
        return []

    def entry_problem(self, name: str, entry: dict[str, Any]) -> str | None:
        centres = entry.get("centres") or {}
        if not (isinstance(centres, dict) and all(isinstance(key, str) and CENTRE_KEY.fullmatch(key)
                                                  for key in centres)):
            return f"method '{name}' names a centre other than centre_<i>_source_<j>"
        if not all(value is None or is_number(value) for value in centres.values()):
            return f"method '{name}' holds a value that is neither a number nor null"
        return None


def centre_table(centres: dict[str, float], lower_is_better: bool) -> str:
    """A method's centres on each source's test set as markdown: a row per source ``θ_j``,
    a column per centre ``c_s`` (FedSoft Tables 1 and 3); the best centre per row in bold."""
    cells: dict[int, dict[int, float]] = {}
    for key, value in centres.items():
        centre, source = (int(part) for part in CENTRE_KEY.fullmatch(key).groups())
        cells.setdefault(source, {})[centre] = value
    columns = sorted({centre for row in cells.values() for centre in row})
    lines = ["| source | " + " | ".join(f"c_{c}" for c in columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for source, row in sorted(cells.items()):
        values = [row[c] for c in columns]
        best = min(values) if lower_is_better else max(values)
        lines.append(f"| θ_{source} | " + " | ".join(f"**{v:.2f}**" if v == best else f"{v:.2f}" for v in values)
                     + " |")
    return "\n".join(lines)


def _mixture_note(summary: dict[str, Any]) -> list[str]:
    """What a ``<method>-mixture`` row is, when the table has one (FedEM)."""
    mixtures = [name for name in summary["methods"] if name.endswith(MIXTURE_ROW)]
    if not mixtures:
        return []
    return [f"`{name}`: {name.removesuffix(MIXTURE_ROW)}'s own prediction, each client's π-mixture of the centres' "
            f"outputs (Marfoq et al. 2021); `{name.removesuffix(MIXTURE_ROW)}`: its centre of largest π (FedSoft §5)."
            for name in mixtures] + [""]


def _centres_section(summary: dict[str, Any]) -> list[str]:
    """Each clustered method's centre-by-source table, when a method has centres."""
    lower = lower_is_better(summary.get("metric", "perplexity"))
    lines = []
    for name, method in summary["methods"].items():
        if "centres" in method:
            lines += [f"**{name}**: each centre (column) on each source's test set (row).", "",
                      centre_table(method["centres"], lower), ""]
    return lines


def _training_fit_section(summary: dict[str, Any]) -> list[str]:
    """Each local model on its device's own training data beside its test figure (FedSoft §5 scores
    local models on the clients' training data: w̄ of Tables 3 and 8)."""
    rows = []
    for name, method in summary["methods"].items():
        for train, test in (("score_train", "score"), ("train_in", "in")):
            if method.get(f"mean_{train}") is not None and method.get(f"mean_{test}") is not None:
                rows.append(f"| {name} | {method[f'mean_{test}']:.2f} ({method[f'std_{test}']:.2f}) | "
                            f"{method[f'mean_{train}']:.2f} ({method[f'std_{train}']:.2f}) |")
    if not rows:
        return []
    return ["Each client's local model on its test split and on its own training data (FedSoft §5 scores local "
            "models on the training data: w̄), mean (std) over clients:", "",
            "| method | test | training data (w̄) |", "|---|---|---|", *rows, ""]


def matched_centres(centres: dict[str, float], lower_is_better: bool) -> list[list[float]]:
    """One run's centre-by-source scores as rows per source, the centres reordered so that
    column ``j`` is the centre matched to source ``j`` (the assignment with the best sum of
    matched scores); unmatched centres follow."""
    scores: dict[tuple[int, int], float] = {}
    for key, value in centres.items():
        centre, source = (int(part) for part in CENTRE_KEY.fullmatch(key).groups())
        scores[centre, source] = value
    centre_ids = sorted({centre for centre, _ in scores})
    count_sources = 1 + max(source for _, source in scores)
    if len(scores) != len(centre_ids) * count_sources or len(centre_ids) < count_sources or None in scores.values():
        raise UserError(f"the centre-by-source scores {sorted(centres)} are incomplete or diverged",
                        "compare runs whose summary.json scores every centre on every source")
    sign = 1.0 if lower_is_better else -1.0
    match = min(itertools.permutations(centre_ids, count_sources),
                key=lambda order: sign * sum(scores[centre, source] for source, centre in enumerate(order)))
    order = [*match, *(centre for centre in centre_ids if centre not in match)]
    return [[scores[centre, source] for centre in order] for source in range(count_sources)]


def compared_centres(summaries: list[dict[str, Any]]) -> str:
    """Per clustered method and source: the matched centre's score and the other centres'
    mean, mean (std) over runs, and the runs in which the matched centre is the best."""
    lower = lower_is_better(summaries[0].get("metric", "perplexity"))
    header = ["method", "source", "matched centre", "other centres", "matched centre best"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in common_methods(summaries):
        if not all(s["methods"][method].get("centres") for s in summaries):
            continue
        tables = [matched_centres(s["methods"][method]["centres"], lower) for s in summaries]
        if len({len(table) for table in tables}) > 1:
            raise UserError(f"the runs of '{method}' have different numbers of sources", "compare runs of one recipe")
        for source in range(len(tables[0])):
            own = [table[source][source] for table in tables]
            others = [statistics.fmean(v for c, v in enumerate(table[source]) if c != source) for table in tables]
            best = sum((min if lower else max)(table[source]) == table[source][source] for table in tables)
            lines.append(f"| {method} | θ_{source} | {spread(own)} | {spread(others)} | {best} of {len(tables)} |")
    return "\n".join(lines)


REPORTER = CentresReporter()
