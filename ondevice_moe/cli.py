"""The ``ondevice-moe`` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ondevice_moe.errors import UserError

app = typer.Typer(
    help="On-device collaborative fine-tuning with mixtures of PEFT experts.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
recipes_app = typer.Typer(help="Bundled recipes.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")
console = Console()

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
MAX_USER_COLUMNS = 5


@app.command()
def finetune(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML (see `ondevice-moe recipes list`).")],
    set_: Annotated[list[str], typer.Option("--set", help="Override a recipe key: --set federation.rounds=5")] = [],  # noqa: B006
    output: Annotated[Path | None, typer.Option(help="Run folder (default: runs/<recipe name>).")] = None,
    seed: Annotated[int | None, typer.Option(help="Override the recipe's seed.")] = None,
) -> None:
    """Fine-tune every method of a recipe through Flower and write the report."""
    from ondevice_moe.recipe import load_recipe
    from ondevice_moe.runner import run_recipe

    try:
        loaded = load_recipe(_find_recipe(recipe), set_, seed)
        what = f"task {loaded.task.name}, " if loaded.task else ""
        console.print(f"[bold]{loaded.name}[/]: {what}{len(loaded.user_names)} devices, model {loaded.model.name}, "
                      f"methods {', '.join(_method_label(m) for m in loaded.methods)}")
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console) as progress:
            tasks: dict[str, int] = {}

            def on_method(name: str, index: int, count: int) -> None:
                tasks["current"] = progress.add_task(f"[{index + 1}/{count}] {name}", total=None, status="starting")

            def on_round(done: int, total: int, line: str) -> None:
                progress.update(tasks["current"], completed=done, total=total, status=line)

            result = run_recipe(loaded, output, on_method, on_round)
    except UserError as error:
        _fail(error)
    _print_summary(result.summary)
    console.print(f"report: {result.report}\nsummary: {result.run_dir / 'summary.json'}")


@app.command("eval")
def evaluate(
    run: Annotated[Path, typer.Argument(help="A run folder written by `ondevice-moe finetune`.")],
    suite: Annotated[str, typer.Option(help="lm (perplexity in/out of distribution) or glue (task metrics).")] = "lm",
) -> None:
    """Re-evaluate a finished run from its checkpoints."""
    from ondevice_moe.runner import evaluate_run

    try:
        summary = evaluate_run(run, suite)
    except UserError as error:
        _fail(error)
    _print_summary(summary)


def _method_label(entry) -> str:
    extras = [entry.variant, entry.ablation, f"k{entry.top_k}" if entry.top_k else None]
    return "-".join([entry.name, *(e for e in extras if e)])


def _print_summary(summary: dict) -> None:
    from ondevice_moe.report import table_rows

    header, rows = table_rows(summary)
    users = len(summary["users"])
    if users > MAX_USER_COLUMNS:  # keep the console table readable; report.md has every client
        header = [header[0], *header[1 + users :]]
        rows = [[row[0], *row[1 + users :]] for row in rows]
    language = any("mean_in" in m for m in summary["methods"].values())
    title = "Test perplexity after the last round (lower is better)" if language else \
        "Test score ×100 after the last round (higher is better)"
    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


@recipes_app.command("list")
def list_recipes() -> None:
    """List the bundled recipes with their descriptions."""
    import yaml

    table = Table(title=f"Recipes in {RECIPES_DIR}")
    table.add_column("recipe")
    table.add_column("description")
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        description = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("description", "")
        table.add_row(path.name, str(description).strip().splitlines()[0] if description else "")
    console.print(table)


def _find_recipe(recipe: Path) -> Path:
    """A path as given, or the name of a bundled recipe."""
    if recipe.exists():
        return recipe
    bundled = RECIPES_DIR / recipe.name
    if bundled.exists():
        return bundled
    if bundled.with_suffix(".yaml").exists():
        return bundled.with_suffix(".yaml")
    return recipe


def _fail(error: UserError) -> None:
    console.print(f"[bold red]error:[/] {error.problem}")
    if error.fix:
        console.print(f"[bold]fix:[/] {error.fix}")
    raise typer.Exit(code=2)


QUIET_ENVIRONMENT = {
    "FLWR_TELEMETRY_ENABLED": "0",  # no phone-home thread (and no network here)
    "FLWR_LOG_LEVEL": "ERROR",  # Flower's INFO lines and run_simulation's deprecation notice
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


def main() -> None:
    for key, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    app()
