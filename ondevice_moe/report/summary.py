"""``summary.json``: each method's final per-user values and their mean (std) over users.

The table follows CoMiGS Table 2: test perplexity per user, and the mean (std)
over users in distribution (each user's own test split) and out of
distribution (the union of all users' test splits).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

from ondevice_moe.metrics import LOWER_IS_BETTER
from ondevice_moe.report.reporter import Reporter


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and population std; ``None`` for both when a value diverged (inf or NaN: no figure to average)."""
    if not all(math.isfinite(value) for value in values):
        return None, None
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float as ``None``, so ``summary.json`` stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(item) for item in value]
    return value


# Evaluation record keys → short names in the summary; a method family adds its own (its Reporter).
VALUE_KEYS = {"test_ppl_in": "in", "test_ppl_out": "out", "score": "score"}
# A round's timing (``round`` records of metrics.jsonl), kept per round in summary.json.
ROUND_KEYS = ("round", "wall_s", "slowest_client_s", "busiest_worker_s", "workers", "overhead", "wire_s")
# Per-user uncertainty kept beside the values in summary.json (not averaged into mean/std).
ERROR_KEYS = {"test_nll_se_in": "nll_se_in", "test_nll_se_out": "nll_se_out"}


def summarize(records: list[dict[str, Any]], methods: list[str], users: list[str], metric: str = "perplexity",
              eval_split: str = "test", reporters: Sequence[Reporter] = ()) -> dict[str, Any]:
    """Final per-user values and their mean (std) over users, for each method that finished.

    Language modelling: ``in`` / ``out`` test perplexity; other tasks: the
    task's ``metric`` as ``score`` (×100 for fractions such as accuracy, as it
    is for errors such as MSE). ``dropped``: how often each user's device was
    dropped from a round (it raised, timed out or sent a rejected update). ``privacy``:
    each round's clip norm, noise, clipped updates, largest pre-clip norm and (ε, δ) so far (recipe
    ``privacy``); ``privacy_spent``: the last round's (ε, δ), ε null without noise, and ``uploads``, the
    most rounds one device took part in.
    ``round_overhead`` (beside ``methods``: timings differ between runs that agree on every result):
    per method, each round's wall time, slowest client, busiest worker and overhead.
    ``eval_split``: the split the language-modelling values were scored on (``data.eval_split``):
    ``test``, or ``valid`` for a run that chooses a setting (the values then are not test figures).
    ``reporters``: the method families' own values, fields and rows (:mod:`.reporter`).
    """
    values = partial(_values, reporters=reporters)
    summary: dict[str, Any] = {"users": users, "metric": metric, "eval_split": eval_split, "methods": {}}
    for method in methods:
        evals = [r for r in records if r["method"] == method and r["kind"] == "eval"]
        if not evals:
            continue
        last_round = max(r["round"] for r in evals)
        final = {r["user"]: r for r in evals if r["round"] == last_round}
        evaluated = [user for user in users if user in final]  # a device lost before the end has no figures
        if not evaluated:
            continue
        comm = [r for r in records if r["method"] == method and r["kind"] == "comm"]
        entry: dict[str, Any] = {"rounds": last_round, **values(final, evaluated)}
        if len(evaluated) < len(users):
            entry["not_evaluated"] = [user for user in users if user not in final]
        entry["upload_bytes_per_round"] = statistics.fmean(r["bytes_up"] for r in comm) if comm else 0.0
        # Tensors outside experts and routers: the task head (pooler, classifier), or the base for fed-ft.
        entry["upload_outside_experts_bytes_per_round"] = (
            statistics.fmean(r.get("bytes_up_not_experts", 0) for r in comm) if comm else 0.0)
        entry["download_bytes_per_round"] = statistics.fmean(r["bytes_down"] for r in comm) if comm else 0.0
        entry["dropped"] = dict(Counter(r["user"] for r in records if r["method"] == method and r["kind"] == "drop"))
        refused = list(dict.fromkeys(r["reason"] for r in records if r["method"] == method and r["kind"] == "refused"))
        if refused:  # nodes that claimed a slot they may not hold (docs/deployment.md)
            entry["refused"] = refused
        resumed = [r["round"] for r in records if r["method"] == method and r["kind"] == "resume"]
        if resumed:  # a run on real devices continued after these rounds (a crash or a stop in between)
            entry["continued_after"] = resumed
        privacy = [r for r in records if r["method"] == method and r["kind"] == "privacy"]
        if privacy:
            entry["privacy"] = [{key: r[key] for key in ("round", "clip_norm", "noise_multiplier", "noise_std",
                                                         "devices", "clipped")}
                                | {"max_update_norm": max(r["update_norms"].values(), default=0.0)}
                                | {key: r[key] for key in ("epsilon", "delta", "uploads") if key in r}  # older: none
                                for r in sorted(privacy, key=lambda r: r["round"])]
            if "delta" in entry["privacy"][-1]:
                entry["privacy_spent"] = {key: entry["privacy"][-1][key] for key in ("epsilon", "delta", "uploads")}
        for reporter in reporters:
            entry.update(reporter.entry_fields(final, evaluated))
        summary["methods"][method] = entry
        for reporter in reporters:
            summary["methods"].update(reporter.extra_methods(method, entry, final, evaluated, values))
    timing = {method: sorted(({key: r.get(key) for key in ROUND_KEYS} for r in records
                              if r["method"] == method and r["kind"] == "round"), key=lambda r: r["round"])
              for method in summary["methods"]}
    summary["round_overhead"] = {method: rows for method, rows in timing.items() if rows}
    return summary


