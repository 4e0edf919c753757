"""``ondevice-moe finetune RECIPE --federation NAME``: the recipe as one Flower run on the SuperLink
that Flower's connection config names ``NAME`` (``$FLWR_HOME/config.toml``, ``[superlink.NAME]``;
docs/deployment.md), driven with Flower's own commands: ``flwr run`` starts it, ``flwr log
--stream`` follows it, ``flwr ls`` asks after it, ``flwr stop`` ends it.

The submitting machine shares nothing with the server but the network. The recipe travels whole
in the run config (``recipe-json``) with the run's name (``run-name``: the last part of
``--output``); the ServerApp keeps the run folder on its own disk
(:mod:`ondevice_moe.federation.server_runs`) and writes its progress, outcome and files into its
log (:mod:`ondevice_moe.federation.log_channel`), which this command follows and from which it
writes ``--output``: ``recipe.yaml``, ``metrics.jsonl``, ``summary.json``, ``report.md``, plots.

A run is Flower's, not this command's. ``--output/.flower-run.json`` names the Flower run last
started for it; a rerun follows that run if it still lives. When the log breaks off without an
outcome (this command or the server went down), it starts a new Flower run of the same run: its
ServerApp either continues the run from its last completed round or, finding another ServerApp
driving the folder, says which Flower run that is (``busy``), and this command follows that one.
A Flower run someone stopped (``--stop``, ``flwr stop``) ends the command; the same command run
again continues it. (A stopped run's log takes nothing more: the ServerApp writes its report on
the server, and the files come with the run's end.)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli
import tomli_w

from ondevice_moe.distribution import VERSION
from ondevice_moe.errors import UserError
from ondevice_moe.federation.job import ALL_METHODS
from ondevice_moe.federation.log_channel import PREFIX, ChannelReader
from ondevice_moe.names import name_problem
from ondevice_moe.recipe import Recipe

APP_COMPONENTS = {"serverapp": "ondevice_moe.federation.server_app:app",
                  "clientapp": "ondevice_moe.federation.client_app:app"}
RECORD = ".flower-run.json"  # in --output: the Flower run last started for this run
FLOWER_LOG = "flwr.log"  # in --output: what Flower printed, the files' parts left out
REACH_PATIENCE_S = 600.0  # how long to wait for an unreachable SuperLink before giving up
ATTEMPTS = 4  # Flower runs in a row that end without a word from the ServerApp before giving up
START_TRIES = 3  # `flwr run`s in a row that the SuperLink does not take before giving up
STOPPED = "finished:stopped"  # a Flower run someone stopped (`flwr ls`)
FINISHED = "finished"  # any ended Flower run's status begins so

OnMethod = Callable[[str, int, int], None]
OnRound = Callable[[int, int, str], None]


def flower_home() -> Path:
    """Flower's home folder, where its CLI keeps ``config.toml`` (``$FLWR_HOME``, else ``~/.flwr``)."""
    return Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")


def connection(name: str) -> dict[str, object]:
    """The ``[superlink.NAME]`` entry of Flower's connection config; a missing one is a :class:`UserError`."""
    config_file = flower_home() / "config.toml"
    fix = (f"add [superlink.{name}] with `address` (and `root-certificates`, or `insecure = true`) to {config_file} "
           "(docs/deployment.md)")
    try:
        config = tomli.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"Flower's connection config {config_file} does not exist", fix) from None
    except (OSError, UnicodeDecodeError, tomli.TOMLDecodeError) as error:
        raise UserError(f"cannot read Flower's connection config {config_file} ({error})", fix) from None
    entry = config.get("superlink", {}).get(name)
    if not isinstance(entry, dict) or "address" not in entry:
        known = sorted(key for key, value in config.get("superlink", {}).items() if isinstance(value, dict))
        raise UserError(f"Flower's connection config {config_file} names no SuperLink '{name}' (it has {known})", fix)
    return entry


def run_name(output: Path) -> str:
    """The run's name on the server: the last part of ``--output``."""
    name = Path(output).absolute().name
    problem = name_problem("the run's name (the last part of --output)", name)
    if problem:
        raise UserError(problem, "choose an --output folder whose last part is a plain name")
    return name


