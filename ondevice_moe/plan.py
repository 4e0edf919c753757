"""What a recipe will do, without training: per method, its devices and, per
device, the parameters the local procedure trains and those it sends to the
server each round (``ondevice-moe finetune --dry-run``).

A trainable parameter is one with ``requires_grad`` that the method's local
procedure updates (:meth:`Method.is_trainable`); an uploaded one is a
trainable parameter whose role is :attr:`Role.SHARED`. Methods that upload
only the experts a round selected (Hermes) send at most that many.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ondevice_moe.federation.device import build_model
from ondevice_moe.federation.job import Job
from ondevice_moe.methods import Role
from ondevice_moe.recipe import Recipe


@dataclass(frozen=True)
class DevicePlan:
    """One device's parameter counts (scalars, not tensors) and its upload per round in bytes."""

    device: int
    trainable: int
    uploaded: int
    uploaded_bytes: int


@dataclass(frozen=True)
class MethodPlan:
    """One method entry of the recipe: its resolved name and one plan per device."""

    name: str
    devices: tuple[DevicePlan, ...]

    @property
    def uploaded_bytes(self) -> int:
        """Bytes all devices send per round (an upper bound for partial uploads)."""
        return sum(device.uploaded_bytes for device in self.devices)


def plan_recipe(recipe: Recipe, run_dir: Path) -> list[MethodPlan]:
    """The plan of every method of ``recipe``, building each device's model once (base model cached)."""
    plans = []
    for index in range(len(recipe.methods)):
        job = Job(recipe, index, run_dir)
        devices = tuple(device_plan(job, device) for device in range(len(job.method.layouts)))
        plans.append(MethodPlan(job.method.name, devices))
    return plans


def device_plan(job: Job, device: int) -> DevicePlan:
    """Count the parameters device ``device`` trains and uploads under ``job``'s method."""
    method = job.method
    trainable = uploaded = uploaded_bytes = 0
    for name, param in build_model(job, device).named_parameters():
        if not (param.requires_grad and method.is_trainable(name)):
            continue
        trainable += param.numel()
        if method.role_of(name) is Role.SHARED:
            uploaded += param.numel()
            uploaded_bytes += param.numel() * param.element_size()
    return DevicePlan(device, trainable, uploaded, uploaded_bytes)


__all__ = ["DevicePlan", "MethodPlan", "device_plan", "plan_recipe"]
