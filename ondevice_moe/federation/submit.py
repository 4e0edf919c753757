"""``ondevice-moe finetune RECIPE --federation NAME``: each method of the recipe, submitted with
Flower's own ``flwr run`` to the SuperLink that Flower's connection config names ``NAME``
(``$FLWR_HOME/config.toml``, ``[superlink.NAME]``; docs/deployment.md).

The recipe travels whole in the run config (``recipe-json``), so neither the server nor a device
needs the recipe file, and the server's recipe names no device path (``source: device``). The
ServerApp writes the server's run folder (``run-dir``: recipe, ``metrics.jsonl``, ``summary.json``,
``report.md``, plots, the shared state) where the SuperLink runs it; this command follows that
folder's ``metrics.jsonl`` for progress and reads its ``done`` or ``error`` record for the outcome,
because ``flwr run`` exits 0 whether the ServerApp finished or failed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import tomli
import tomli_w

from ondevice_moe.distribution import VERSION
from ondevice_moe.errors import UserError
from ondevice_moe.federation.job import Job
from ondevice_moe.report import CorruptLog, MetricsLog

POLL_SECONDS = 1.0
APP_COMPONENTS = {"serverapp": "ondevice_moe.federation.server_app:app",
                  "clientapp": "ondevice_moe.federation.client_app:app"}


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


def write_app(folder: Path, job: Job) -> tuple[Path, Path]:
    """A Flower app folder declaring the toolkit's two apps, and a run-config file carrying the job."""
    app = folder / "app"
    app.mkdir()
    project = {"build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
               "project": {"name": "ondevice-moe-run", "version": VERSION, "dependencies": []},
               "tool": {"flwr": {"app": {"publisher": "ondevice-moe", "components": APP_COMPONENTS,
                                         "config": {"recipe": "", "recipe-json": "", "method": 0, "run-dir": ""}}}}}
    (app / "pyproject.toml").write_text(tomli_w.dumps(project), encoding="utf-8")
    run_config = folder / "run-config.toml"
    run_config.write_text(tomli_w.dumps({"recipe-json": json.dumps(job.recipe.model_dump(mode="json")),
                                         "method": job.method_index, "run-dir": str(job.run_dir.resolve())}),
                          encoding="utf-8")
    return app, run_config


def submit(job: Job, federation: str, on_round: Callable[[int, int, str], None] | None = None) -> None:
    """Run one method on the SuperLink ``federation`` with ``flwr run``, following its progress; the
    outcome is the run folder's: a ``done`` record, or a :class:`UserError` with the ServerApp's error."""
    flwr = shutil.which("flwr") or str(Path(sys.executable).with_name("flwr"))
    log = MetricsLog(job.run_dir / "metrics.jsonl")
    flower_log = job.run_dir / f"flwr-{job.method_index}.log"
    with tempfile.TemporaryDirectory(prefix="ondevice-moe-app-") as folder:
        app, run_config = write_app(Path(folder), job)
        command = [flwr, "run", str(app), federation, "--run-config", str(run_config), "--stream"]
        env = {**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1"}
        with flower_log.open("w", encoding="utf-8") as output:
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
            shown = 0
            while process.poll() is None:
                shown = _follow(log, job, on_round, shown)
                time.sleep(POLL_SECONDS)
    _follow(log, job, on_round, shown)
    records = [r for r in log.read() if r.get("method") == job.method.name]
    if any(r["kind"] == "done" for r in records):
        return
    errors = [r["message"] for r in records if r["kind"] == "error"]
    cause = errors[-1] if errors else _last_lines(flower_log)
    raise UserError(f"method '{job.method.name}' did not finish on the SuperLink '{federation}': {cause}",
                    f"see {flower_log} and the SuperLink's log; fix the cause and run the same command again "
                    "(finished methods are kept)")


def _follow(log: MetricsLog, job: Job, on_round: Callable[[int, int, str], None] | None, shown: int) -> int:
    """Report rounds the run folder has finished since round ``shown``; returns the last one reported."""
    if on_round is None or not log.path.exists():
        return shown
    try:
        records = [r for r in log.read() if r.get("method") == job.method.name]
    except CorruptLog:  # a line being written as it is read: the next look finds it whole
        return shown
    for record in records:
        if record["kind"] == "comm" and record["round"] > shown:
            shown = record["round"]
            on_round(shown, job.recipe.federation.rounds,
                     f"round {shown}, {record['devices']} devices, dropped {record['dropped']}")
    return shown


def _last_lines(path: Path, count: int = 3) -> str:
    lines = [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return " / ".join(lines[-count:]) or "flwr run printed nothing"
