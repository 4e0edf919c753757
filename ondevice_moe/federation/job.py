"""The job a Flower app runs: a validated recipe, the method to run, the run folder.

Under ``ondevice-moe finetune`` (Flower's simulation engine) the jobs travel as
a JSON file named by ``$ONDEVICE_MOE_JOB``: the recipe, the run folder and the methods to run,
one after another in one simulation; each message names its method (``method`` in its config
record), so a device knows which method's job it serves. Under ``flwr run`` (simulation or
deployment) they come from the run config: ``recipe`` (a path) or ``recipe-json`` (the
recipe itself, as ``ondevice-moe finetune --federation`` sends it), ``method`` (the
index of the recipe's method entry, or -1 for every method in turn) and ``run-name`` (the run's
name: its folder is ``<server runs folder>/<run-name>`` where the ServerApp runs,
:func:`~ondevice_moe.federation.server_runs.server_run_dir`; default the recipe's name).

On a device under ``flwr run`` the job is :func:`device_job`: the same recipe and method, with
the device's own facts (:mod:`~ondevice_moe.federation.node`) and, as its run folder, its own
folder under ``state-dir``; nothing the server sends becomes a path there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from flwr.app import Context, Message

from ondevice_moe.distribution import BUNDLED_RECIPES
from ondevice_moe.errors import UserError
from ondevice_moe.federation.node import NodeFacts, node_facts
from ondevice_moe.federation.ray_cluster import enter_run_directory
from ondevice_moe.federation.server_runs import server_run_dir
from ondevice_moe.methods.base import Method
from ondevice_moe.recipe import Recipe, load_recipe, validate_recipe
from ondevice_moe.server_rules.rules import ServerRule
from ondevice_moe.training import TrainingConfig

JOB_ENV = "ONDEVICE_MOE_JOB"


@dataclass(frozen=True)
class Job:
    recipe: Recipe
    method_index: int
    run_dir: Path
    node: NodeFacts | None = None  # set on a device under ``flwr run``: what its --node-config says
    submitted: bool = False  # run by ``flwr run`` (a SuperLink), not ``ondevice-moe finetune``'s simulation

    @property
    def on_device(self) -> bool:
        """Whether this job runs on a real device (``flwr run``), which holds only its own data."""
        return self.node is not None

    @cached_property
    def method(self) -> Method:
        """The method of entry ``method_index``, resolved for the recipe's devices."""
        return self.recipe.method(self.method_index)

    @property
    def server_rule(self) -> ServerRule:
        """What the server keeps, sends and how it combines uploads, for this method."""
        return self.method.server_rule

    @property
    def batch_size(self) -> int:
        return self.recipe.data.batch_size if self.recipe.data else self.recipe.task.batch_size

    @property
    def training(self) -> TrainingConfig:
        t, fed = self.recipe.training, self.recipe.federation
        return TrainingConfig(
            lr=t.lr, router_lr=t.router_lr, router_period=t.router_period, router_steps=t.router_steps,
            balance_weight=t.balance_weight, batch_size=self.batch_size,
            total_iterations=fed.rounds * fed.local_iterations, warmup_fraction=t.warmup_fraction,
            grad_clip=t.grad_clip, weight_decay=t.weight_decay, router_weight_decay=t.router_weight_decay,
            betas=t.betas, lr_schedule=t.lr_schedule, optimizer=t.optimizer, momentum=t.momentum, compile=t.compile,
        )

    def to_file(self, path: Path, methods: list[int] | None = None) -> Path:
        """Write the job for the simulation's apps; ``methods``: the recipe's methods it runs (default: this one)."""
        payload = {"recipe": self.recipe.model_dump(mode="json"), "method": self.method_index,
                   "methods": methods or [self.method_index], "run_dir": str(self.run_dir)}
        path.write_text(json.dumps(payload), encoding="utf-8")
        return path

    def for_method(self, method_index: int) -> Job:
        """The same run's job for another of the recipe's methods."""
        if method_index == self.method_index:
            return self
        return Job(self.recipe, method_index, self.run_dir, self.node, self.submitted)


def jobs_from_file(path: str | Path) -> list[Job]:
    """The jobs of a file :meth:`Job.to_file` wrote, in the order they run."""
    payload = json.loads(Path(path).read_text(encoding="utf-8"))
    recipe, run_dir = validate_recipe(payload["recipe"]), Path(payload["run_dir"])
    return [Job(recipe, int(index), run_dir) for index in payload.get("methods", [payload["method"]])]


_JOBS: dict[str, list[Job]] = {}
_METHOD_JOBS: dict[tuple[int, int], Job] = {}