def write_app(folder: Path, recipe: Recipe, name: str, overwrite: bool = False,
              bound: dict[int, str] | None = None) -> tuple[Path, Path]:
    """A Flower app folder declaring the toolkit's two apps, and a run-config file carrying the run:
    the recipe, its name, every method, ``overwrite`` and the slots bound to keys."""
    app = folder / "app"
    app.mkdir()
    project = {"build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
               "project": {"name": "ondevice-moe-run", "version": VERSION, "dependencies": []},
               "tool": {"flwr": {"app": {"publisher": "ondevice-moe", "components": APP_COMPONENTS,
                                         "config": {"recipe": "", "recipe-json": "", "method": 0, "run-name": "",
                                                    "overwrite": False, "bind": ""}}}}}
    (app / "pyproject.toml").write_text(tomli_w.dumps(project), encoding="utf-8")
    run_config = folder / "run-config.toml"
    run_config.write_text(tomli_w.dumps({"recipe-json": json.dumps(recipe.model_dump(mode="json")),
                                         "method": ALL_METHODS, "run-name": name, "overwrite": overwrite,
                                         "bind": json.dumps({str(k): v for k, v in (bound or {}).items()})}),
                          encoding="utf-8")
    return app, run_config


@dataclass
class Flower:
    """Flower's CLI against the SuperLink ``federation``, with Flower's output going to ``log``."""

    federation: str
    log: Path

    def command(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        flwr = shutil.which("flwr") or str(Path(sys.executable).with_name("flwr"))
        env = {**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1"}
        return subprocess.run([flwr, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)

    def start(self, app: Path, run_config: Path, patience: float = REACH_PATIENCE_S) -> int:
        """Start a Flower run of the app; its run id. A SuperLink that does not answer is waited for
        (:meth:`wait_until_reachable`) and asked again."""
        for attempt in range(START_TRIES):
            done = self.command("run", str(app), self.federation, "--run-config", str(run_config), "--format",
                                "json")
            self._note(done.stdout + done.stderr)
            with contextlib.suppress(ValueError, KeyError, TypeError):
                return int(json.loads(done.stdout[done.stdout.index("{"):])["run-id"])
            if attempt + 1 < START_TRIES:
                time.sleep(2.0)
                self.wait_until_reachable(patience)
        raise UserError(f"the SuperLink '{self.federation}' did not start the run: {_last_lines(done)}",
                        "check that the SuperLink is up and Flower's connection config names it right "
                        "(docs/deployment.md)")

    def status(self, run: int) -> str | None:
        """The Flower run's status (``running``, ``finished:stopped``, ...); ``None`` if the SuperLink won't say."""
        done = self.command("ls", self.federation, "--run-id", str(run), "--format", "json", timeout=60.0)
        with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
            return str(json.loads(done.stdout[done.stdout.index("{"):])["runs"][0]["status"])
        return None

    def stop(self, run: int) -> subprocess.CompletedProcess:
        return self.command("stop", str(run), self.federation)

    def follow(self, run: int, reader: ChannelReader, on_event: Callable[[str, dict[str, Any]], None]) -> None:
        """Read the run's log (``flwr log --stream``) until the run ends or the stream breaks."""
        flwr = shutil.which("flwr") or str(Path(sys.executable).with_name("flwr"))
        env = {**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1", "COLUMNS": "200"}
        with self.log.open("a", encoding="utf-8") as kept, subprocess.Popen(
                [flwr, "log", str(run), self.federation, "--stream"], stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, env=env, errors="replace") as process:
            for line in process.stdout:
                event = reader.feed(line)
                if event is not None:
                    on_event(*event)
                if not (line.startswith(PREFIX) and " file " in line[:80]):
                    kept.write(line)

    def wait_until_reachable(self, patience: float) -> None:
        """Wait (with growing pauses) until the SuperLink answers; a :class:`UserError` after ``patience`` s."""
        deadline, pause = time.monotonic() + patience, 2.0
        while self.command("ls", self.federation, "--format", "json", timeout=60.0).returncode != 0:
            if time.monotonic() > deadline:
                raise UserError(f"the SuperLink '{self.federation}' has not answered for {patience:.0f}s",
                                "bring it back up (on its --database) and run the same command again: the run "
                                "continues from its last completed round")
            time.sleep(pause)
            pause = min(2 * pause, 30.0)

    def _note(self, text: str) -> None:
        with self.log.open("a", encoding="utf-8") as kept:
            kept.write(text)


def submit_run(recipe: Recipe, output: Path, federation: str, on_method: OnMethod | None = None,
               on_round: OnRound | None = None, overwrite: bool = False, bound: dict[int, str] | None = None,
               patience: float = REACH_PATIENCE_S) -> dict[str, Any]:
    """Run ``recipe`` on the SuperLink ``federation`` (or follow its Flower run, if one lives), writing
    the server's run folder's files into ``output``; returns the ServerApp's outcome (``finished``,
    ``failed`` or ``stopped``, and why)."""
    name = run_name(output)
    output.mkdir(parents=True, exist_ok=True)
    flower = Flower(federation, output / FLOWER_LOG)
    record = _read_record(output, federation)
    if record is not None and (flower.status(record) or "").startswith(FINISHED):
        record = None  # it ended (stopped, failed, or done while no one followed it): a new one continues the run
    fresh = overwrite  # the first Flower run started here replaces the run on the server
    quiet = 0

    def on_event(kind: str, payload: dict[str, Any]) -> None:
        nonlocal quiet
        quiet = 0
        if kind == "method" and on_method is not None:
            on_method(str(payload.get("name")), int(payload.get("index", 0)), int(payload.get("count", 1)))
        elif kind == "round" and on_round is not None:
            on_round(int(payload.get("round", 0)), int(payload.get("total", 0)), str(payload.get("line", "")))

    while True:
        if record is None:
            with tempfile.TemporaryDirectory(prefix="ondevice-moe-app-") as folder:
                app, run_config = write_app(Path(folder), recipe, name, fresh, bound)
                record = flower.start(app, run_config, patience)
            fresh = False
            _write_record(output, federation, record)
        reader = ChannelReader()
        flower.follow(record, reader, on_event)
        outcome = reader.outcome
        _write_files(output, reader.files())
        if outcome is not None and outcome["status"] == "busy":
            record = int(outcome["flower_run"])
            _write_record(output, federation, record)
            continue
        if outcome is not None:
            return outcome
        if flower.status(record) == STOPPED:  # `--stop` or `flwr stop`: the run ends here, until it is run again
            return {"status": "stopped", "message": f"Flower run {record} was stopped"}
        quiet += 1  # the log broke off: this command's link, the SuperLink, or the ServerApp's machine went down
        if quiet >= ATTEMPTS:
            raise UserError(f"{ATTEMPTS} Flower runs in a row ended without a word from the ServerApp (last: run "
                            f"{record})", f"see `flwr log {record} {federation}` and {output / FLOWER_LOG}")
        flower.wait_until_reachable(patience)
        record = None  # a new Flower run continues the run, or names the live one that drives it (busy)


def stop_run(output: Path, federation: str) -> int:
    """Stop the Flower run that drives the run of ``output`` (``flwr stop``); returns its id."""
    record = _read_record(output, federation)
    if record is None:
        raise UserError(f"{output} names no Flower run on the SuperLink '{federation}'",
                        f"find it with `flwr ls {federation}` and stop it with `flwr stop RUN_ID {federation}`")
    done = Flower(federation, output / FLOWER_LOG).stop(record)
    if done.returncode != 0:
        raise UserError(f"Flower could not stop run {record}: {_last_lines(done)}",
                        f"see `flwr ls {federation}`: a run that finished needs no stop")
    return record


def _read_record(output: Path, federation: str) -> int | None:
    path = output / RECORD
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError, AttributeError):
        kept = json.loads(path.read_text(encoding="utf-8"))
        if kept.get("federation") == federation:
            return int(kept["flower_run"])
    return None


def _write_record(output: Path, federation: str, run: int) -> None:
    _write_file(output / RECORD, json.dumps({"federation": federation, "flower_run": run}).encode())


def _write_files(output: Path, files: dict[str, bytes]) -> None:
    """The run folder's files as they came, each written whole, never through a link."""
    for name, data in files.items():
        target = output / name
        target.parent.mkdir(exist_ok=True)
        _write_file(target, data)


def _write_file(path: Path, data: bytes) -> None:
    partial = path.with_name(f".{path.name}.partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(handle, "wb") as file:
        file.write(data)
    os.replace(partial, path)  # replaces a link planted at ``path``, never writes through it


def _last_lines(done: subprocess.CompletedProcess, count: int = 3) -> str:
    text = (done.stdout or "") + (done.stderr or "")
    lines = [line.strip(" │╭╰─") for line in text.splitlines() if line.strip(" │╭╰─")]
    return " / ".join(lines[-count:]) or "Flower printed nothing"
