"""The device side of FedSoft, IFCA and FedEM: a round against the server's cluster centres.

FedSoft (Alg. 1): every τ rounds (and on a device's first round) the importances ``u_k`` are
re-estimated on the device's examples and kept in its state (lines 3–13); the device's own model
is anchored to every centre by them (eq. 4). IFCA (Ghosh et al., 2020): the model becomes the
centre with the lowest loss on the device's examples, trained without a proximal term. FedEM
(Marfoq et al., 2021, Alg. 1): the E-step weighs each training example over the centres from the
mixture π kept in the device's state (uniform at first), the M-step sets π from them, and every
centre trains on its weighted loss. Either way the weights travel with the update, for the
server's eq. (6) (:class:`~ondevice_moe.methods.fedsoft.rule.CentreRule`).
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from flwr.app import ConfigRecord
from torch import nn

from ondevice_moe.data.splits import BlockExamples
from ondevice_moe.example_loss import WeightedExamples
from ondevice_moe.methods.fedsoft.centres import (
    ProximalAnchors,
    Tensors,
    centre_key,
    centre_losses,
    centre_seed,
    example_nll,
    hard_assignment,
    importance_weights,
    mixture_of,
    responsibilities,
    split_centres,
)
from ondevice_moe.methods.fedsoft.prediction import MIXTURE_SUFFIX, CentreMixture
from ondevice_moe.methods.fedsoft.rule import WEIGHTS_RECORD
from ondevice_moe.methods.procedure import OnDevice, Procedure
from ondevice_moe.sampling import epoch_sampler
from ondevice_moe.training import trainable_state

if TYPE_CHECKING:
    from ondevice_moe.training import DeviceTrainer

IMPORTANCE_KEY = "importance"
ANCHORS, UPLOADS = "anchors", "uploads"


@dataclass(frozen=True)
class CentreProcedure(Procedure):
    """A round against the server's ``clusters`` centres (:mod:`ondevice_moe.methods.fedsoft`).

    ``soft`` (FedSoft Alg. 1): the device trains its own persistent model on eq. (4),
    anchored to every centre by its importance weights, re-estimated every
    ``estimation_interval`` rounds with floor ``importance_floor``; ``proximal_lambda``
    is λ. ``hard`` (IFCA): the device trains the centre with the lowest loss on its data.
    ``em`` (FedEM, Marfoq et al. 2021): the device weighs each example over all centres (E-step),
    sets its mixture π from them (M-step) and trains every centre on its weighted loss.
    ``lora_spread``: the std of a LoRA centre's ``B`` at the start (cluster adapters on a
    Hugging Face model; the centres must start apart). ``block_loss``: FedEM's E-step score of a
    block of text, its summed (``sum``, the paper) or mean (``mean``, the authors' code) token loss.
    ``scored_on``: the split of a language model's blocks the centres are scored on for the
    importances or IFCA's choice (``train``, the paper, or ``valid``); FedEM trains on its E-step's
    weights and so always scores the training blocks.
    """

    clusters: int = 1
    assignment: Literal["soft", "hard", "em"] = "soft"
    proximal_lambda: float = 0.0
    estimation_interval: int = 1
    importance_floor: float = 0.0
    lora_spread: float = 0.0
    block_loss: Literal["sum", "mean"] = "sum"
    scored_on: Literal["train", "valid"] = "train"

    @property
    def trains_every_centre(self) -> bool:
        """FedEM: the device trains and sends every centre, not one model."""
        return self.assignment == "em"

    @property
    def loads_received(self) -> bool:
        return False  # the centres are read: the device trains on from its own model

    def recipe_problems(self, method_name: str, *, hugging_face: bool, language_modelling: bool,
                        private: bool) -> list[str]:
        problems, methods = [], [method_name]
        if self.full_finetune and hugging_face:
            problems.append(f"methods {methods} would keep whole copies of a Hugging Face model as cluster "
                            "centres; give them cluster adapters: set fedsoft.lora_rank (e.g. 8)")
        if self.scored_on == "valid" and not language_modelling:
            problems.append(f"methods {methods} score the centres on validation blocks, which only a language-"
                            "modelling recipe has; set fedsoft.importance_split: train")
        if self.trains_every_centre and private:
            problems.append(f"methods {methods} send every cluster centre, and privacy clips and noises the "
                            "update of one model; drop them or the recipe's privacy: section")
        return problems

    # -- a round --------------------------------------------------------------
    def begin_round(self, device: OnDevice, trainer: DeviceTrainer, received: Tensors | None,
                    server_round: int) -> dict[str, float]:
        """Anchor the round to the centres (FedSoft), choose one (IFCA) or weigh the examples over
        them (FedEM); returns the device's weights or choice."""
        centres = received_centres(device, received)
        examples = centre_examples(self, device)
        losses = centre_losses(copy.deepcopy(trainer.model), centres, examples)
        ordered = tuple(centres[c] for c in sorted(centres))
        if self.assignment == "em":
            scores = example_nll(losses, examples, self.block_loss)
            posteriors = responsibilities(scores, device_mixture(device.state, len(centres)))
            mixture = mixture_of(posteriors)
            device.state[IMPORTANCE_KEY] = ConfigRecord({"u": mixture})
            trainer.round_state[ANCHORS] = ProximalAnchors(ordered, tuple(mixture), 0.0, posteriors)
            return {f"importance_{centre}": weight for centre, weight in enumerate(mixture)}
        if self.assignment == "hard":
            chosen = hard_assignment(losses)
            trainer.model.load_state_dict(centres[chosen], strict=False)
            weights = [float(centre == chosen) for centre in sorted(centres)]
            trainer.round_state[ANCHORS] = ProximalAnchors(ordered, tuple(weights), 0.0)
            return {"centre": chosen}
        if (server_round - 1) % self.estimation_interval == 0 or IMPORTANCE_KEY not in device.state:
            device.state[IMPORTANCE_KEY] = ConfigRecord({"u": importance_weights(losses, self.importance_floor)})
        weights = device_mixture(device.state, len(centres))
        trainer.round_state[ANCHORS] = ProximalAnchors(ordered, tuple(weights), self.proximal_lambda)
        return {f"importance_{centre}": weight for centre, weight in enumerate(weights)}

    def train_round(self, device: OnDevice, trainer: DeviceTrainer) -> tuple[dict[str, float], int]:
        if self.trains_every_centre:
            return _train_every_centre(device, trainer)
        return device.train_steps(trainer)

    def loss_terms(self, trainer: DeviceTrainer, *, train_experts: bool, train_router: bool) -> torch.Tensor | None:
        """Eq. (4)'s proximal term to the centres, on every expert step."""
        anchors = trainer.round_state.get(ANCHORS)
        return anchors.penalty(trainer.trainable) if anchors is not None and train_experts else None

    def upload(self, trainer: DeviceTrainer, tensors: Tensors, records: dict[str, dict]
               ) -> tuple[Tensors, dict[str, dict]]:
        """The device's weights over the centres travel with its model (FedEM: with every centre it trained)."""
        anchors = trainer.round_state.get(ANCHORS)
        if anchors is not None:
            records = {**records, WEIGHTS_RECORD: {"pi": list(anchors.weights)}}
        return trainer.round_state.get(UPLOADS, tensors), records

    def upload_reference(self, tensors: Tensors) -> Tensors:
        if not self.trains_every_centre:
            return tensors
        return {centre_key(centre, name): tensor for centre in range(self.clusters) for name, tensor in tensors.items()}

    @property
    def server_keeps_models(self) -> bool:
        return True

    def server_models(self, tensors: Tensors) -> dict[int, Tensors]:
        """The centres the server formed, from ``cluster_<s>/<name>`` tensors."""
        return split_centres(tensors)

    # -- a test ---------------------------------------------------------------
    def prepare_test(self, device: OnDevice, model: nn.Module, received: Tensors | None) -> dict[str, float]:
        """The model a device is tested with: FedSoft's own ``w_k`` (already in ``model``), IFCA's
        lowest-loss centre, FedEM's centre of largest π (FedSoft §5: "the center corresponding to the
        largest importance weight as a client's local model"), with FedEM's own π-mixture prediction
        scored beside it; the local model also on the device's own training data (:func:`training_scores`);
        and on device 0 every centre on every source (:func:`centre_scores`)."""
        centres = received_centres(device, received)
        scores = {}
        if self.trains_every_centre:
            scores = mixture_scores(device, model, centres, device_mixture(device.state, len(centres)))
        local_model_of(self, device, model, centres)
        scores |= training_scores(device, model)
        tests = device.cluster_tests() if device.index == 0 else None
        return scores | (centre_scores(device, model, centres, tests) if tests is not None else {})


def received_centres(device: OnDevice, received: Tensors | None) -> dict[int, Tensors]:
    """All S cluster centres: those the server sent, the others (not aggregated yet) from their seeds."""
    sent = split_centres(received) if received else {}
    clusters = device.method.procedure.clusters
    return {centre: sent.get(centre) or initial_centre(device, centre) for centre in range(clusters)}


def initial_centre(device: OnDevice, centre: int) -> Tensors:
    """Centre ``centre`` as first drawn: the recipe's model built from the centre's own seed; of
    cluster adapters, the LoRA (and head) from that seed with a random ``B`` (``lora_spread``)."""
    seed = centre_seed(device.recipe_seed, centre)
    procedure: CentreProcedure = device.method.procedure
    if procedure.full_finetune:
        return dict(device.base_model_from(seed).state_dict())
    model = device.build_model(seed=seed)
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: tensor.detach().clone() for name, tensor in trainable_state(model).items()
               if device.travels(name)}
    for name, tensor in tensors.items():
        if name.endswith("lora_B"):
            tensor.copy_(procedure.lora_spread * torch.randn(tensor.shape, generator=generator))
    return tensors


