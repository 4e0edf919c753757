"""The ``ondevice-moe`` command line."""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, NoReturn

import typer
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.segment import Segments
from rich.table import Column, Table
from rich.text import Text

from ondevice_moe.destination import check_file_destination, check_folder_destination
from ondevice_moe.distribution import BUNDLED_RECIPES, VERSION
from ondevice_moe.errors import UserError
from ondevice_moe.launch import bundled_recipe, find_recipe, set_run_environment
from ondevice_moe.safe_console import SafeConsole
from ondevice_moe.tracking.progress import ProgressLines

if TYPE_CHECKING:
    from ondevice_moe.plan import DevicePlan, UserCounts
    from ondevice_moe.recipe import Recipe

app = typer.Typer(
    help="On-device collaborative fine-tuning with mixtures of PEFT experts.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
recipes_app = typer.Typer(help="Bundled recipes.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")
methods_app = typer.Typer(help="Methods: built in, from installed packages, or a recipe's plug-in files.",
                          no_args_is_help=True)
app.add_typer(methods_app, name="methods")
console = SafeConsole()

MAX_USER_COLUMNS = 5
MAX_INSPECT_BYTES = 256 * 2**10  # inspect colours every token: a page of a book, not the book
Device = Literal["auto", "cpu", "cuda"]
Suite = Literal["lm", "glue"]
DEVICE_HELP = "Where the model runs (recipe key model.device): auto picks CUDA when present."


def _show_version(value: bool) -> None:
    if value:
        console.print(f"ondevice-moe {VERSION}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """On-device collaborative fine-tuning with mixtures of PEFT experts."""


def run_header(recipe: Recipe, methods: list[str]) -> Text:
    """The line ``finetune`` opens with: the run, its devices, model, methods and both seeds."""
    what = f"task {recipe.task.name}, " if recipe.task else ""
    split = ("data_seed" if recipe.data_seed is not None else "follows seed")
    return Text.assemble((recipe.name, "bold"), f": {what}{len(recipe.user_names)} devices, model "
                         f"{recipe.model.name}, methods {', '.join(methods)}; seed {recipe.seed}, data split seed "
                         f"{recipe.split_seed} ({split})")


@app.command()
def finetune(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML, or a bundled recipe's name (see `recipes list`).")],
    set_: Annotated[list[str], typer.Option("--set", help="Override a recipe key: --set federation.rounds=5")] = [],  # noqa: B006
    output: Annotated[Path | None, typer.Option(help="Run folder (default: runs/<recipe name>).")] = None,
    seed: Annotated[int | None, typer.Option(help="Override the recipe's seed: the experts' initialisation and the "
                                             "order of batches, and the data split too unless the recipe sets "
                                             "data_seed.")] = None,
    device: Annotated[Device | None, typer.Option(help=DEVICE_HELP)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Read the data and print the resolved recipe, the "
                                          "plan and each user's data; train nothing.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the run in the --output folder (another "
                                            "recipe's, or this one's to start over) once the inputs check out."
                                            )] = False,
    federation: Annotated[str | None, typer.Option(
        help="Run on real devices: the SuperLink of this name in Flower's connection config "
             "($FLWR_HOME/config.toml; docs/deployment.md). Default: Flower's simulation on this machine.")] = None,
    trust_plugins: Annotated[bool, typer.Option(
        "--trust-plugins", help="Run the code of the method plug-in files the recipe names (plugins:).")] = False,
    bind: Annotated[list[str], typer.Option(
        "--bind", help="With --federation: USER=KEY.pub gives the user's slot to the SuperNode with that key for "
                       "the whole run (default: the first key to claim it).")] = [],  # noqa: B006
    stop: Annotated[bool, typer.Option(
        "--stop", help="With --federation: stop the run of this recipe and --output on the SuperLink (a rerun "
                       "continues it).")] = False,
) -> None:
    """Fine-tune every method of a recipe through Flower and write the report."""
    from ondevice_moe.federation.job import Job
    from ondevice_moe.models.devices import slow_bfloat16
    from ondevice_moe.recipe import load_recipe
    from ondevice_moe.run_folder import RunFolder
    from ondevice_moe.runner import run_recipe

    overrides = [*set_, f"model.device={device}"] if device else set_
    _trust(trust_plugins)
    try:
        if (bind or stop) and federation is None:
            raise UserError("--bind and --stop are for runs on real devices", "add --federation NAME")
        loaded = load_recipe(find_recipe(recipe), overrides, seed)
        if stop:
            from ondevice_moe.federation.submit import stop_run

            run = stop_run(RunFolder(loaded, output).path, federation)
            console.print(f"stopped Flower run {run} on SuperLink '{escape(federation)}': run the same command "
                          "without --stop to continue it from its last completed round")
            return
        from ondevice_moe.federation.slots import parse_bindings

        bound = parse_bindings(bind, loaded.user_names)
        if dry_run:
            _print_plan(loaded, output, read_data=federation is None)
            return
        methods = [Job(loaded, i, Path()).method.name for i in range(len(loaded.methods))]
        console.print(run_header(loaded, methods), soft_wrap=True)
        plain = not console.is_terminal  # a log file or CI: a whole line per event, as it happens, and no bars
        with _progress(disable=plain) as progress:
            tasks: dict[str, int] = {}
            lines = ProgressLines()

            def on_method(name: str, index: int, count: int) -> None:
                tasks["current"] = progress.add_task(f"[{index + 1}/{count}] {name}", total=None, status="starting")
                if plain:
                    console.print(escape(lines.method(name, index, count)), soft_wrap=True)

            def on_round(done: int, total: int, line: str) -> None:
                progress.update(tasks["current"], completed=done, total=total, status=line)
                if plain:
                    console.print(escape(lines.round(done, total, line)), soft_wrap=True)

            if federation is not None:
                _warn_if_insecure(federation)
            elif why := slow_bfloat16(loaded.model.dtype, loaded.model.device):
                console.print(f"[bold yellow]warning:[/] {escape(why)}")
            result = run_recipe(loaded, output, on_method, on_round, federation, overwrite, bound)
    except UserError as error:
        _fail(error)
    _print_summary(result.summary)
    console.print(f"report: {result.report}\nsummary: {result.run_dir / 'summary.json'}")


def _warn_if_insecure(federation: str) -> None:
    """Say so when the link to the SuperLink is not encrypted (``insecure = true`` in Flower's config)."""
    from ondevice_moe.federation.submit import connection

    entry = connection(federation)
    if entry.get("insecure"):
        console.print(f"[bold yellow]warning:[/] the link to SuperLink '{federation}' ({entry['address']}) is "
                      "insecure: shared experts and metrics travel unencrypted, and nothing proves who the server "
                      "is; use TLS (root-certificates) and SuperNode authentication (docs/deployment.md)")


def _progress(disable: bool = False) -> Progress:
    """Rounds per method: bar, elapsed and remaining time (once the total is known), then a status line
    that is cut, not wrapped, on narrow terminals; ``disable``: none of it (no terminal to redraw on)."""
    status = Column(no_wrap=True, overflow="ellipsis", ratio=1)
    return Progress(TextColumn("{task.description}"), BarColumn(bar_width=20),
                    TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=7)),
                    TimeRemainingColumn(table_column=Column(no_wrap=True, min_width=7)),
                    TextColumn("{task.fields[status]}", table_column=status), console=console, expand=True,
                    disable=disable)


@app.command("eval")
def evaluate(
    run: Annotated[Path, typer.Argument(help="A run folder written by `ondevice-moe finetune`.")],
    suite: Annotated[Suite | None, typer.Option(
        help="lm (perplexity in/out of distribution) or glue (task metrics). Default: the run's own task.")] = None,
    device: Annotated[Device | None, typer.Option(help=DEVICE_HELP + " Default: the run's recipe.")] = None,
    split: Annotated[str | None, typer.Option(
        help="test or valid: the split the users are scored on (data.eval_split, or task.eval_split: a "
             "classifier's validation split needs task.valid_examples). "
             "Default: the run's recipe.")] = None,
    data: Annotated[Path | None, typer.Option(
        help="Score the run's users on a file of yours instead: for a language model what training reads (text, "
             ".csv/.tsv/.jsonl/.parquet, a folder, a save_to_disk folder; prompts and responses scored on the "
             "responses), for classification .csv/.tsv/.jsonl with text and label columns.")] = None,
    out: Annotated[Path | None, typer.Option(help="Where --data's scores go. Default: RUN/eval.json.")] = None,
    text_column: Annotated[list[str], typer.Option(
        help="--data's text column or JSONL field (twice for sentence pairs). Default: text, or the run's task "
             "file's.")] = [],  # noqa: B006
    label_column: Annotated[str | None, typer.Option(
        help="--data's label column or JSONL field. Default: label, or the run's task file's.")] = None,
    prompt_column: Annotated[str | None, typer.Option(
        help="--data holds instructions: its prompt column (default prompt; an instruction run's default).")] = None,
    response_column: Annotated[str | None, typer.Option(
        help="--data holds instructions: its response column, the tokens scored (default response).")] = None,
    messages_column: Annotated[str | None, typer.Option(
        help="--data holds chat conversations in this column (the last message, the assistant's, scored).")] = None,
    trust_plugins: Annotated[bool, typer.Option(
        "--trust-plugins", help="Run the code of the method plug-in files the recipe names (plugins:).")] = False,
) -> None:
    """Re-evaluate a finished run from its checkpoints, on its own data or (--data) on a file of yours."""
    _trust(trust_plugins)
    try:
        instruction_columns = (prompt_column, response_column, messages_column)
        if data is not None:
            _score_file(run, data, out, device, text_column, label_column, instruction_columns, suite, split)
            return
        if out is not None or text_column or label_column is not None or any(instruction_columns):
            raise UserError("--out and the --*-column options describe a --data file", "add --data FILE, or drop them")
        if split not in (None, "test", "valid"):
            raise UserError(f"unknown split '{split}'", "use --split test or --split valid")
        from ondevice_moe.runner import evaluate_run

        summary = evaluate_run(run, suite, device, split)  # None keeps the device of the run's recipe
    except UserError as error:
        _fail(error)
    _print_summary(summary, traffic=False)
    _note_still_training(run, summary.get("still_training", []))


def _note_still_training(run: Path, methods: list[str]) -> None:
    if methods:
        console.print(f"[bold yellow]note:[/] a run is still training in {escape(str(run))}: "
                      f"{escape(', '.join(methods))} unfinished and not scored; eval again once it is done")


def _score_file(run: Path, data: Path, out: Path | None, device: str | None, text_columns: list[str],
                label_column: str | None, instruction_columns: tuple[str | None, str | None, str | None],
                suite: str | None, split: str | None) -> None:
    """``eval --data``: every user's model on the file, printed and written to ``eval.json``."""
    if suite is not None or split is not None:
        raise UserError("--suite and --split choose among the run's own data; --data scores your file",
                        "drop --suite and --split")
    check_file_destination(out or run / "eval.json", "--out", "eval.json")  # before torch loads
    from ondevice_moe.eval_file import InstructionColumns, score_file

    prompt, response, messages = instruction_columns
    instructions = InstructionColumns(prompt or "prompt", response or "response", messages) \
        if any(instruction_columns) else None
    scores = score_file(run, data, out, device, text_columns or None, label_column, instructions)
    users = list(next(iter(scores.scores.values())))
    shown = users if len(users) <= MAX_USER_COLUMNS else []  # the file holds every user
    size = ", ".join(f"{count:,} {what}" for what, count in scores.size.items())
    table = Table(title=f"{scores.metric} on {escape(str(data))} ({size})")
    table.add_column("method", no_wrap=True)
    for column in (*shown, "mean over users"):
        table.add_column(escape(column), justify="right")
    for method, per_user in scores.scores.items():
        values = [entry[scores.metric] for entry in per_user.values()]
        table.add_row(escape(method), *(f"{per_user[user][scores.metric]:.2f}" for user in shown),
                      f"{sum(values) / len(values):.2f}")
    _print_table(table)
    console.print(f"wrote {scores.written}")
    _note_still_training(run, scores.still_training)


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="A run folder written by `ondevice-moe finetune`.")],
    method: Annotated[str, typer.Option(help="The method whose model to export, as named in the run's report.")],
    user: Annotated[str, typer.Option(help="The user (device) whose model to export.")],
    to: Annotated[Path, typer.Option(help="The folder to write (created; must be empty unless --force).")],
    experts: Annotated[list[str], typer.Option(
        help="shared (default), all (private experts and routers too: the user's own), or expert names.")] = [],  # noqa: B006
    format_: Annotated[str, typer.Option("--format", help="both (default), toolkit (the whole model) or "
                                                          "peft (PEFT adapters only).")] = "both",
    push_to_hub: Annotated[str | None, typer.Option(help="Also upload the folder to this Hub repo, ORG/NAME.")] = None,
    private: Annotated[bool, typer.Option("--private", help="Create the Hub repo as private.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an earlier export in --to.")] = False,
    device: Annotated[Device | None, typer.Option(help=DEVICE_HELP + " Default: the run's recipe.")] = None,
    centre: Annotated[int | None, typer.Option(
        help="FedSoft / IFCA: export the server's cluster centre CENTRE (e.g. for a new user) in place of "
             "the user's own shared tensors.")] = None,
    trust_plugins: Annotated[bool, typer.Option(
        "--trust-plugins", help="Run the code of the method plug-in files the recipe names (plugins:).")] = False,
) -> None:
    """Export one user's trained model: PEFT adapters, the toolkit's format, a model card."""
    _trust(trust_plugins)
    try:
        check_folder_destination(to, "--to")  # before torch loads
        from ondevice_moe.export import export_user

        result = export_user(run, method, user, to, experts, format_, force, push_to_hub, private, device, centre)
    except UserError as error:
        _fail(error)
    whose = f"centre {centre} (through {escape(user)}'s model)" if centre is not None else escape(user)
    console.print(f"exported {', '.join(result.parts)} of {escape(method)} for {whose} to {result.folder}")
    for folder in result.peft_folders:
        console.print(f"PEFT adapter: {folder}")
    if result.url:
        console.print(f"pushed: {result.url}")


