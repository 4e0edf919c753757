"""The job a Flower app runs: a validated recipe, the method to run, the run folder.

Under ``ondevice-moe finetune`` (Flower's simulation engine) the job travels as
a JSON file named by ``$ONDEVICE_MOE_JOB``. Under ``flwr run`` (simulation or
deployment) it comes from the run config: ``recipe`` (a path), ``method`` (the
index of the recipe's method entry) and ``run-dir``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from flwr.app import Context

from ondevice_moe import BUNDLED_RECIPES
from ondevice_moe.federation.rules import ServerRule
from ondevice_moe.methods import Method
from ondevice_moe.recipe import Recipe, load_recipe, validate_recipe
from ondevice_moe.training import TrainingConfig

JOB_ENV = "ONDEVICE_MOE_JOB"


@dataclass(frozen=True)
class Job:
    recipe: Recipe
    method_index: int
    run_dir: Path

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
            betas=t.betas, lr_schedule=t.lr_schedule, optimizer=t.optimizer,
        )

    def to_file(self, path: Path) -> Path:
        payload = {"recipe": self.recipe.model_dump(mode="json"), "method": self.method_index,
                   "run_dir": str(self.run_dir)}
        path.write_text(json.dumps(payload), encoding="utf-8")
        return path

    @classmethod
    def from_file(cls, path: str | Path) -> Job:
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(validate_recipe(payload["recipe"]), int(payload["method"]), Path(payload["run_dir"]))


_JOBS: dict[str, Job] = {}


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


def job_from_context(context: Context) -> Job:
    """The job of this run, from the run config (``flwr run``) or ``$ONDEVICE_MOE_JOB``."""
    config = context.run_config
    if config.get("recipe"):
        key = f"{config['recipe']}|{config.get('method', 0)}|{config.get('run-dir', '')}"
        if key not in _JOBS:
            recipe = load_recipe(_locate(str(config["recipe"])))
            run_dir = Path(str(config.get("run-dir") or Path("runs") / recipe.name))
            _JOBS[key] = Job(recipe, int(config.get("method", 0)), run_dir)
        return _JOBS[key]
    path = os.environ.get(JOB_ENV)
    if not path:
        raise RuntimeError(f"no job: set run config 'recipe' (flwr run) or ${JOB_ENV} (simulation)")
    if path not in _JOBS:
        _JOBS[path] = Job.from_file(path)
    return _JOBS[path]
