"""What a run leaves behind: ``metrics.jsonl``, ``summary.json``, ``report.md`` and plots.

The table follows CoMiGS Table 2: test perplexity per user, and the mean (std)
over users in distribution (each user's own test split) and out of
distribution (the union of all users' test splits).
"""

from __future__ import annotations

import io
import json
import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ondevice_moe.metrics import LOWER_IS_BETTER, lower_is_better
from ondevice_moe.names import MIXTURE_SUFFIX, markdown_cell
from ondevice_moe.safe_files import append_handle, write_bytes, write_text


class CorruptLog(ValueError):
    """``metrics.jsonl`` holds something other than JSON records (not just a line cut short)."""


class MetricsLog:
    """Append-only JSON-lines log; each record is one flat dict with a ``kind``.

    A run killed mid-write can leave its last line cut short (no newline):
    :meth:`read` ignores it and :meth:`repair` removes it. Anything else that
    is not a record raises :class:`CorruptLog`.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        with append_handle(self.path) as handle:  # never through a link planted in its place
            handle.write(json.dumps(record, sort_keys=True) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        if not self.path.is_file():  # a FIFO would block the reader, a folder cannot be read
            raise CorruptLog(f"{self.path} is not a regular file")
        try:
            lines = self.path.read_text(encoding="utf-8").split("\n")
        except UnicodeDecodeError as error:
            raise CorruptLog(f"{self.path} is not text ({error})") from None
        records = []
        for number, line in enumerate(lines[:-1], start=1):  # lines[-1]: empty, or a line cut short
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested past any record's depth
                record = None
            if not (isinstance(record, dict) and isinstance(record.get("kind"), str)
                    and isinstance(record.get("method"), str)):
                raise CorruptLog(f"{self.path} line {number} is not a metrics record (each names its kind and "
                                 f"method): {line[:60]!r}")
            records.append(record)
        return records

    def repair(self) -> None:
        """Drop a last line cut short by a killed run, so appends start on a fresh line."""
        if not self.path.exists():
            return
        text = self.path.read_text(encoding="utf-8")
        if text and not text.endswith("\n"):
            self._replace(text[: text.rfind("\n") + 1])

    def discard(self, method: str) -> None:
        """Remove every record of ``method`` (an interrupted attempt), atomically."""
        kept = [r for r in self.read() if r.get("method") != method]
        self._replace("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def discard_after(self, method: str, server_round: int) -> None:
        """Remove ``method``'s records of the rounds after ``server_round`` and its ``error`` records (an
        attempt cut short, which a continued run replaces), atomically."""
        def later(record: dict[str, Any]) -> bool:
            stamped = isinstance(record.get("round"), int) and record["round"] > server_round
            return record.get("method") == method and (stamped or record["kind"] == "error")

        self._replace("".join(json.dumps(r, sort_keys=True) + "\n" for r in self.read() if not later(r)))

    def finished(self) -> set[str]:
        """Methods whose ``done`` record (written after the final checkpoints) is in the log."""
        return {r["method"] for r in self.read() if r["kind"] == "done"}

    def _replace(self, text: str) -> None:
        write_text(self.path, text)


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


# Evaluation record keys → short names in the summary.
VALUE_KEYS = {"test_ppl_in": "in", "test_ppl_out": "out", "score": "score",
              # Flow eq. 6-7 and Fig. 2: Acc_g beside Acc_p (``score``), and the per-instance breakdown.
              "score_global": "score_global", "global_only": "global_only", "personal_only": "personal_only",
              "both_correct": "both_correct", "neither_correct": "neither_correct",
              # Flow on a language model: the global model's perplexities beside the personalised ones.
              "test_ppl_in_global": "in_global", "test_ppl_out_global": "out_global"}
# Cluster centres scored on each source's test set (FedSoft, IFCA), kept as they are.
CENTRE_KEY = re.compile(r"centre_(\d+)_source_(\d+)")
# A round's timing (``round`` records of metrics.jsonl), kept per round in summary.json.
ROUND_KEYS = ("round", "wall_s", "slowest_client_s", "busiest_worker_s", "workers", "overhead", "wire_s")
# Per-user uncertainty kept beside the values in summary.json (not averaged into mean/std).
ERROR_KEYS = {"test_nll_se_in": "nll_se_in", "test_nll_se_out": "nll_se_out"}


def summarize(records: list[dict[str, Any]], methods: list[str], users: list[str], metric: str = "perplexity",
              eval_split: str = "test") -> dict[str, Any]:
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
    """
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
        entry: dict[str, Any] = {"rounds": last_round, **_values(final, evaluated)}
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
        centres = {key: value for key, value in final[evaluated[0]].items() if CENTRE_KEY.fullmatch(key)}
        if centres:
            entry["centres"] = centres
        summary["methods"][method] = entry
        mixed = {u: {key.removesuffix(MIXTURE_SUFFIX): value for key, value in final[u].items()
                     if key.endswith(MIXTURE_SUFFIX)} for u in evaluated}
        if mixed[evaluated[0]]:  # FedEM's own prediction, a method of its own beside its centre of largest π
            summary["methods"][f"{method}-mixture"] = {
                **{key: value for key, value in entry.items() if key != "centres"}, **_values(mixed, evaluated)}
    timing = {method: sorted(({key: r.get(key) for key in ROUND_KEYS} for r in records
                              if r["method"] == method and r["kind"] == "round"), key=lambda r: r["round"])
              for method in summary["methods"]}
    summary["round_overhead"] = {method: rows for method, rows in timing.items() if rows}
    return summary


