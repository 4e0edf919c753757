"""The device's base model: loaded once per process, or built as names and shapes only for the server."""

from __future__ import annotations

from functools import lru_cache

from torch import nn

from ondevice_moe.federation.job import Job
from ondevice_moe.models import LoadedModel, load_base_model, load_base_structure


@lru_cache(maxsize=2)
def base_model(name: str, dtype: str, quantization: str, num_labels: int | None, seed: int, device: str,
               regression: bool | None = None, input_shape: tuple[int, ...] | None = None,
               bias: bool = True) -> LoadedModel:
    """The frozen base model, loaded once per process."""
    return load_base_model(name, dtype, quantization, num_labels, seed, device, regression=regression,
                           input_shape=input_shape, model_options=small_model_options(bias))


@lru_cache(maxsize=2)
def base_structure(name: str, dtype: str, num_labels: int | None, seed: int, regression: bool | None = None,
                   input_shape: tuple[int, ...] | None = None, bias: bool = True) -> nn.Module:
    """The base model without its weights (:func:`~ondevice_moe.models.registry.load_base_structure`),
    built once per process."""
    return load_base_structure(name, dtype, num_labels, seed, regression=regression, input_shape=input_shape,
                               model_options=small_model_options(bias))


def small_model_options(bias: bool) -> dict[str, object] | None:
    """The small models' options a recipe sets (``model.bias``)."""
    return None if bias else {"bias": False}


def job_base_model(job: Job) -> LoadedModel:
    model = job.recipe.model
    num_labels, seed, regression, input_shape, bias = _base_options(job)
    return base_model(model.name, model.dtype, model.quantization, num_labels, seed, model.device,
                      regression, input_shape, bias)


def job_base_structure(job: Job) -> nn.Module:
    """The job's base model as names, shapes and dtypes only: what the server needs of it."""
    model = job.recipe.model
    return base_structure(model.name, model.dtype, *_base_options(job))


def _base_options(job: Job) -> tuple[int | None, int, bool | None, tuple[int, ...] | None, bool]:
    """The task's side of the base model: labels, seed, regression, input shape and ``model.bias``."""
    if job.recipe.task is None:
        return None, job.recipe.seed, None, None, True
    spec = job.recipe.task.spec()
    return spec.num_labels, job.recipe.seed, spec.is_regression, spec.input_shape, job.recipe.model.bias