def _print_table(table: Table) -> None:
    """``table`` as wide as the terminal; where output is no terminal (a log file, CI: 80 columns by
    default) as wide as its contents, so that no column is squeezed (rich prints no wider than the console)."""
    if console.is_terminal:
        console.print(table)
        return
    natural = Measurement.get(console, console.options.update_width(10_000), table).maximum
    for line in console.render_lines(table, console.options.update_width(natural), pad=False, new_lines=True):
        console.print(Segments(line), crop=False, soft_wrap=True)


def _print_summary(summary: dict, traffic: bool = True) -> None:
    """The results table; without ``traffic`` (a re-evaluation: no rounds ran, no bytes travelled) no upload column."""
    from ondevice_moe.report import score_title, table_rows

    header, rows = table_rows(summary)
    if not traffic:
        cut = next(index for index, column in enumerate(header) if column.startswith("upload"))
        header, rows = header[:cut], [row[:cut] for row in rows]
    users = len(summary["users"])
    if users > MAX_USER_COLUMNS:  # keep the console table readable; report.md has every client
        header = [header[0], *header[1 + users :]]
        rows = [[row[0], *row[1 + users :]] for row in rows]
    table = Table(title=score_title(summary))
    widest = max((len(row[0]) for row in rows), default=6)
    for column in header:  # method names whole (comigs-1GXs-2444, hermes-w/o-A), never cut to "comigs-…"
        if column == "method":
            table.add_column(column, justify="left", no_wrap=True, min_width=widest)
        else:
            table.add_column(column, justify="right", overflow="fold")  # a long word breaks; nothing is cut
    for row in rows:
        table.add_row(*row)
    _print_table(table)
    for name, method in summary["methods"].items():
        if method.get("dropped"):
            users = ", ".join(f"{user} ({count} round{'s' * (count > 1)})" for user, count in method["dropped"].items())
            console.print(f"[yellow]dropped:[/] {escape(name)}: {escape(users)} (see report.md)")
        for reason in method.get("refused", []):
            console.print(f"[red]refused:[/] {escape(name)}: {escape(reason)}", soft_wrap=True)