def centre_examples(procedure: CentreProcedure, device: OnDevice):
    """The examples a device scores the centres on: a language model's blocks of the method's
    split (``scored_on``: its training blocks, or its held-out validation blocks), or a task's
    training examples."""
    if device.is_language_modelling:
        return BlockExamples(device.blocks(procedure.scored_on))
    return device.training_examples()


def device_mixture(state, clusters: int) -> list[float]:
    """The device's weights over the centres as it last set them (FedSoft's u_k, FedEM's π),
    uniform before its first round."""
    if IMPORTANCE_KEY in state:
        return [float(weight) for weight in state[IMPORTANCE_KEY]["u"]]
    return [1.0 / clusters] * clusters


def local_model_of(procedure: CentreProcedure, device: OnDevice, model: nn.Module, centres: dict[int, Tensors]
                   ) -> None:
    """Load IFCA's lowest-loss centre or FedEM's centre of largest π into ``model``; FedSoft's own
    ``w_k`` is already there."""
    if procedure.assignment == "hard":
        losses = centre_losses(copy.deepcopy(model), centres, centre_examples(procedure, device))
        model.load_state_dict(centres[hard_assignment(losses)], strict=False)
    elif procedure.assignment == "em":
        mixture = device_mixture(device.state, len(centres))
        model.load_state_dict(centres[max(range(len(mixture)), key=mixture.__getitem__)], strict=False)


