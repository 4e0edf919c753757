"""The experts' learning-rate schedules (torch and transformers schedulers) against the
hand-written factors they replaced, kept here only as the reference."""

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ondevice_moe.training import DeviceTrainer, TrainingConfig, cosine_to_tenth, one_cycle_cosine

RATES = (2e-3, 5e-2)  # the experts' rate, and a second group at its own rate (FLoRAL's routers)
# A method training every parameter with plain local steps, as the trainer sees it (``TrainedMethod``).
ALL_TRAINABLE = SimpleNamespace(procedure=SimpleNamespace(routers="none", joint_router_lr=None),
                                is_trainable=lambda name: True)


def reference_one_cycle_cosine(step: int, total: int, warmup: int, start: float = 1 / 25,
                               end: float = 1e-4) -> float:
    """The replaced factor: linear warm-up from ``start`` to 1, cosine to ``end`` at ``total``, held."""
    if step < warmup:
        return start + (1 - start) * step / warmup
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress))


def reference_cosine_to_tenth(step: int, total: int) -> float:
    """The replaced factor: cosine from 1 to 0.1 at ``total``, held."""
    progress = min(1.0, step / total)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def _optimizer() -> torch.optim.Optimizer:
    experts, routers = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    return torch.optim.AdamW([{"params": [experts]}, {"params": [routers], "lr": RATES[1]}], lr=RATES[0])


def _rates(optimizer: torch.optim.Optimizer, scheduler, steps: int) -> list[list[float]]:
    """Each group's rate at steps 0 .. steps − 1, the scheduler stepped after each optimiser step."""
    rates = []
    for _ in range(steps):
        rates.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(("total", "warmup"), [(1, 1), (2, 1), (7, 2), (20, 1), (200, 10), (333, 333)])
def test_one_cycle_cosine_gives_the_replaced_rate_at_every_step(total, warmup):
    optimizer = _optimizer()
    rates = _rates(optimizer, one_cycle_cosine(optimizer, total, warmup), total + 10)
    for step, group_rates in enumerate(rates):
        factor = reference_one_cycle_cosine(step, total, warmup)
        assert group_rates == pytest.approx([rate * factor for rate in RATES], rel=1e-12, abs=0)


@pytest.mark.parametrize("total", [1, 2, 12, 200, 1000])
def test_cosine_to_tenth_gives_the_replaced_rate_at_every_step(total):
    optimizer = _optimizer()
    rates = _rates(optimizer, cosine_to_tenth(optimizer, total), total + 10)
    for step, group_rates in enumerate(rates):
        factor = reference_cosine_to_tenth(step, total)
        assert group_rates == pytest.approx([rate * factor for rate in RATES], rel=1e-12, abs=0)


@pytest.mark.parametrize(("steps", "floor"), [(1, 0.1), (7, 0.1), (30, 1e-4), (120, 0.1)])
def test_the_cosine_decay_gives_transformers_wsd_factors_bit_for_bit(steps, floor):
    """``_cosine_decay`` computes the decay of transformers' ``get_wsd_schedule`` itself (to spare every
    device process the import of peft): the same rates at every step, and a state the other loads."""
    from transformers.optimization import get_wsd_schedule

    from ondevice_moe.training import _cosine_decay

    ours, theirs = _optimizer(), _optimizer()
    ours_scheduler = _cosine_decay(ours, steps=steps, floor=floor)
    theirs_scheduler = get_wsd_schedule(theirs, num_warmup_steps=0, num_stable_steps=0, num_decay_steps=steps,
                                        min_lr_ratio=floor)
    assert _rates(ours, ours_scheduler, steps + 5) == _rates(theirs, theirs_scheduler, steps + 5)
    assert ours_scheduler.state_dict() == theirs_scheduler.state_dict()


def test_one_cycle_cosine_warms_up_then_decays_and_holds():
    optimizer = _optimizer()
    factors = [rates[0] / RATES[0] for rates in _rates(optimizer, one_cycle_cosine(optimizer, 20, 2), 25)]
    assert factors[0] == pytest.approx(1 / 25)
    assert factors[2] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(factors[2:]))
    assert factors[20] == pytest.approx(1e-4) and factors[24] == factors[20]


@pytest.mark.parametrize("schedule", ["one-cycle-cosine", "cosine"])
def test_a_schedule_resumed_from_its_json_state_goes_on_where_it_stopped(schedule):
    """A device keeps its scheduler's state as JSON between rounds (``federation/device_state.py``)."""
    config = TrainingConfig(total_iterations=30, warmup_fraction=0.2, lr_schedule=schedule)
    model = nn.Linear(3, 1)
    first = DeviceTrainer(model, ALL_TRAINABLE, config)
    _rates(first.expert_optimizer, first.scheduler, 9)  # past the warm-up's 6 steps
    state = json.loads(json.dumps(first.scheduler.state_dict()))
    resumed = DeviceTrainer(model, ALL_TRAINABLE, config)
    resumed.expert_optimizer.load_state_dict(first.expert_optimizer.state_dict())
    resumed.scheduler.load_state_dict(state)
    assert _rates(resumed.expert_optimizer, resumed.scheduler, 30) == _rates(first.expert_optimizer,
                                                                             first.scheduler, 30)


def test_a_constant_rate_has_no_scheduler():
    trainer = DeviceTrainer(nn.Linear(3, 1), ALL_TRAINABLE, TrainingConfig(lr_schedule="constant"))
    assert trainer.scheduler is None and trainer.optimizer_state()["scheduler"] is None
