"""What the simulation benchmarks share: a recipe run under overrides, its methods' summaries kept by label.

Every variant is a real Flower simulation (``ondevice_moe.runner``) into its own folder under
``--output``, so an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def parser(description: str, output: str) -> argparse.ArgumentParser:
    """The options every simulation benchmark takes; ``output`` names its default folder under ``runs/``."""
    options = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "demo.yaml")
    options.add_argument("--rounds", type=int, help="federation.rounds (default: the recipe's)")
    options.add_argument("--iterations", type=int, help="federation.local_iterations (default: the recipe's)")
    options.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="further recipe overrides, as `ondevice-moe finetune --set`")
    options.add_argument("--output", type=Path, default=ROOT / "runs" / output)
    return options


def run_variant(args: argparse.Namespace, label: str, overrides: list[str]) -> dict[str, dict]:
    """Run the recipe with ``overrides`` into ``<output>/<label>``; ``{"<method>/<label>": summary entry}``.
    A bad recipe or a method that fails stops the benchmark with the run's one-line error and fix
    (no traceback); the folder keeps what finished, and the same command resumes it."""
    sizes = [f"federation.rounds={args.rounds}"] if args.rounds else []
    if args.iterations:
        sizes.append(f"federation.local_iterations={args.iterations}")
    try:
        recipe = load_recipe(args.recipe, [*args.overrides, *overrides, *sizes])
        result = runner.run_recipe(recipe, args.output / label)
    except UserError as error:
        raise SystemExit(f"error: {error.problem}" + (f"\nfix: {error.fix}" if error.fix else "")) from None
    return {f"{method}/{label}": entry for method, entry in result.summary["methods"].items()}


def publish(output: Path, stem: str, figures: dict[str, object], markdown: str) -> dict[str, object]:
    """Write ``<stem>.json`` and ``<stem>.md`` under ``output``; print the table, then the figures as one JSON line."""
    (output / f"{stem}.json").write_text(json.dumps(figures, indent=2) + "\n")
    (output / f"{stem}.md").write_text(markdown + "\n")
    print(markdown)
    print(json.dumps(figures))
    return figures
