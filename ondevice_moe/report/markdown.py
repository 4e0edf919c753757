"""``report.md``: the results table, the run's facts and each section a run calls for."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ondevice_moe.names import markdown_cell
from ondevice_moe.report.reporter import Reporter
from ondevice_moe.report.summary import NOT_MEASURED, finite_json, score_title, table_rows
from ondevice_moe.safe_files import write_text


def markdown_table(summary: dict[str, Any]) -> str:
    header, rows = table_rows(summary)
    lines = ["| " + " | ".join(map(markdown_cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(markdown_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def write_report(run_dir: Path, recipe_name: str, summary: dict[str, Any], plots: list[Path],
                 facts: Sequence[str] = (), reporters: Sequence[Reporter] = ()) -> Path:
    """``summary.json`` and ``report.md``: the run's ``facts`` (seed, rounds, devices, date, versions,
    dropped updates), the results table, the method families' sections (``reporters``) and the plots."""
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
             caption, "", markdown_table(summary), "", *(line for r in reporters for line in r.sections(summary)),
             *_privacy_section(summary), *_drops_section(summary), *_nodes_section(summary),
             *_overhead_section(summary)]
    lines += [f"![{p.stem}](plots/{p.name})" for p in plots]
    path = run_dir / "report.md"
    write_text(path, "\n".join(lines) + "\n")
    return path


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