@app.command("device")
def device_runtime(
    runtime_api: Annotated[str, typer.Option(
        help="The Runtime API of this device's SuperNode, started with --isolation process (its --port).")
    ] = "127.0.0.1:9094",
    root_certificates: Annotated[Path | None, typer.Option(
        help="CA certificate of the SuperNode's Runtime API TLS (--ssl-certfile); without it, plain HTTP on "
             "loopback.")] = None,
    superlink: Annotated[str | None, typer.Option(
        help="Start this device's SuperNode too, against the SuperLink at HOST:PORT, and keep it running: "
             "started again, with growing pauses, whenever it exits.")] = None,
    node_config: Annotated[str | None, typer.Option(
        help="With --superlink: the SuperNode's --node-config (partition-id, data-path, state-dir).")] = None,
    superlink_ca: Annotated[Path | None, typer.Option(
        help="With --superlink: the CA certificate of the SuperLink's TLS (its ca.crt).")] = None,
    key: Annotated[Path | None, typer.Option(
        help="With --superlink: this device's private key for SuperNode authentication.")] = None,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="With --superlink: no TLS to the SuperLink (a trusted lab network only).")] = False,
    poll_s: Annotated[float, typer.Option(
        help="With --superlink: ask the SuperLink for work every this many seconds when idle (Flower's own "
             "pace is 3).", min=0.05, max=3.0)] = 0.5,
) -> None:
    """Run this device's ClientApp tasks in one long-lived process: imports and the base model once, not per
    message (docs/deployment.md). With --superlink it also starts this device's SuperNode and keeps it
    running. Stop it with Ctrl-C or SIGTERM."""
    import signal

    from ondevice_moe.federation.device_runtime import serve

    supervisor = None
    try:
        if superlink is not None:
            supervisor = _supervised_supernode(superlink, node_config, superlink_ca, key, insecure, runtime_api,
                                               poll_s)
            signal.signal(signal.SIGTERM, _interrupted)  # a service manager's stop: stop the SuperNode too
        serve(runtime_api, root_certificates)
    except UserError as error:
        _fail(error)
    except KeyboardInterrupt:
        raise typer.Exit(code=0) from None
    finally:
        if supervisor is not None:
            supervisor.stop()


