"""What every way in (the ``ondevice-moe`` command, the Python API) does before a run: the process
environment it sets, and how a recipe argument is found (a file, or a bundled recipe's name)."""

from __future__ import annotations

import os
from pathlib import Path

from ondevice_moe.distribution import BUNDLED_RECIPES
from ondevice_moe.errors import UserError

RUN_ENVIRONMENT = {
    "FLWR_TELEMETRY_ENABLED": "0",  # no phone-home thread (and no network here)
    "FLWR_LOG_LEVEL": "ERROR",  # Flower's INFO lines and run_simulation's deprecation notice
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
    # OpenMP threads sleep instead of spinning when they wait. With the cores shared (several
    # simulated clients, or any other job) spinning threads starve the ones with work: a
    # FLoRAL step on SmolLM2 took 72-115 s with spinning and 6-10 s without, on 2 threads
    # of a busy 2-core machine. Read when torch loads, so it is set before any import of it.
    "OMP_WAIT_POLICY": "PASSIVE",
}


def set_run_environment() -> None:
    """Set :data:`RUN_ENVIRONMENT` where the user has not set a value."""
    for key, value in RUN_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def bundled_recipe(name: str) -> Path:
    """The bundled recipe called ``name`` (with or without ``.yaml``)."""
    path = BUNDLED_RECIPES / Path(name).name
    for candidate in (path, path.with_name(f"{path.name}.yaml")):
        if candidate.is_file():
            return candidate
    names = ", ".join(p.stem for p in sorted(BUNDLED_RECIPES.glob("*.yaml")))
    raise UserError(f"no bundled recipe '{name}'", f"use one of: {names}")


def find_recipe(recipe: Path) -> Path:
    """A readable recipe file: the path as given, or the name of a bundled recipe; a missing path that
    names no bundled recipe comes back as given, for the recipe loader to report missing."""
    if not recipe.exists():
        try:
            return bundled_recipe(str(recipe))
        except UserError:
            return recipe
    if recipe.is_dir():
        raise UserError(f"recipe {recipe} is a folder, not a YAML file",
                        f"pass a .yaml file, e.g. {recipe / 'recipe.yaml'} (a run folder holds one)")
    if not recipe.is_file():  # a FIFO, a socket or a device: reading it would block or never end
        raise UserError(f"recipe {recipe} is not a regular file", "pass a YAML file")
    try:
        with recipe.open("rb"):
            pass
    except OSError as error:
        raise UserError(f"cannot read recipe {recipe} ({error.strerror or error})",
                        "check the file's permissions (e.g. chmod u+r) or copy it somewhere readable") from None
    return recipe
