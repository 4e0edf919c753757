"""What lives on a device: the base model (loaded once per process), the
user's data, and the trainer rebuilt each round from shared tensors sent by
the server plus private state kept in Flower's ``context.state``.
"""

from __future__ import annotations

import io
import zlib
from functools import lru_cache

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from ondevice_moe.data.splits import SourceSpec, UserData, build_user_data
from ondevice_moe.federation.job import Job
from ondevice_moe.inject import attach_experts
from ondevice_moe.methods import Role
from ondevice_moe.models import LoadedModel, load_base_model
from ondevice_moe.training import DeviceTrainer, trainable_state

PRIVATE_KEY = "private"
OPTIMIZER_KEY = "optimizer"


@lru_cache(maxsize=2)
def base_model(name: str, dtype: str, quantization: str) -> LoadedModel:
    """The frozen base model, loaded once per process."""
    return load_base_model(name, dtype, quantization)


def job_base_model(job: Job) -> LoadedModel:
    model = job.recipe.model
    return base_model(model.name, model.dtype, model.quantization)


_DATA: dict[tuple[str, int], UserData] = {}


def user_data(job: Job, user: int) -> UserData:
    """User ``user``'s blocks, built once per process."""
    key = (job.recipe.data.model_dump_json() + job.recipe.model.name + str(job.recipe.seed), user)
    if key not in _DATA:
        data = job.recipe.data
        section = data.users[user]
        sources = [SourceSpec(s.source, s.options(), s.weight) for s in section.sources]
        _DATA[key] = build_user_data(section.name, sources, job_base_model(job).tokenizer, data.budgets(user),
                                     data.context_length, job.recipe.seed + 7919 * user)
    return _DATA[key]


def users_of_device(job: Job, device: int) -> list[int]:
    """The users whose data a device holds: all of them for the centralized upper bound."""
    return list(range(len(job.recipe.data.users))) if job.method.centralized else [device]


def device_split(job: Job, device: int, split: str) -> torch.Tensor:
    return torch.cat([user_data(job, u).split(split) for u in users_of_device(job, device)])


def eval_blocks(job: Job, user: int) -> torch.Tensor:
    test = user_data(job, user).test
    cap = job.recipe.data.max_eval_blocks
    return test if cap is None else test[:cap]


def build_model(job: Job, device: int) -> nn.Module:
    """The device's model: the shared base with this device's experts attached."""
    layout = job.method.layouts[device]
    base = job_base_model(job).model
    return base if layout is None else attach_experts(base, layout, seed=job.recipe.seed, user=device)


def restore_trainer(job: Job, device: int, shared: ArrayRecord | None, state: RecordDict) -> DeviceTrainer:
    """Rebuild the device's trainer: fresh experts, then private state, then the server's tensors."""
    model = build_model(job, device)
    trainer = DeviceTrainer(model, job.method, job.training)
    tensors: dict[str, torch.Tensor] = {}
    if PRIVATE_KEY in state:
        tensors.update(state[PRIVATE_KEY].to_torch_state_dict())
    if shared is not None and len(shared) > 0:
        tensors.update(shared.to_torch_state_dict())
    if tensors:
        missing = set(tensors) - set(dict(model.named_parameters()))
        if missing:
            raise ValueError(f"received tensors this device does not hold: {sorted(missing)[:3]}")
        model.load_state_dict(tensors, strict=False)
    if OPTIMIZER_KEY in state:
        blob = state[OPTIMIZER_KEY]["blob"]
        trainer.load_optimizer_state(torch.load(io.BytesIO(blob), weights_only=False))
    return trainer


def save_private_state(trainer: DeviceTrainer, state: RecordDict) -> None:
    """Keep private tensors and optimiser state on the device (``context.state``)."""
    private = {n: t for n, t in trainable_state(trainer.model).items() if trainer.method.role_of(n) is Role.PRIVATE}
    state[PRIVATE_KEY] = ArrayRecord({n: t.clone() for n, t in private.items()})
    buffer = io.BytesIO()
    torch.save(trainer.optimizer_state(), buffer)
    state[OPTIMIZER_KEY] = ConfigRecord({"blob": buffer.getvalue()})


def shared_state(trainer: DeviceTrainer) -> dict[str, torch.Tensor]:
    """The tensors that leave the device: shared and trainable."""
    return {
        name: tensor.clone()
        for name, tensor in trainable_state(trainer.model).items()
        if trainer.method.role_of(name) is Role.SHARED and trainer.method.is_trainable(name)
    }


def batch_sampler(blocks: torch.Tensor, batch_size: int, seed: int, stream: str):
    """``sample(i)``: a batch of random blocks, the same for the same ``(seed, stream, i)``."""

    def sample(index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{stream}:{index}".encode()))
        rows = torch.randint(0, blocks.shape[0], (batch_size,), generator=generator)
        return blocks[rows]

    return sample