def _interrupted(*_: object) -> None:
    raise KeyboardInterrupt


def _supervised_supernode(superlink: str, node_config: str | None, ca: Path | None, key: Path | None,
                          insecure: bool, runtime_api: str, poll_s: float):
    """Start this device's SuperNode (and keep it running) for ``ondevice-moe device --superlink``."""
    from flwr.supercore import log

    from ondevice_moe.federation.supervisor import Supervisor, supernode_command

    if node_config is None:
        raise UserError("--superlink needs --node-config", "give the device's partition-id, data-path and state-dir "
                        "(docs/deployment.md)")
    if (ca is None) == (not insecure):
        raise UserError("give --superlink-ca (TLS, the default) or --insecure, one of them",
                        "copy the federation's ca.crt to this device and pass --superlink-ca ca.crt")
    port = runtime_api.rpartition(":")[2]
    if not port.isdigit():
        raise UserError(f"--runtime-api {runtime_api} has no port", "give HOST:PORT, e.g. 127.0.0.1:9094")
    supervisor = Supervisor(supernode_command(superlink, node_config, int(port), ca, key, poll_s), log)
    supervisor.start()
    return supervisor


@app.command("inspect")
def inspect_routing(
    run: Annotated[Path, typer.Argument(help="A run folder written by `ondevice-moe finetune`.")],
    method: Annotated[str, typer.Option(help="A method of the run, e.g. comigs-1G1S or hermes.")],
    user: Annotated[str, typer.Option(help="A user of the run (its device's model is inspected).")],
    to: Annotated[Path, typer.Option(help="The HTML page to write; its PNGs go beside it (OUT_*.png).")],
    text: Annotated[str | None, typer.Option(help="Text to route (default: the start of the user's test split).")
                    ] = None,
    file: Annotated[Path | None, typer.Option(help="A UTF-8 text file to route instead of --text.")] = None,
    trust_plugins: Annotated[bool, typer.Option(
        "--trust-plugins", help="Run the code of the method plug-in files the recipe names (plugins:).")] = False,
) -> None:
    """Write a page of a user's routing: tokens coloured by expert per layer, scores and bytes over rounds."""
    _trust(trust_plugins)
    try:
        check_file_destination(to, "--to", "routing.html")  # before torch loads
        source = "your text"
        if text is not None and file is not None:
            raise UserError("both --text and --file given", "pass one of them (or neither, for the user's test split)")
        if file is not None:
            source = f"file {file}"
            if file.exists() and not file.is_file():  # a FIFO or device would block the read
                raise UserError(f"--file {file} is not a regular file", "pass a readable UTF-8 text file")
            if file.is_file() and file.stat().st_size > MAX_INSPECT_BYTES:
                raise UserError(f"--file {file} is {file.stat().st_size / 2**20:.1f} MiB; a routing page shows at most "
                                f"{MAX_INSPECT_BYTES // 2**10} KiB of text", "pass a passage of it")
            try:
                text = file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise UserError(f"cannot read --file {file} ({getattr(error, 'strerror', None) or error})",
                                "pass a readable UTF-8 text file") from None
        from ondevice_moe.inspect import write_inspection

        written = write_inspection(run, method, user, text, to, source)
    except UserError as error:
        _fail(error)
    console.print("wrote " + ", ".join(str(path) for path in written))


