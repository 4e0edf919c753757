"""Flow's round on a device (Alg. 1 lines 5–12), over the trainer's optimisers.

1. ``w_ℓ ← w_g`` (line 5) and the training examples split in disjoint halves ζ_ℓ, ζ_g (line 6),
   afresh each round (``zeta_split: per-round``) or the same every round (``fixed``);
2. K₁ epochs of the local copies alone on ζ_ℓ, every instance on the local path (eq. 1, line 7);
3. K₂ epochs on ζ_g, each batch a policy step on ``CE(w_p) − (γ/L) Σ_j log q_0^(j)`` with the
   layers fixed (eq. 4, line 9), then a global step on ``CE(w_p)`` with ψ fixed (eq. 5, line 10;
   ``global_step="global-path"``: on the global path's own loss, as the authors' code does).

FedAvgFT (``policy="fixed-paths"``) runs the same round with the global step on the global
path and no policy step: FedAvg plus a local copy fine-tuned from the received global model,
both on every example (``baseline_budget: paper``) or on ζ_g and ζ_ℓ (``flow``). Ditto
(``policy="ditto"``, :func:`ditto_round`) and APFL (``policy="apfl"``, :func:`apfl_round`) keep
the local copies as a personal model of the device's own. With ``evaluation: adapted`` a device
first adapts the model it is tested with (:func:`adapt_for_test`), as the authors' code does.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from itertools import zip_longest
from typing import Literal

import torch
from torch import nn

from ondevice_moe.experts.layer_copy import restart_local_copies
from ondevice_moe.methods.fedsoft.centres import ProximalAnchors
from ondevice_moe.methods.flow.metrics import flow_scores, on_both_paths, personal_path
from ondevice_moe.methods.procedure import OnDevice, Procedure
from ondevice_moe.routing.instance_policy import InstancePolicyRouter, instance_policy, policy_regulariser
from ondevice_moe.training import Batch, DeviceTrainer


@dataclass(frozen=True)
class FlowProcedure(Procedure):
    """Flow's round (Alg. 1, :mod:`ondevice_moe.methods.flow`): the local copies restart from the
    global layers, the device's training examples are split in two disjoint halves ζ_ℓ / ζ_g
    (``local_fraction`` of them in ζ_ℓ); ``local_epochs`` (K₁) epochs train
    the local copies on ζ_ℓ (eq. 1); ``global_epochs`` (K₂) epochs on ζ_g alternate, batch by
    batch, a policy step with the regulariser weight ``gamma`` (γ, eq. 4) and a global step
    (eq. 5). ``policy``: ``learned`` (Flow), ``fixed-paths`` (FedAvgFT: the global layers
    train on ζ_g alone and the personal model is the local path) or ``ditto`` (Ditto, Li et
    al. 2021: on all the examples, ``global_epochs`` of the global layers, then ``local_epochs``
    of the local copies — kept between rounds, not restarted — on the loss plus
    ``(proximal_lambda/2)·‖w_ℓ − w_g^t‖²`` to the round's received global layers; the personal
    model is the local path) or ``apfl`` (APFL, Deng et al. 2020, Alg. 1: on all the examples,
    each batch a step of the global layers on their own loss, then a step of the local copies
    and the private α on the loss of ``(1 − α)·w_g + α·w_ℓ``; the personal model is that
    interpolation). ``global_step``: the global
    step's loss, ``CE(w_p)`` (``personalised``, eq. 5) or ``CE(w_g)`` on the global path alone
    (``global-path``, the authors' ``trainers/client_flow.py``). ``zeta_split``: ``per-round``
    draws the halves and the batch order afresh each round (Alg. 1 line 6 sits in the round
    loop), ``fixed`` keeps them for every round (the authors' code shards the same way).
    ``evaluation``: ``as-trained`` scores the model the rounds left; ``adapted`` first restarts
    the local copies from the received global layers, fine-tunes them on ζ_ℓ and adapts ψ on
    ζ_g, as the authors' ``*_generalized_test`` does. ``baseline_budget``: ``paper`` runs the
    baselines as their papers define them (FedAvgFT: FedAvg and the fine-tuning on every example;
    Ditto and APFL: every example through both models), ``flow`` on Flow's data per round (the
    global layers on ζ_g, the personal model on ζ_ℓ)."""

    gamma: float = 0.01
    local_epochs: int = 1
    global_epochs: int = 1
    local_fraction: float = 0.5
    policy: Literal["learned", "fixed-paths", "ditto", "apfl"] = "learned"
    global_step: Literal["personalised", "global-path"] = "personalised"
    proximal_lambda: float = 0.0
    zeta_split: Literal["per-round", "fixed"] = "per-round"
    evaluation: Literal["as-trained", "adapted"] = "as-trained"
    baseline_budget: Literal["paper", "flow"] = "paper"

    def train_round(self, device: OnDevice, trainer: DeviceTrainer) -> tuple[dict[str, float], int]:
        """Epochs over the halves of the device's examples (:func:`flow_round`)."""
        return flow_round(trainer, device.training_examples(), device.batch_size, device.seed)

    def loss_terms(self, trainer: DeviceTrainer, *, train_experts: bool, train_router: bool) -> torch.Tensor | None:
        """The policy step's regulariser ``−(γ/L) Σ_j log q_0^(j)`` (eq. 4), and Ditto's proximal term
        to the round's received global layers on the personal model's steps."""
        policy = instance_policy(trainer.model)
        if train_router and policy is not None:
            return self.gamma * policy_regulariser(policy)
        anchors = trainer.round_state.get(DITTO_ANCHORS)
        return anchors.penalty(trainer.trainable) if anchors is not None and train_experts else None

    def evaluate(self, device: OnDevice, model: nn.Module) -> dict[str, float]:
        """The personalised and the global model: Acc_p, Acc_g and the per-instance breakdown of a
        classifier (eq. 6–7), or both perplexities of a language model; after adapting the model
        to the device's data first with ``evaluation: adapted``."""
        tested = adapted_for_test(device, model)
        if device.is_language_modelling:
            return on_both_paths(tested, personal_path(self.policy), lambda: device.score(tested))
        examples = device.test_examples()
        scores = flow_scores(tested, personal_path(self.policy), examples, device.eval_batch_size)
        return {"num-examples": len(examples), **{f"user_{device.index}/{k}": v for k, v in scores.items()}}


DITTO_ANCHORS = "ditto-anchors"


def adapted_for_test(device: OnDevice, model: nn.Module) -> nn.Module:
    """The model a Flow-family device is tested with: with ``evaluation: adapted``, a copy of
    ``model`` adapted on the device's training data (:func:`adapt_for_test`, seeded by the device,
    so ``ondevice-moe eval`` repeats it); else ``model`` itself."""
    procedure: FlowProcedure = device.method.procedure
    if not adapts_before_test(procedure):
        return model
    twin = device.build_model()  # its own router: the routed layers read their gates from it
    twin.load_state_dict(model.state_dict())
    trainer = device.trainer(twin)
    adapt_for_test(trainer, device.training_examples(), device.batch_size, device.seed)
    trainer.model.eval()
    return trainer.model


@dataclass(frozen=True)
class ExampleRows:
    """Some rows of a device's examples, with the same ``len`` / ``batch`` interface."""

    examples: object
    rows: torch.Tensor

    def __len__(self) -> int:
        return int(self.rows.numel())

    def batch(self, rows: torch.Tensor) -> Batch:
        return self.examples.batch(self.rows[rows])


def split_halves(count: int, local_fraction: float, seed: int | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Disjoint rows ``(ζ_ℓ, ζ_g)`` covering ``range(count)``, ``local_fraction`` of them in ζ_ℓ
    (Alg. 1 line 6), seeded; each half holds at least one row when ``count ≥ 2``."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(zlib.crc32(f"{seed}:flow-split".encode())))
    cut = min(max(round(local_fraction * count), 1), count - 1) if count >= 2 else count
    return order[:cut], order[cut:]


def epoch_batches(examples, batch_size: int, seed: int | str, epoch: int) -> list[Batch]:
    """One epoch of ``examples`` in seeded random batches."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:flow-epoch:{epoch}".encode()))
    order = torch.randperm(len(examples), generator=generator)
    return [examples.batch(order[start : start + batch_size]) for start in range(0, len(examples), batch_size)]


def _parameter_ids(modules) -> frozenset[int]:
    return frozenset(id(param) for module in modules for param in module.parameters())


def round_key(procedure: FlowProcedure, trainer: DeviceTrainer, seed: int) -> int | str:
    """The seed of a round's halves and batch order: the device's (``zeta_split: fixed``), or the
    device's and the round's (``per-round``), the round told by the trainer's iteration count at
    its start, which runs on across rounds and resumes with the device's state."""
    return seed if procedure.zeta_split == "fixed" else f"{seed}:{trainer.iteration}"


def training_rows(procedure: FlowProcedure, count: int, key: int | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the personal model (the local copies) trains on and those the global layers train
    on: the halves ζ_ℓ, ζ_g (Alg. 1 line 6), or, for a baseline on its paper's budget, every row
    for both."""
    if procedure.policy != "learned" and procedure.baseline_budget == "paper":
        every = torch.arange(count)
        return every, every
    return split_halves(count, procedure.local_fraction, key)


def flow_round(trainer: DeviceTrainer, examples, batch_size: int, seed: int) -> tuple[dict[str, float], int]:
    """One round of Flow (or FedAvgFT, Ditto, APFL) on ``examples``; returns the train metrics and
    the weight of the device's upload: the examples the global layers trained on (|ζ_g|, Alg. 1
    line 12)."""
    procedure: FlowProcedure = trainer.method.procedure
    key = round_key(procedure, trainer, seed)
    if procedure.policy in PERSONAL_MODEL_ROUNDS:
        return PERSONAL_MODEL_ROUNDS[procedure.policy](trainer, examples, batch_size, key)
    router = instance_policy(trainer.model)
    local_rows, global_rows = training_rows(procedure, len(examples), key)
    local_losses = _fine_tune_local_copies(trainer, ExampleRows(examples, local_rows), batch_size, key)
    learned = procedure.policy == "learned"
    global_path = "policy" if learned and procedure.global_step == "personalised" else "global"
    _, local_ids = _copy_ids(router)
    policy_losses, global_losses = [], []
    global_half = ExampleRows(examples, global_rows)
    for epoch in range(procedure.global_epochs):
        for batch in epoch_batches(global_half, batch_size, key, procedure.local_epochs + epoch):
            if learned:
                router.path = "policy"
                policy_losses.append(trainer.router_step(batch))
            router.path = global_path
            global_losses.append(trainer.expert_step(batch, idle=local_ids))
    router.path = "policy"
    trainer.iteration += len(local_losses) + len(global_losses)
    metrics = {"train_loss_local": _mean(local_losses), "train_loss": _mean(global_losses),
               "step_losses": [*local_losses, *global_losses], "iteration": float(trainer.iteration)}
    if policy_losses:
        metrics["router_loss"] = _mean(policy_losses)
        metrics.update(global_shares(router, global_half))
    return metrics, len(global_rows)


def _fine_tune_local_copies(trainer: DeviceTrainer, rows: ExampleRows, batch_size: int, key: int | str
                            ) -> list[float]:
    """``w_ℓ ← w_g``, then K₁ epochs of the local copies alone on ``rows``, every instance on the
    local path (eq. 1, Alg. 1 lines 5 and 7); the losses of its steps."""
    procedure: FlowProcedure = trainer.method.procedure
    router = instance_policy(trainer.model)
    restart_local_copies(router.pairs)
    global_ids, _ = _copy_ids(router)
    router.path = "local"
    try:
        return [trainer.expert_step(batch, idle=global_ids)
                for epoch in range(procedure.local_epochs)
                for batch in epoch_batches(rows, batch_size, key, epoch)]
    finally:
        router.path = "policy"


def adapts_before_test(procedure: FlowProcedure) -> bool:
    """Whether a device adapts its model before it is tested (``evaluation: adapted``): Flow and
    FedAvgFT, whose local copies restart from the global layers; Ditto's and APFL's personal
    models are the device's own and are tested as trained."""
    return procedure.evaluation == "adapted" and procedure.policy not in PERSONAL_MODEL_ROUNDS


def adapt_for_test(trainer: DeviceTrainer, examples, batch_size: int, seed: int) -> None:
    """The authors' ``*_generalized_test`` (``trainers/client_flow.py``) before the hard-policy
    test: the local copies restart from the received global layers and are fine-tuned for K₁
    epochs on ζ_ℓ (eq. 1), then ψ alone takes K₂ epochs of policy steps (eq. 4) on ζ_g; the
    global layers do not move, so Acc_g is the received global model's."""
    procedure: FlowProcedure = trainer.method.procedure
    key = f"{seed}:test"
    local_rows, global_rows = training_rows(procedure, len(examples), key)
    _fine_tune_local_copies(trainer, ExampleRows(examples, local_rows), batch_size, key)
    if procedure.policy != "learned":
        return
    for epoch in range(procedure.global_epochs):
        for batch in epoch_batches(ExampleRows(examples, global_rows), batch_size, key, procedure.local_epochs + epoch):
            trainer.router_step(batch)


def ditto_round(trainer: DeviceTrainer, examples, batch_size: int, key: int | str) -> tuple[dict[str, float], int]:
    """Ditto's round (Li et al., 2021, Alg. 1) on the layer copies: ``global_epochs`` epochs of
    the global layers (FedAvg's local update of ``w``), then ``local_epochs`` epochs of the
    personal model ``v`` (the local copies) on ``f_k(v) + (λ/2)‖v − w^t‖²``, ``w^t`` being the
    global layers as received; each on every example, or on ζ_g and ζ_ℓ (``baseline_budget:
    flow``). ``v`` is the device's own between rounds; it starts from the global model on the
    device's first round."""
    procedure: FlowProcedure = trainer.method.procedure
    router, global_ids, local_ids = _personal_model_start(trainer)
    local_rows, global_rows = training_rows(procedure, len(examples), key)
    names = {id(param): name for name, param in trainer.model.named_parameters()}
    received = {names[id(local)]: global_.detach().clone() for global_copy, local_copy in router.pairs
                for global_, local in zip(global_copy.parameters(), local_copy.parameters(), strict=True)}
    router.path = "global"
    global_losses = [trainer.expert_step(batch, idle=local_ids)
                     for epoch in range(procedure.global_epochs)
                     for batch in epoch_batches(ExampleRows(examples, global_rows), batch_size, key, epoch)]
    router.path = "local"
    trainer.round_state[DITTO_ANCHORS] = ProximalAnchors((received,), (1.0,), procedure.proximal_lambda)
    try:
        local_losses = [trainer.expert_step(batch, idle=global_ids)
                        for epoch in range(procedure.local_epochs)
                        for batch in epoch_batches(ExampleRows(examples, local_rows), batch_size, key,
                                                   procedure.global_epochs + epoch)]
    finally:
        del trainer.round_state[DITTO_ANCHORS]
        router.path = "policy"
    trainer.iteration += len(local_losses) + len(global_losses)
    return {"train_loss_local": _mean(local_losses), "train_loss": _mean(global_losses),
            "step_losses": [*global_losses, *local_losses], "iteration": float(trainer.iteration)}, len(global_rows)


def apfl_round(trainer: DeviceTrainer, examples, batch_size: int, key: int | str) -> tuple[dict[str, float], int]:
    """APFL's round (Deng et al., 2020, Alg. 1) on the layer copies: ``local_epochs`` epochs, each
    batch a step of the global layers ``w`` on their own loss, then a step of the personal model
    ``v`` (the local copies, the device's own between rounds) and of α on the loss of
    ``(1 − α)·w + α·v``; both steps on the same batch of every example, or (``baseline_budget:
    flow``) the first on a batch of ζ_g, the second on one of ζ_ℓ. α is the device's, as ``v``;
    the paper clips α to [0, 1] after each step where we keep it in (0, 1) by a sigmoid."""
    procedure: FlowProcedure = trainer.method.procedure
    router, global_ids, local_ids = _personal_model_start(trainer)
    local_rows, global_rows = training_rows(procedure, len(examples), key)
    alpha = frozenset({id(router.alpha_logit)})
    global_losses, local_losses, steps = [], [], []
    try:
        for epoch in range(procedure.local_epochs):
            pairs = zip_longest(epoch_batches(ExampleRows(examples, global_rows), batch_size, key, epoch),
                                epoch_batches(ExampleRows(examples, local_rows), batch_size, key, epoch))
            for global_batch, local_batch in pairs:
                if global_batch is not None:
                    router.path = "global"
                    global_losses.append(trainer.expert_step(global_batch, idle=local_ids | alpha))
                    steps.append(global_losses[-1])
                if local_batch is not None:
                    router.path = "mixture"
                    local_losses.append(trainer.expert_step(local_batch, idle=global_ids))
                    steps.append(local_losses[-1])
    finally:
        router.path = "policy"
    trainer.iteration += len(steps)
    metrics = {"train_loss_local": _mean(local_losses), "train_loss": _mean(global_losses), "step_losses": steps,
               "alpha": float(torch.sigmoid(router.alpha_logit.detach())), "iteration": float(trainer.iteration)}
    return metrics, len(global_rows)


def _personal_model_start(trainer: DeviceTrainer) -> tuple[InstancePolicyRouter, frozenset[int], frozenset[int]]:
    """The router and the ids of the global and the local copies' parameters, for a method whose
    local copies are a personal model of the device's own (Ditto, APFL): it starts from the
    global model on the device's first round and is kept from then on."""
    router = instance_policy(trainer.model)
    if trainer.iteration == 0:
        restart_local_copies(router.pairs)
    return (router, *_copy_ids(router))


def _copy_ids(router: InstancePolicyRouter) -> tuple[frozenset[int], frozenset[int]]:
    """The ids of the global copies' parameters and of the local copies'."""
    return (_parameter_ids(global_copy for global_copy, _ in router.pairs),
            _parameter_ids(local_copy for _, local_copy in router.pairs))


@torch.no_grad()
def global_shares(router: InstancePolicyRouter, examples) -> dict[str, float]:
    """``q0_layer_<j>``: the mean soft probability of the global copy at each exit (routed layer,
    or block of a Hugging Face model)."""
    shares = router.route_inputs(examples.batch(torch.arange(len(examples))))
    return {f"q0_layer_{index}": float(q[:, 0].mean()) for index, q in enumerate(shares)}


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


PERSONAL_MODEL_ROUNDS = {"ditto": ditto_round, "apfl": apfl_round}