def _locate(recipe: str) -> Path:
    """A recipe path as given, else relative to the app folder (``flwr run`` runs elsewhere), else a
    bundled recipe of that name (Flower's app package skips the top-level ``recipes/`` link)."""
    path = Path(recipe)
    if path.is_absolute() or path.exists():
        return path
    app_dir = Path(__file__).resolve().parents[2]
    if (app_dir / path).exists():
        return app_dir / path
    return BUNDLED_RECIPES / path.name


def submitted(config: dict) -> bool:
    """Whether the run config carries the recipe (``flwr run``), rather than ``$ONDEVICE_MOE_JOB``."""
    return bool(config.get("recipe") or config.get("recipe-json"))


DEPLOYMENT_REPLY_TIMEOUT_S = 600.0


def with_deployment_defaults(recipe: Recipe) -> Recipe:
    """``recipe`` as it runs on real devices: where it does not set ``federation.reply_timeout_s``, the
    server waits :data:`DEPLOYMENT_REPLY_TIMEOUT_S` seconds for a device's reply (every device works at
    once there; the local simulation's default, an hour, suits devices that take turns on a few cores)."""
    federation = recipe.federation
    if "reply_timeout_s" in federation.model_fields_set:
        return recipe
    timeout = federation.model_copy(update={"reply_timeout_s": DEPLOYMENT_REPLY_TIMEOUT_S})
    return recipe.model_copy(update={"federation": timeout})


def _recipe_of(config: dict) -> Recipe:
    if config.get("recipe-json"):  # as `ondevice-moe finetune --federation` resolved it
        return validate_recipe(json.loads(str(config["recipe-json"])), source="the run config's recipe-json")
    return with_deployment_defaults(load_recipe(_locate(str(config["recipe"]))))


ALL_METHODS = -1  # run config ``method``: every method of the recipe, one after another


def jobs_from_context(context: Context) -> list[Job]:
    """The jobs of this run, in the order the ServerApp runs them: the run config's method, or all
    of the recipe's (``flwr run``), or the methods ``$ONDEVICE_MOE_JOB`` names (``ondevice-moe
    finetune``'s simulation)."""
    config = context.run_config
    if submitted(config):
        key = f"{config.get('recipe')}|{config.get('recipe-json')}|{config.get('method', 0)}|{config.get('run-name')}"
        if key not in _JOBS:
            recipe = _recipe_of(config)
            run_dir = server_run_dir(str(config.get("run-name") or recipe.name))
            method = int(config.get("method", 0))
            indices = range(len(recipe.methods)) if method == ALL_METHODS else [method]
            _JOBS[key] = [Job(recipe, index, run_dir, submitted=True) for index in indices]
        return _JOBS[key]
    path = os.environ.get(JOB_ENV)
    if not path:
        raise RuntimeError(f"no job: set run config 'recipe' (flwr run) or ${JOB_ENV} (simulation)")
    if path not in _JOBS:
        enter_run_directory()
        _JOBS[path] = jobs_from_file(path)
    return _JOBS[path]


def job_from_context(context: Context, method_index: int | None = None) -> Job:
    """The job of this run for method ``method_index`` of the recipe (what a message names; default:
    the run's first method)."""
    jobs = jobs_from_context(context)
    if method_index is None:
        return jobs[0]
    key = (id(jobs[0]), method_index)  # the run's jobs live as long as the process: their ids stay theirs
    if key not in _METHOD_JOBS:
        _METHOD_JOBS[key] = next((job for job in jobs if job.method_index == method_index), None) \
            or jobs[0].for_method(method_index)
    return _METHOD_JOBS[key]


def message_method(message: Message) -> int | None:
    """The recipe's method a message is for (``method`` in its config record), if it says."""
    config = message.content.config_records.get("config")
    return int(config["method"]) if config is not None and "method" in config else None


def device_job(context: Context, method_index: int | None = None) -> Job:
    """The job as a device runs it for method ``method_index``: under ``flwr run``, with the device's
    node facts and its own folder ``<state-dir>/<recipe>`` as the run folder; in ``ondevice-moe
    finetune``'s simulation, where every device is this machine, the job itself."""
    job = job_from_context(context, method_index)
    if not submitted(context.run_config):
        return job
    node = node_facts(context.node_config)
    devices = len(job.recipe.user_names)
    if node.partition_id >= devices:
        raise UserError(f"this device's partition-id is {node.partition_id}, but the recipe has {devices} devices "
                        f"(partition-ids 0 to {devices - 1})", "start the SuperNode with a partition-id in that range")
    key = (id(job), node)
    if key not in _DEVICE_JOBS:
        _DEVICE_JOBS[key] = Job(job.recipe, job.method_index, node.folder(job.recipe.name), node, submitted=True)
    return _DEVICE_JOBS[key]


_DEVICE_JOBS: dict[tuple[int, NodeFacts], Job] = {}