@app.command()
def generate(
    run: Annotated[Path, typer.Argument(help="A language-modelling run folder written by `ondevice-moe finetune`.")],
    method: Annotated[str, typer.Option(help="A method of the run, e.g. comigs-1G1S.")],
    user: Annotated[str, typer.Option(help="A user of the run: its device's model (experts, routers) writes.")],
    prompt: Annotated[str, typer.Option(help="The text to continue.")],
    max_new_tokens: Annotated[int, typer.Option(help="At most this many new tokens.")] = 50,
    temperature: Annotated[float, typer.Option(help="0: greedy; above 0: sampled from softmax(logits / T).")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens (0: all).")] = 0,
    top_p: Annotated[float, typer.Option(help="Sample within the smallest set of this much mass (1.0: all).")] = 1.0,
    seed: Annotated[int, typer.Option(help="The sampling seed: the same seed gives the same text.")] = 0,
    raw: Annotated[bool, typer.Option(
        "--raw", help="Continue the prompt as it is, without an instruction run's chat template.")] = False,
    device: Annotated[Device | None, typer.Option(help=DEVICE_HELP + " Default: the run's recipe.")] = None,
    trust_plugins: Annotated[bool, typer.Option(
        "--trust-plugins", help="Run the code of the method plug-in files the recipe names (plugins:).")] = False,
) -> None:
    """Continue a prompt with one user's trained model (the prompt in bold, then the model's text as it is
    written). An instruction run's prompt goes through its chat template unless --raw."""
    _trust(trust_plugins)
    started: list[bool] = []

    def show(piece: str) -> None:
        if not started:
            console.print(Text(prompt, "bold"), end="", soft_wrap=True)
            started.append(True)
        console.print(Text(piece), end="", soft_wrap=True)

    try:
        from ondevice_moe.generate import generate_text

        result = generate_text(run, method, user, prompt, max_new_tokens, temperature, seed, device, top_k=top_k,
                               top_p=top_p, raw=raw, on_text=show)
    except UserError as error:
        _fail(error)
    if not started:
        console.print(Text(prompt, "bold"), end="", soft_wrap=True)
    console.print()
    if not result.continuation.strip():
        how = ("it went through the run's chat template; try --raw" if result.templated else
               "try a longer prompt or --temperature above 0")
        console.print(f"[bold yellow]note:[/] the model wrote no text after the prompt ({result.new_tokens} "
                      f"new tokens): {how}")


@app.command()
def compare(
    runs: Annotated[list[Path], typer.Argument(
        help="Run folders, e.g. one per seed; A+B joins folders of one seed (their methods side by side, A's "
             "where both hold one); B@LABEL names B's methods <method>@LABEL.")],
    against: Annotated[str | None, typer.Option(
        help="Add the paired test of every method against this one (per run and user).")] = None,
    per_round: Annotated[bool, typer.Option(
        "--per-round", help="Also both tables after every evaluated round (from each run's metrics.jsonl).")] = False,
) -> None:
    """Compare runs: per method the mean (std) over runs, and with --against the paired test (docs/runs.md)."""
    from ondevice_moe.compare import comparison

    try:
        text = comparison(runs, against, per_round)
    except UserError as error:
        _fail(error)
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _trust(trust_plugins: bool) -> None:
    if trust_plugins:
        from ondevice_moe.methods.plugins import trust_plugins as trust

        trust()


@methods_app.command("list")
def list_methods(
    recipe: Annotated[Path | None, typer.Option(
        help="Also the methods of this recipe's plug-in files (plugins:), loaded with --trust-plugins.")] = None,
    trust_plugins: Annotated[bool, typer.Option(
        "--trust-plugins", help="Run the code of the method plug-in files the recipe names (plugins:).")] = False,
) -> None:
    """List every method, the tasks it runs on, and where it comes from (built in, a package, a file)."""
    from ondevice_moe.methods.registry import METHODS, method_origins
    from ondevice_moe.recipe import load_recipe

    _trust(trust_plugins)
    try:
        if recipe is not None:
            load_recipe(find_recipe(recipe))
        origins = method_origins()
    except UserError as error:
        _fail(error)
    table = Table(title="Methods")
    for column in ("method", "tasks", "from"):
        table.add_column(column)
    for name, origin in origins.items():
        table.add_row(name, ", ".join(sorted(METHODS[name].tasks)), origin)
    console.print(table)


@app.command("new-method")
def new_method(
    name: Annotated[str, typer.Argument(help="The method's name in recipes, e.g. fedprox.")],
    dest: Annotated[Path, typer.Argument(help="The folder to write the method's package into.")],
    template: Annotated[str, typer.Option(
        help="What to start from: proximal (a device-side loss term, FedProx), private-head (the head stays "
             "on the device, FedPer), custom-rule (a server rule, FedAvgM's momentum).")] = "proximal",
    task: Annotated[str, typer.Option(
        help="small (the digits MLP) or language (a causal language model with LoRA experts; proximal and "
             "custom-rule).")] = "small",
) -> None:
    """Scaffold a method folder (options, layout, procedure or sharing, server rule, a tiny recipe, a test) that
    runs as generated: `ondevice-moe finetune DEST/NAME/recipe.yaml --trust-plugins`."""
    from ondevice_moe.methods.scaffold import scaffold

    try:
        folder = scaffold(name, dest, template, task)
    except UserError as error:
        _fail(error)
    files = ", ".join(sorted(path.name for path in folder.iterdir()))
    console.print(f"wrote {folder}: {files}")
    console.print(f"run it: ondevice-moe finetune {folder / 'recipe.yaml'} --trust-plugins")


@recipes_app.command("list")
def list_recipes() -> None:
    """List the bundled recipes with their descriptions."""
    import yaml

    table = Table(title=f"Recipes in {BUNDLED_RECIPES}")
    table.add_column("recipe")
    table.add_column("description")
    for path in sorted(BUNDLED_RECIPES.glob("*.yaml")):
        description = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("description", "")
        table.add_row(path.name, str(description).strip().splitlines()[0] if description else "")
    console.print(table)


@recipes_app.command("show")
def show_recipe(name: Annotated[str, typer.Argument(help="A bundled recipe, e.g. demo or demo.yaml.")]) -> None:
    """Print a bundled recipe's YAML."""
    try:
        path = bundled_recipe(name)
    except UserError as error:
        _fail(error)
    _print_yaml(path.read_text(encoding="utf-8"))


@recipes_app.command("copy")
def copy_recipe(
    name: Annotated[str, typer.Argument(help="A bundled recipe, e.g. demo or demo.yaml.")],
    dest: Annotated[Path, typer.Argument(help="The file to write, or a folder to write NAME.yaml into.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite DEST if it exists.")] = False,
) -> None:
    """Copy a bundled recipe to edit it; the copy's `name:` (its run folder, runs/NAME) is its file's name."""
    try:
        source = bundled_recipe(name)
        target = dest / source.name if dest.is_dir() else dest
        if target.exists() and not force:
            raise UserError(f"{target} already exists", "choose another DEST, or pass --force to overwrite it")
        if not target.parent.is_dir():
            raise UserError(f"folder {target.parent} does not exist", "create it first, or choose another DEST")
    except UserError as error:
        _fail(error)
    name = name_for_file(target.stem)
    target.write_text(renamed_recipe(source.read_text(encoding="utf-8"), name), encoding="utf-8")
    console.print(f"wrote {target} (name: {name}: its runs go to runs/{name})")


def name_for_file(file_stem: str) -> str:
    """A recipe name (a run folder's name) from a file's: each character a name cannot hold as ``-``."""
    return re.sub(r"[^A-Za-z0-9._+-]", "-", file_stem).lstrip(".")[:100] or "recipe"


def renamed_recipe(text: str, name: str) -> str:
    """A recipe's YAML with its top-level ``name:`` set to ``name``, every other line (comments too) as written."""
    return re.sub(r"^name:.*$", lambda _: f"name: {name}", text, count=1, flags=re.MULTILINE)


def _print_yaml(text: str) -> None:
    """YAML as written: no markup, no wrapping, so the output can be redirected to a file."""
    console.print(text.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)


def _print_plan(recipe: Recipe, output: Path | None, read_data: bool = True) -> None:
    """The resolved recipe, then per method the devices and their trained and uploaded parameters, then
    what each user's data holds (``read_data``; read first, so bad data fails as in a real run)."""
    import yaml

    from ondevice_moe.plan import plan_recipe
    from ondevice_moe.report import format_bytes
    from ondevice_moe.runner import check_inputs

    counts = check_inputs(recipe) if read_data else None
    _print_yaml(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    federation = recipe.federation
    work = (f"{federation.local_epochs} local epoch(s)" if federation.local_epochs
            else f"{federation.local_iterations} local iterations")
    console.print(f"[bold]plan[/]: {len(recipe.methods)} method(s), {len(recipe.user_names)} devices, "
                  f"{federation.rounds} rounds of {work}, run folder {output or Path('runs') / recipe.name}")
    table = Table(title="Parameters per device (uploaded: sent to the server each round)")
    for column in ("method", "devices", "trainable", "uploaded", "upload / round / device"):
        table.add_column(column, justify="left" if column in ("method", "devices") else "right",
                         no_wrap=column == "method")
    for method in plan_recipe(recipe, Path(output or Path("runs") / recipe.name)):
        for devices, plan in _group_devices(method.devices):
            table.add_row(method.name, devices, f"{plan.trainable:,}", f"{plan.uploaded:,}",
                          format_bytes(plan.uploaded_bytes))
    _print_table(table)
    if counts is None:
        console.print("data: each device reads its own (--federation); none was read here")
    else:
        _print_table(_data_table(counts))
    console.print("dry run: nothing was trained")


def _data_table(counts: list[UserCounts]) -> Table:
    """Per user: a language model's blocks and tokens per split, or a task's examples and training labels."""
    from ondevice_moe.plan import TextCounts

    if all(isinstance(user, TextCounts) for user in counts):
        splits = ("train", "valid", "test")
        responses = any(user.instructions for user in counts)
        table = Table(title="Data per user (tokens as trained and scored, padding left out)")
        columns = ("user", *(f"{split} tokens" for split in splits), "blocks train / valid / test",
                   *(("scored (responses) train / valid / test",) if responses else ()))
        for column in columns:
            table.add_column(column, justify="left" if column == "user" else "right")
        for user in counts:
            scored = (" / ".join(f"{user.scored[split]:,}" for split in splits),) if responses else ()
            table.add_row(escape(user.user), *(f"{user.tokens[split]:,}" for split in splits),
                          " / ".join(f"{user.blocks[split]:,}" for split in splits), *scored)
        return table
    table = Table(title="Data per client (examples as dealt)")
    splits = [split for split in ("train", "valid", "test") if split in counts[0].examples]
    for column in ("client", *splits, "training labels"):
        table.add_column(column, justify="right" if column in splits else "left")
    for user in counts:
        labels = "scores" if user.labels is None else ", ".join(f"{name} {n}" for name, n in user.labels.items())
        table.add_row(escape(user.user), *(f"{user.examples[split]:,}" for split in splits), escape(labels))
    return table


def _group_devices(devices: tuple[DevicePlan, ...]) -> list[tuple[str, DevicePlan]]:
    """Runs of consecutive devices with the same counts, as ("0-3", plan of device 0)."""
    groups: list[list[DevicePlan]] = []
    for plan in devices:
        same = groups and (groups[-1][-1].trainable, groups[-1][-1].uploaded_bytes) == (plan.trainable,
                                                                                         plan.uploaded_bytes)
        if same:
            groups[-1].append(plan)
        else:
            groups.append([plan])
    return [(str(g[0].device) if len(g) == 1 else f"{g[0].device}-{g[-1].device}", g[0]) for g in groups]


def _fail(error: UserError) -> NoReturn:
    _show(error)
    raise typer.Exit(code=error.exit_code)


def _show(error: UserError) -> None:
    console.print(f"[bold red]error:[/] {escape(error.problem)}")
    if error.fix:
        console.print(f"[bold]fix:[/] {escape(error.fix)}")


FULL = {errno.ENOSPC: "no space is left", errno.EDQUOT: "the disk quota is used up",
        errno.EFBIG: "the file grew too big"}  # a write that failed for want of room


def main() -> None:
    """The CLI; a disk that fills up or refuses a write mid-command ends in one message, not a traceback
    (what was written before stays: every file is written whole or not at all)."""
    set_run_environment()
    try:
        app()
    except OSError as error:
        if error.errno not in (*FULL, errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        where = f" for {error.filename}" if error.filename else ""
        why = FULL.get(error.errno) or f"the write was refused ({error.strerror})"
        problem = UserError(f"{why}{where}", "free some space or choose a place you can write, then run the same "
                            "command again: what was finished is kept")
        _show(problem)
        raise SystemExit(problem.exit_code) from None