def training_scores(device: OnDevice, model: nn.Module) -> dict[str, float]:
    """The local model on the device's own training data, as FedSoft §5 scores local models ("they are
    expected to fit the local data of participating clients, we hence evaluate their accuracy/error on
    local training datasets": w̄ of Tables 3 and 8): ``score_train`` for a task, ``train_ppl_in`` for a
    language model's training blocks. The test figures stay the run's main ones."""
    if device.is_language_modelling:
        return {f"user_{device.index}/train_ppl_in": device.test_on(model, BlockExamples(device.blocks("train")))}
    return {f"user_{device.index}/score_train": device.test_on(model, device.training_examples())}


def _train_every_centre(device: OnDevice, trainer: DeviceTrainer) -> tuple[dict[str, float], int]:
    """FedEM's local step (Marfoq et al., 2021, Alg. 1, LocalSolver): every centre ``s`` in turn,
    from its received value, takes the round's steps on ``Σ_i q(z_i = s) ℓ_s(i)`` (batch means
    of the E-step's weights times the losses, as the authors' ``fit_epochs(…, weights)``) with a
    fresh optimiser; the trained centres become the upload. The authors' learners keep their
    optimisers across rounds; here only the iteration count (and so the epochs drawn) runs on."""
    examples = centre_examples(device.method.procedure, device)
    anchors: ProximalAnchors = trainer.round_state[ANCHORS]
    trained, centre_steps, start = {}, [], trainer.iteration
    for centre, tensors in enumerate(anchors.centres):
        trainer.model.load_state_dict(tensors, strict=False)
        learner = device.trainer(trainer.model)
        learner.iteration = start
        sampler, per_epoch = epoch_sampler(WeightedExamples(examples, anchors.posteriors[centre]), device.batch_size,
                                           zlib.crc32(f"{device.seed}:centre:{centre}".encode()))
        centre_steps.append(learner.train_iterations(device.local_steps(per_epoch), sampler, sampler)["step_losses"])
        trained.update({centre_key(centre, name): tensor for name, tensor in device.shared_state(learner).items()})
        trainer.iteration = learner.iteration
    trainer.round_state[UPLOADS] = trained
    steps = [sum(step) / len(step) for step in zip(*centre_steps, strict=True)]  # a step: the centres' mean loss
    return {"train_loss": sum(steps) / len(steps), "step_losses": steps,
            "iteration": float(trainer.iteration)}, len(examples)


def mixture_scores(device: OnDevice, model: nn.Module, centres: dict[int, Tensors], mixture: list[float]
                   ) -> dict[str, float]:
    """FedEM's own prediction, the π-mixture of the centres' outputs (:mod:`.prediction`), scored
    as the device scores a model, each per-user key suffixed ``_mixture`` (``user_0/test_ppl_in_mixture``)."""
    mixed = CentreMixture(copy.deepcopy(model), [centres[s] for s in sorted(centres)], mixture)
    return {f"{key}{MIXTURE_SUFFIX}": value for key, value in device.score(mixed).items() if "/" in key}


def source_key(centre: int, source: int) -> str:
    """The evaluation key of centre ``centre`` scored on source ``source``'s test set."""
    return f"centre_{centre}_source_{source}"


def centre_scores(device: OnDevice, model: nn.Module, centres: dict[int, Tensors], tests: list) -> dict[str, float]:
    """Every centre scored on every source's held-out examples: the S × S table of FedSoft
    Tables 1 and 3 (a language model's perplexity on each source of the users' mixtures alone), as
    ``user_0/centre_<s>_source_<j>`` entries (the server has no evaluation of its own, so device 0
    scores them; they are the server's tensors and public held-out sets, not the device's data)."""
    scratch = copy.deepcopy(model)
    scores = {}
    for centre, tensors in sorted(centres.items()):
        scratch.load_state_dict(tensors, strict=False)
        for source, examples in enumerate(tests):
            scores[f"user_0/{source_key(centre, source)}"] = device.test_on(scratch, examples)
    return scores