def _values(final: dict[str, dict[str, Any]], users: list[str]) -> dict[str, Any]:
    """Each user's final values by short name (``VALUE_KEYS``, ``ERROR_KEYS``), their mean and std
    over users, and Flow's share of clients whose personalised model beats the global one."""
    keys = {key: short for key, short in VALUE_KEYS.items() if key in final[users[0]]}
    values: dict[str, Any] = {
        "per_user": {u: {**{short: final[u][key] for key, short in keys.items()},
                         **{short: final[u][key] for key, short in ERROR_KEYS.items() if key in final[u]}}
                     for u in users}}
    for key, short in keys.items():
        values[f"mean_{short}"], values[f"std_{short}"] = _mean_std([final[u][key] for u in users])
    diverged = [u for u in users if not all(math.isfinite(final[u][key]) for key in keys)]
    if diverged:
        values["diverged"] = diverged
    if "score_global" in keys:  # Flow Table 3: the share of clients with Acc_p > Acc_g
        values["benefiting_pct"] = 100.0 * statistics.fmean(final[u]["score"] > final[u]["score_global"] for u in users)
    if "test_ppl_in_global" in keys:  # ... and on a language model, with ppl_p < ppl_g
        values["benefiting_pct"] = 100.0 * statistics.fmean(
            final[u]["test_ppl_in"] < final[u]["test_ppl_in_global"] for u in users)
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


