"""A finished run's trained model for one user: what ``export`` and ``inspect`` open.

A run folder holds the recipe and one checkpoint per device and method
(``checkpoints/<method>/device_<i>.safetensors``). A user's model is its
device's model: the base with the device's experts attached and the
checkpoint loaded. The centralized upper bound has one device for every user.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.federation.job import Job
from ondevice_moe.recipe import Recipe


@dataclass(frozen=True)
class UserModel:
    """One user's trained model of one method, with where it came from."""

    recipe: Recipe
    job: Job
    device: int
    user: str
    model: nn.Module


def open_user_model(run_dir: Path, method: str, user: str, device: str | None = None) -> UserModel:
    """The trained model of ``user`` for ``method`` in ``run_dir`` (``device`` overrides ``model.device``).

    An unknown method or user, or a method that has not finished, is a :class:`UserError` naming the choices.
    """
    from ondevice_moe.federation import device as dev
    from ondevice_moe.runner import finished_jobs

    recipe, jobs = finished_jobs(Path(run_dir), device)
    by_name = {job.method.name: job for job in jobs}
    if method not in by_name:
        raise UserError(f"method '{method}' has no finished result in {run_dir}",
                        f"use one of: {', '.join(by_name)}")
    job = by_name[method]
    if user not in recipe.user_names:
        raise UserError(f"no user '{user}' in {run_dir}", f"use one of: {', '.join(recipe.user_names)}")
    user_index = recipe.user_names.index(user)
    if job.on_device and user_index != job.node.partition_id:
        own = recipe.user_names[job.node.partition_id]
        raise UserError(f"{run_dir} is device {job.node.partition_id}'s folder: it holds user '{own}''s model only",
                        f"use --user {own}, or run this on user '{user}''s device")
    device_index = next(d for d in range(len(job.method.layouts)) if user_index in dev.users_of_device(job, d))
    return UserModel(recipe, job, device_index, user, trained_model(job, device_index))


def trained_model(job: Job, device: int) -> nn.Module:
    """Device ``device``'s model of ``job``'s finished method: its experts attached, its checkpoint loaded
    (a method that trains nothing has none), in eval mode."""
    from ondevice_moe.federation import device as dev

    model = dev.build_model(job, device)
    if job.method.trains:
        dev.load_checkpoint(job, device, model)
    return model.eval()