def _values(final: dict[str, dict[str, Any]], users: list[str], reporters: Sequence[Reporter] = ()
            ) -> dict[str, Any]:
    """Each user's final values by short name (``VALUE_KEYS``, the reporters' ``value_keys``,
    ``ERROR_KEYS``), their mean and std over users, and the users whose values diverged."""
    known = {**VALUE_KEYS, **{key: short for reporter in reporters for key, short in reporter.value_keys.items()}}
    keys = {key: short for key, short in known.items() if key in final[users[0]]}
    values: dict[str, Any] = {
        "per_user": {u: {**{short: final[u][key] for key, short in keys.items()},
                         **{short: final[u][key] for key, short in ERROR_KEYS.items() if key in final[u]}}
                     for u in users}}
    for key, short in keys.items():
        values[f"mean_{short}"], values[f"std_{short}"] = _mean_std([final[u][key] for u in users])
    diverged = [u for u in users if not all(math.isfinite(final[u][key]) for key in keys)]
    if diverged:
        values["diverged"] = diverged
    return values


NOT_MEASURED = "not measured"
DIVERGED = "diverged"  # a user's figure is inf or NaN: training blew up (see the `diverged` users in summary.json)


def table_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the results table (per-user values, mean (std), upload per round)."""
    users = summary["users"]
    methods = summary["methods"]
    language = any("mean_in" in m for m in methods.values())
    shorts = ["in", "out"] if language else ["score"]
    labels = ["mean (std) in-dist", "mean (std) out-of-dist"] if language else ["mean (std)"]
    per_user = shorts[0]
    outside = any(m.get("upload_outside_experts_bytes_per_round", 0) > 0 for m in methods.values())
    header = ["method", *users, *labels, "upload / round (all devices)"]
    header += ["of which head (or base)"] if outside else []
    rows = []
    for name, m in methods.items():
        cells = [NOT_MEASURED if f"mean_{short}" not in m else DIVERGED if m[f"mean_{short}"] is None
                 else f"{m[f'mean_{short}']:.2f} ({m[f'std_{short}']:.2f})" for short in shorts]
        row = [name, *(f"{m['per_user'][u][per_user]:.2f}" if u in m["per_user"] else NOT_MEASURED for u in users),
               *cells,
               format_bytes(m["upload_bytes_per_round"])]
        row += [format_bytes(m.get("upload_outside_experts_bytes_per_round", 0))] if outside else []
        rows.append(row)
    return header, rows


def format_bytes(count: float) -> str:
    """``count`` bytes as B, KiB, MiB or GiB."""
    if count < 1024:
        return f"{count:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        count /= 1024
        if count < 1024 or unit == "GiB":
            break
    return f"{count:.1f} {unit}"


def score_title(summary: dict[str, Any]) -> str:
    """What the table's numbers are, and which way is better."""
    metric = summary.get("metric", "perplexity")
    scaled = metric if metric == "perplexity" or metric in LOWER_IS_BETTER else f"{metric} ×100"
    better = "lower" if metric == "perplexity" or metric in LOWER_IS_BETTER else "higher"
    if summary.get("eval_split") == "valid":
        section = "data" if metric == "perplexity" else "task"
        return (f"VALIDATION {scaled} ({section}.eval_split: valid), not test {metric}, after the last round "
                f"({better} is better)")
    return f"Test {scaled} after the last round ({better} is better)"