def markdown_table(summary: dict[str, Any]) -> str:
    header, rows = table_rows(summary)
    lines = ["| " + " | ".join(map(markdown_cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(markdown_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


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


def write_report(run_dir: Path, recipe_name: str, summary: dict[str, Any], plots: list[Path],
                 facts: Sequence[str] = ()) -> Path:
    """``summary.json`` and ``report.md``: the run's ``facts`` (seed, rounds, devices, date, versions,
    dropped updates), the results table, the method-specific sections and the plots."""
    write_text(run_dir / "summary.json", json.dumps(finite_json(summary), indent=2, allow_nan=False))
    split = "validation" if summary.get("eval_split") == "valid" else "test"
    where = (f"Per-user columns are in distribution (each user's own {split} split); out of distribution is the "
             f"union of all users' {split} splits. Mean (std) over users."
             if summary.get("metric", "perplexity") == "perplexity" else
             f"Each client on its own {split} split; mean (std) over clients.")
    if any("mean_in" in m and "mean_out" not in m for m in summary["methods"].values()):
        where += (f" Out of distribution is {NOT_MEASURED} where the devices ran on Flower's deployment engine: "
                  "each device holds only its own data (docs/deployment.md).")
    caption = f"{score_title(summary)}. {where}"
    lines = [f"# {recipe_name}", "", *(f"- {markdown_cell(fact)}" for fact in facts), *([""] if facts else []),
             caption, "", markdown_table(summary), "", *_mixture_note(summary), *_centres_section(summary),
             *_personalisation_section(summary), *_privacy_section(summary), *_drops_section(summary),
             *_nodes_section(summary), *_overhead_section(summary)]
    lines += [f"![{p.stem}](plots/{p.name})" for p in plots]
    path = run_dir / "report.md"
    write_text(path, "\n".join(lines) + "\n")
    return path


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
    mixtures = [name for name in summary["methods"] if name.endswith("-mixture")]
    if not mixtures:
        return []
    return [f"`{name}`: {name.removesuffix('-mixture')}'s own prediction, each client's π-mixture of the centres' "
            f"outputs (Marfoq et al. 2021); `{name.removesuffix('-mixture')}`: its centre of largest π (FedSoft §5)."
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


def _privacy_section(summary: dict[str, Any]) -> list[str]:
    """Each round's differential-privacy parameters and (ε, δ) (recipe ``privacy``), for methods run with them."""
    rows = [f"| {name} | {r['round']} | {r['clip_norm']:g} | {r['noise_multiplier']:g} | {r['noise_std']:g} | "
            f"{r['clipped']} of {r['devices']} | {r['max_update_norm']:.4g} | {_epsilon_delta(r)} |"
            for name, m in summary["methods"].items() for r in m.get("privacy", [])]
    if not rows:
        return []
    spent = [f"- **{name}:** (ε, δ) = {_epsilon_delta(m['privacy_spent'])}"
             for name, m in summary["methods"].items() if "privacy_spent" in m]
    lines = ["## Differential privacy", "",
             "Each device clipped its round's update of the shared tensors to L2 norm C and added Gaussian noise "
             "of std σ = z·C per coordinate before encoding it (docs/federation.md). Norms are before clipping. "
             "(ε, δ): user-level, spent so far by the device that took part in the most rounds (Rényi DP, "
             "dp-accounting); ε is ∞ without noise.", "",
             "| method | round | clip norm C | noise multiplier z | noise std σ | updates clipped | largest norm "
             "| (ε, δ) |", "|---|---|---|---|---|---|---|---|", *rows, ""]
    return [*lines, *spent, ""] if spent else lines


def _epsilon_delta(figures: dict[str, Any]) -> str:
    """``(ε, δ)`` of a privacy record or summary, ∞ for a null ε, – for a log written before ε was."""
    if "delta" not in figures:
        return "–"
    epsilon = "∞" if figures["epsilon"] is None else f"{figures['epsilon']:.3g}"
    return f"({epsilon}, {figures['delta']:g})"


def _overhead_section(summary: dict[str, Any]) -> list[str]:
    """Each round's wall time and the share of it that no device's handler explains."""
    rounds = [(name, r) for name, kept in summary.get("round_overhead", {}).items() for r in kept]
    if not rounds:
        return []
    wire = any(r.get("wire_s") is not None for _, r in rounds)
    rows = [f"| {name} | {r['round']} | {r['wall_s']:.2f} | {r['slowest_client_s']:.2f} | "
            f"{r['busiest_worker_s']:.2f} ({r['workers']}) | {100 * r['overhead']:.1f} % |"
            + (f" {r['wire_s']:.2f} |" if r.get("wire_s") is not None else " – |" if wire else "")
            for name, r in rounds]
    return ["## Round overhead", "",
            "Wall time of each round at the server; each device's train + evaluate handler time, slowest; the "
            "busiest worker process's handler time (a worker serves its devices in turn); overhead = (wall − "
            "busiest worker) ÷ wall: messaging, serialisation, waiting (docs/federation.md, Round overhead)."
            + (" On real devices, wire: the most time one device's messages spent between the server and its "
               "handler (transfer over its link and Flower's pacing; bytes per round in the table above)."
               if wire else ""), "",
            "| method | round | wall (s) | slowest client (s) | busiest worker (s) (workers) | overhead |"
            + (" wire (s) |" if wire else ""),
            "|---|---|---|---|---|---|" + ("---|" if wire else ""), *rows, ""]


def _nodes_section(summary: dict[str, Any]) -> list[str]:
    """Nodes the server refused, and rounds after which a run on real devices continued."""
    refused = [f"| {markdown_cell(name)} | {markdown_cell(reason)} |" for name, m in summary["methods"].items()
               for reason in m.get("refused", [])]
    continued = [f"{name}: continued after round {', '.join(str(r) for r in m['continued_after'])} (a crash or a "
                 "stop in between; the rounds after it were sent again)"
                 for name, m in summary["methods"].items() if m.get("continued_after")]
    lines = []
    if refused:
        lines += ["## Refused nodes", "",
                  "Nodes that claimed a device slot they may not hold: one another live node holds, or one that "
                  "belongs to another SuperNode key (docs/deployment.md). They took no part in the run.", "",
                  "| method | why |", "|---|---|", *refused, ""]
    if continued:
        lines += ["## Continued runs", "", *continued, ""]
    return lines


def _drops_section(summary: dict[str, Any]) -> list[str]:
    """A table of dropped devices per method, when any device was dropped."""
    rows = [f"| {markdown_cell(name)} | {markdown_cell(user)} | {count} |" for name, m in summary["methods"].items()
            for user, count in m.get("dropped", {}).items()]
    if not rows:
        return []
    return ["## Dropped devices", "",
            "Rounds in which a device was left out: it raised, did not reply within `federation.reply_timeout_s`, "
            "or sent an update the server rejected (reasons: `kind: drop` records in metrics.jsonl).", "",
            "| method | device of user | rounds dropped |", "|---|---|---|", *rows, "",
            *(_not_evaluated_line(name, m["not_evaluated"])
              for name, m in summary["methods"].items() if m.get("not_evaluated")), ""]


def _not_evaluated_line(method: str, users: list[str]) -> str:
    """One sentence naming the devices lost before a method's final evaluation."""
    return (f"{method}: no final figures for {markdown_cell(', '.join(users))} (the device was lost before the final "
            f"evaluation; the others' mean is over the devices that answered).")


SCORE_KEY = re.compile(r"layer_(\d+)/expert_(.+)_score")  # a train record's mean routing weight of an expert
PANEL_COLUMNS = 4


def plot_expert_scores(records: list[dict[str, Any]], method: str, path: Path) -> Path | None:
    """Each expert's routing score over rounds (CoMiGS Fig. 4), a panel per device: one line per
    expert, its mean over the layers, in a band from its lowest to its highest layer."""
    trains = [r for r in records if r["method"] == method and r["kind"] == "train"]
    by_user: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in trains:
        by_user[record["user"]].append(record)
    experts = sorted({m[2] for r in trains for key in r if (m := SCORE_KEY.fullmatch(key))},
                     key=lambda name: (not name.startswith("shared"), name))  # generalists first
    if not experts:
        return None
    plt = pyplot()
    columns = min(len(by_user), PANEL_COLUMNS)
    rows = -(-len(by_user) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.2 * rows), squeeze=False, sharey=True)
    for axis, (user, user_records) in zip(axes.flat, sorted(by_user.items()), strict=False):
        user_records.sort(key=lambda r: r["round"])
        for expert in experts:
            rounds, layers = _scores_by_round(user_records, expert)
            if rounds:
                line, = axis.plot(rounds, [statistics.fmean(s) for s in layers], marker=".", label=expert)
                axis.fill_between(rounds, [min(s) for s in layers], [max(s) for s in layers],
                                  color=line.get_color(), alpha=0.2, linewidth=0)
        axis.set_title(user)
        axis.set_xlabel("round")
        integer_ticks(axis)
    for axis in axes.flat[len(by_user):]:
        axis.set_visible(False)
    for row in axes:
        row[0].set_ylabel("score: mean over layers")
    axes[0][0].legend(title="expert", fontsize="small")
    figure.suptitle(f"{method}: expert scores (band: lowest to highest layer)")
    return save_figure(figure, path)


def _scores_by_round(records: list[dict[str, Any]], expert: str) -> tuple[list[int], list[list[float]]]:
    """The rounds of ``records`` (one device's, in order) scoring ``expert``, and its score per layer in each."""
    rounds, layers = [], []
    for record in records:
        scores = [value for key, value in record.items() if (m := SCORE_KEY.fullmatch(key)) and m[2] == expert]
        if scores:
            rounds.append(record["round"])
            layers.append(scores)
    return rounds, layers


def plot_rounds(records: list[dict[str, Any]], methods: list[str], path: Path) -> Path | None:
    """Mean headline value (in-distribution perplexity or score) over rounds, one line per method."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.6))
    if not _draw_rounds(axis, records, methods):
        plt.close(figure)
        return None
    return save_figure(figure, path)


def _draw_rounds(axis: Any, records: list[dict[str, Any]], methods: list[str]) -> bool:
    """Draw each method's mean headline value over users per round on ``axis`` (an untrained
    reference as a dashed level); whether there was anything to draw."""
    drawn = False
    for method in methods:
        by_round: dict[int, list[float]] = defaultdict(list)
        for r in records:
            if r["method"] == method and r["kind"] == "eval":
                by_round[r["round"]].append(r.get("test_ppl_in", r.get("score")))
        if list(by_round) == [0]:  # an untrained reference, e.g. the pretrained model
            axis.axhline(statistics.fmean(by_round[0]), linestyle="--", color="grey", label=method)
            drawn = True
        elif by_round:
            rounds = sorted(by_round)
            axis.plot(rounds, [statistics.fmean(by_round[k]) for k in rounds], marker="o", label=method)
            drawn = True
    if drawn:
        axis.set_xlabel("round")
        integer_ticks(axis)
        language = any("test_ppl_in" in r for r in records if r["kind"] == "eval")
        axis.set_ylabel("mean test perplexity (in-dist)" if language else "mean test score")
        axis.legend(fontsize="small")
    return drawn


def step_losses(record: dict[str, Any]) -> list[tuple[int, float]]:
    """A ``train`` record's loss at each training step, as ``(step, loss)`` (:func:`step_series`)."""
    return step_series(record, "step_losses")


def step_series(record: dict[str, Any], key: str) -> list[tuple[int, float]]:
    """A ``train`` record's list ``key`` (``step_losses``, ``step_lrs``, ``step_grad_norms``) as ``(step,
    value)``: steps of the device's own count, which runs on across rounds (the record's ``iteration`` is
    its round's last step). None where the record does not say which steps they were (a device's malformed
    metrics)."""
    values, last = record.get(key), record.get("iteration")
    if not (isinstance(values, list) and isinstance(last, int | float) and values and len(values) <= last < 2**53):
        return []
    first = int(last) - len(values) + 1
    return [(first + offset, float(value)) for offset, value in enumerate(values)]


# Losses of a method's phases other than its plain training steps, per round: name in the legend.
# Routers step on the router split: the validation split, or training batches in CoMiGS's -tr ablation.
PHASE_LOSSES = {"router_loss": "router steps", "train_loss_local": "local phase"}


def plot_loss_curves(records: list[dict[str, Any]], methods: list[str], path: Path) -> Path | None:
    """Training loss per step, mean over the devices (a method that logs no step losses: its round
    means, at each round's last step); each phase's mean loss per round, where methods have phases
    (routers on the router split, Flow's local phase); and the test metric per round."""
    trained = [method for method in methods if any(r["method"] == method and r["kind"] == "train" for r in records)]
    if not trained:
        return None
    phases = {(r["method"], key) for r in records if r["kind"] == "train" and r["method"] in trained
              for key in PHASE_LOSSES if key in r}
    plt = pyplot()
    figure, axes = plt.subplots(1, 3 if phases else 2, figsize=(15 if phases else 10, 3.8), squeeze=False)
    steps_axis, *phase_axes, test_axis = axes[0]
    for method in trained:
        trains = [r for r in records if r["method"] == method and r["kind"] == "train"]
        per_step = [point for r in trains for point in step_losses(r)]
        round_means = not per_step
        if round_means:  # each round's mean loss, as one step at the round's end
            per_step = [point for r in trains if "train_loss" in r
                        for point in step_losses({**r, "step_losses": [r["train_loss"]]})]
        steps, means = _means_by(per_step)
        steps_axis.plot(steps, means, marker="o" if round_means else None, label=method)
    steps_axis.set(xlabel="step (each device's own count)", ylabel="training loss, mean over devices")
    integer_ticks(steps_axis)
    steps_axis.legend(fontsize="small")
    for axis in phase_axes:
        for method, key in sorted(phases):
            rounds, means = _means_by([(r["round"], r[key]) for r in records
                                       if r["method"] == method and r["kind"] == "train" and key in r])
            axis.plot(rounds, means, marker="o", label=f"{method}: {PHASE_LOSSES[key]}")
        axis.set(xlabel="round", ylabel="phase loss, mean over devices")
        integer_ticks(axis)
        axis.legend(fontsize="small")
    _draw_rounds(test_axis, records, methods)
    return save_figure(figure, path)


def _means_by(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """The mean value at each x of ``(x, value)`` points, in order of x."""
    grouped: dict[int, list[float]] = defaultdict(list)
    for x, value in points:
        grouped[x].append(value)
    xs = sorted(grouped)
    return xs, [statistics.fmean(grouped[x]) for x in xs]


def plot_communication(records: list[dict[str, Any]], methods: list[str], path: Path) -> Path | None:
    """Bytes uploaded per round by all devices, one bar per method (Hermes Fig. 3b)."""
    uploads = {}
    for method in methods:
        comm = [r["bytes_up"] for r in records if r["method"] == method and r["kind"] == "comm"]
        if comm:
            uploads[method] = statistics.fmean(comm) / 2**20
    if not uploads:
        return None
    figure, axis = pyplot().subplots(figsize=(max(4.0, 0.8 * len(uploads) + 2), 3.6))
    bars = axis.bar(list(uploads), list(uploads.values()), color="tab:blue")
    # A linear axis, so bar heights compare; full fine-tuning can dwarf the PEFT bars, so each carries its value.
    axis.bar_label(bars, labels=[format_bytes(mib * 2**20) for mib in uploads.values()], fontsize="small")
    axis.margins(y=0.15)
    axis.set_ylabel("upload per round,\nall devices (MiB)")
    axis.tick_params(axis="x", labelrotation=45)
    for label in axis.get_xticklabels():
        label.set_horizontalalignment("right")
    return save_figure(figure, path)


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the file-only Agg backend, imported where a picture is drawn: a device's
    worker process, which imports this module for its records, never draws (and starts faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot

    return matplotlib.pyplot


def integer_ticks(axis: Any) -> None:
    """Round numbers on ``axis``'s x axis: whole numbers, as many as fit (1,500 rounds get a readable axis)."""
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def save_figure(figure: Any, path: Path) -> Path:
    plt = pyplot()
    figure.tight_layout()
    picture = io.BytesIO()
    figure.savefig(picture, dpi=110, format="png")
    plt.close(figure)
    write_bytes(path, picture.getvalue())
    return path
