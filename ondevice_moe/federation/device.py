"""What lives on a device: the base model (loaded once per process), the
user's data, and the trainer rebuilt each round from shared tensors sent by
the server plus private state kept by :mod:`~ondevice_moe.federation.device_state`.
"""

from __future__ import annotations

import copy
import zlib
from functools import lru_cache

import torch
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from ondevice_moe.data.classification import FederatedTask, build_federated_task
from ondevice_moe.data.small import SmallFederatedTask, build_small_task
from ondevice_moe.data.sources import device_source_kind
from ondevice_moe.data.splits import BlockExamples, SourceSpec, UserData, build_user_data
from ondevice_moe.errors import UserError
from ondevice_moe.example_loss import WeightedExamples
from ondevice_moe.federation import device_state
from ondevice_moe.federation.job import Job
from ondevice_moe.federation.node import FIX
from ondevice_moe.federation.peers import mix_peers, split_peers
from ondevice_moe.federation.rank_pruning import fit_received
from ondevice_moe.layout import attach_layout, hermes_routers
from ondevice_moe.methods import Method, Role
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
from ondevice_moe.methods.flow.procedure import adapt_for_test, adapts_before_test, flow_round
from ondevice_moe.models import LoadedModel, load_base_model
from ondevice_moe.models.checkpointing import enable_activation_checkpointing
from ondevice_moe.names import folder_name
from ondevice_moe.recipe import SourceSection
from ondevice_moe.routing import client_mixture
from ondevice_moe.training import DeviceTrainer, trainable_state

IMPORTANCE_KEY = "importance"


@lru_cache(maxsize=2)
def base_model(name: str, dtype: str, quantization: str, num_labels: int | None, seed: int, device: str,
               regression: bool | None = None, input_shape: tuple[int, ...] | None = None,
               bias: bool = True) -> LoadedModel:
    """The frozen base model, loaded once per process."""
    return load_base_model(name, dtype, quantization, num_labels, seed, device, regression=regression,
                           input_shape=input_shape, model_options=small_model_options(bias))


def small_model_options(bias: bool) -> dict[str, object] | None:
    """The small models' options a recipe sets (``model.bias``)."""
    return None if bias else {"bias": False}


def job_base_model(job: Job) -> LoadedModel:
    model = job.recipe.model
    if job.recipe.task is None:
        return base_model(model.name, model.dtype, model.quantization, None, job.recipe.seed, model.device)
    spec = job.recipe.task.spec()
    return base_model(model.name, model.dtype, model.quantization, spec.num_labels, job.recipe.seed, model.device,
                      spec.is_regression, spec.input_shape, model.bias)


_TASKS: dict[str, FederatedTask | SmallFederatedTask] = {}


def federated_task(job: Job) -> FederatedTask | SmallFederatedTask:
    """The task dealt to the clients, built once per process: texts (tokenized) or small tensors."""
    task = job.recipe.task
    key = task.model_dump_json() + job.recipe.model.name + str(job.recipe.split_seed)
    if key not in _TASKS:
        spec = task.spec()
        if spec.is_text:
            _TASKS[key] = build_federated_task(
                spec, task.clients, task.dirichlet_alpha, job_base_model(job).tokenizer, task.max_length,
                job.recipe.split_seed, task.max_train_examples, task.max_test_examples, task.clusters)
        else:
            _TASKS[key] = build_small_task(task.name, task.clients, job.recipe.split_seed, task.clusters,
                                           task.dirichlet_alpha, task.data_fraction)
    return _TASKS[key]


_DATA: dict[tuple[str, int], UserData] = {}  # keyed by the data section, model, seed, data-path and user


def user_data(job: Job, user: int) -> UserData:
    """User (device) ``user``'s blocks of its domain (``data.clients``: several devices per domain),
    built once per process."""
    key = (job.recipe.data.model_dump_json() + job.recipe.model.name + str(job.recipe.split_seed)
           + str(job.node and job.node.data_path), user)
    if key not in _DATA:
        data = job.recipe.data
        section = data.domain(user)
        sources = [_source_on_this_machine(job, user, s) for s in section.sources]
        _DATA[key] = build_user_data(data.device_names[user], sources, job_base_model(job).tokenizer,
                                     data.budgets(user), data.context_length, job.recipe.split_seed + 7919 * user)
    return _DATA[key]


def _source_on_this_machine(job: Job, user: int, source: SourceSection) -> SourceSpec:
    """How this machine reads one source of user ``user``. On a device (``flwr run``) only its own
    user's, and ``source: device`` is the device's own ``data-path``; no device reads another's data."""
    if not job.on_device:
        return SourceSpec(source.source, source.options(), source.weight)
    node = job.node
    if user != node.partition_id:
        raise UserError(f"device {node.partition_id} was asked for user {user}'s data, which only that user's "
                        "device holds", "this recipe or method needs every user's data on one machine: run it in "
                        "the local simulation (ondevice-moe finetune without --federation)")
    if source.source != "device":
        return SourceSpec(source.source, source.options(), source.weight)
    if node.data_path is None:
        raise UserError(f"user '{job.recipe.user_names[user]}' has `source: device`, but this device's "
                        "--node-config has no data-path", FIX)
    options = {**source.options(), "path": str(node.data_path)}
    return SourceSpec(device_source_kind(node.data_path), options, source.weight)


_SOURCES: dict[str, list[tuple[str, torch.Tensor]]] = {}


def source_test_blocks(job: Job) -> list[tuple[str, torch.Tensor]]:
    """Each distinct source of the users' text alone, with test blocks of its own (``data.test_tokens``,
    cut to ``data.max_eval_blocks``): where FedSoft's centres are scored one source at a time
    (Tables 1, 3) when the users hold mixtures. Drawn with seeds of their own, so a document
    may also sit in a user's training split, as documents may between users of one source."""
    data = job.recipe.data
    key = data.model_dump_json() + job.recipe.model.name + str(job.recipe.split_seed)
    if key not in _SOURCES:
        distinct = {}
        for user in data.users:
            for source in user.sources:
                distinct.setdefault(source.model_dump_json(exclude={"weight"}), source)
        budgets = {"train": data.context_length, "valid": data.context_length, "test": data.test_tokens}
        tests = []
        for index, source in enumerate(distinct.values()):
            built = build_user_data(source.source, [SourceSpec(source.source, source.options(), 1.0)],
                                    job_base_model(job).tokenizer, budgets, data.context_length,
                                    job.recipe.split_seed + 104729 * (index + 1))
            tests.append((source.source, built.test if data.max_eval_blocks is None
                          else built.test[: data.max_eval_blocks]))
        _SOURCES[key] = tests
    return _SOURCES[key]


def users_of_device(job: Job, device: int) -> list[int]:
    """The users whose data a device holds: all of them for the centralized upper bound."""
    return list(range(job.recipe.data.devices)) if job.method.centralized else [device]


def domain_users(job: Job) -> range:
    """One user per domain: the first devices, ``k < D``, hold ``users[k]`` (every user without ``data.clients``)."""
    return range(len(job.recipe.data.users))


def device_split(job: Job, device: int, split: str) -> torch.Tensor:
    return torch.cat([user_data(job, u).split(split) for u in users_of_device(job, device)])


def router_blocks(job: Job, device: int) -> torch.Tensor:
    """The blocks a device's routers learn on (CoMiGS eq. 4).

    The validation split "reflects the target distribution" (§2.1): the
    device's own (``data.router_validation: own``), or, when the target is the
    union of all users' distributions (the out-of-distribution task, §3.1.2,
    Fig. 4), every user's validation split (``union``; one device per domain
    under ``data.clients``). The ``-tr`` ablation uses the training split.
    """
    split = job.method.procedure.router_data
    if split == "valid" and job.recipe.data.router_validation == "union":
        return torch.cat([user_data(job, user).valid for user in domain_users(job)])
    return device_split(job, device, split)


def eval_blocks(job: Job, user: int) -> torch.Tensor:
    """The blocks a user's perplexities are scored on: its ``data.eval_split`` (the test split,
    or the validation split for choosing a learning rate), cut to ``data.max_eval_blocks``."""
    blocks = user_data(job, user).split(job.recipe.data.eval_split)
    cap = job.recipe.data.max_eval_blocks
    return blocks if cap is None else blocks[:cap]


def build_model(job: Job, device: int, base: nn.Module | None = None, seed: int | None = None) -> nn.Module:
    """The device's model: the shared base (``base``, or the recipe's model) with this device's
    experts (and task head) attached, initialised from ``seed`` (default: the recipe's)."""
    layout = job.method.layouts[device]
    base = job_base_model(job).model if base is None else base
    whole = job.method.procedure.full_finetune
    if whole:
        base = copy.deepcopy(base)
        if layout is None:
            return base.requires_grad_(True)
    if layout is None:
        return base
    heads = () if job.recipe.is_language_modelling else head_paths(base)
    model = attach_layout(base, layout, seed=job.recipe.seed if seed is None else seed, user=device, own=heads)
    if whole:  # FLoRAL trains the base u with its adaptors (Alg. 1 line 8)
        return model.requires_grad_(True)
    for path in heads:
        model.get_submodule(path).requires_grad_(True)
    return model


def head_paths(model: nn.Module) -> tuple[str, ...]:
    """The task head of a sequence classifier (trained and averaged like FedAvg)."""
    return tuple(name for name, _ in model.named_modules()
                 if name in ("classifier", "score") or name.endswith(".pooler"))


def restore_model(job: Job, device: int, shared: ArrayRecord | None, state: RecordDict) -> nn.Module:
    """The device's model to evaluate: fresh experts, then its private tensors, then the server's."""
    model = build_model(job, device)
    _load_tensors(model, device_state.private_tensors(state), shared)
    return model


def restore_trainer(job: Job, device: int, shared: ArrayRecord | None, state: RecordDict) -> DeviceTrainer:
    """Rebuild the device's trainer: fresh experts, then private state, then the server's tensors."""
    model = build_model(job, device)
    if job.recipe.model.activation_checkpointing:
        enable_activation_checkpointing(model)
    trainer = DeviceTrainer(model, job.method, job.training)
    private, optimizer = device_state.load_device_state(state, with_optimizer=True)
    _load_tensors(model, private, shared)
    if optimizer is not None:
        trainer.load_optimizer_state(optimizer)
    return trainer


def _load_tensors(model: nn.Module, private: dict[str, torch.Tensor], shared: ArrayRecord | None) -> None:
    """Load a device's private tensors, then the server's shared ones, into ``model``."""
    tensors = dict(private)
    if shared is not None and len(shared) > 0:
        tensors.update(shared.to_torch_state_dict())
    if tensors:
        tensors = fit_received(model, tensors)  # HetLoRA sends pruned modules at their kept rank
        check_received(model.state_dict(), tensors)
        model.load_state_dict(tensors, strict=False)


def shape_mismatch(own: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> str | None:
    """The first tensor of ``loaded`` whose shape differs from ``own``'s, said in words, or ``None``."""
    for name, tensor in loaded.items():
        if name in own and tensor.shape != own[name].shape:
            return f"{name} has shape {list(tensor.shape)}; the model's has {list(own[name].shape)}"
    return None


def check_received(own: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> None:
    """A device trusts the server no further than it must: every tensor it loads must be one it
    holds, of the same shape and kind (floating point or not), and finite; else a ``ValueError``
    naming the tensor, before anything is trained on it."""
    missing = set(received) - set(own)
    if missing:
        raise ValueError(f"received tensors this device does not hold: {sorted(missing)[:3]}")
    mismatch = shape_mismatch(own, received)
    if mismatch:
        raise ValueError(f"received tensor {mismatch}")
    for name, tensor in received.items():
        mine = own[name]
        if tensor.is_floating_point() != mine.is_floating_point():
            raise ValueError(f"received tensor {name} is {tensor.dtype}; this device's is {mine.dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"received tensor {name} holds non-finite values; this device will not train on it")


def mix_relayed_peers(job: Job, device: int, trainer: DeviceTrainer, arrays: ArrayRecord | None) -> dict[str, float]:
    """PCL: replace the device's model by its peers' models weighted by trust on its validation
    split (:func:`~ondevice_moe.federation.peers.mix_peers`); ``trust_<j>`` per peer, or
    nothing on a round without relayed models."""
    if arrays is None or len(arrays) == 0:
        return {}
    peers = split_peers(arrays.to_torch_state_dict())
    weights = mix_peers(trainer.model, peers, device_split(job, device, "valid"), job.recipe.data.eval_batch_size)
    return {f"trust_{peer}": weight for peer, weight in weights.items()}


def received_centres(job: Job, arrays: ArrayRecord | None) -> dict[int, Tensors]:
    """All S cluster centres: those the server sent, the others (not aggregated yet) from their seeds."""
    sent = split_centres(arrays.to_torch_state_dict()) if arrays is not None and len(arrays) > 0 else {}
    return {centre: sent.get(centre) or initial_centre(job, centre) for centre in range(job.server_rule.clusters)}


def initial_centre(job: Job, centre: int) -> Tensors:
    """Centre ``centre`` as first drawn: the recipe's model built from the centre's own seed; of
    cluster adapters, the LoRA (and head) from that seed with a random ``B`` (``lora_spread``)."""
    if job.method.layouts[0] is not None:
        return _initial_adapter_centre(job, centre)
    model, spec = job.recipe.model, job.recipe.task.spec()
    with torch.random.fork_rng(devices=[]):
        loaded = load_base_model(model.name, model.dtype, model.quantization, spec.num_labels,
                                 centre_seed(job.recipe.seed, centre), model.device,
                                 regression=spec.is_regression, input_shape=spec.input_shape,
                                 model_options=small_model_options(model.bias))
    return dict(loaded.model.state_dict())


def _initial_adapter_centre(job: Job, centre: int) -> Tensors:
    seed = centre_seed(job.recipe.seed, centre)
    model = build_model(job, 0, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    spread = job.method.procedure.centres.lora_spread
    tensors = {name: tensor.detach().clone() for name, tensor in trainable_state(model).items()
               if travels(job.method, name)}
    for name, tensor in tensors.items():
        if name.endswith("lora_B"):
            tensor.copy_(spread * torch.randn(tensor.shape, generator=generator))
    return tensors


def centre_examples(job: Job, device: int):
    """The examples a device scores the centres on: a language model's blocks of the method's
    split (``CentreProcedure.scored_on``: its training blocks, or its held-out validation blocks),
    or a task's training examples."""
    if job.recipe.is_language_modelling:
        return BlockExamples(device_split(job, device, job.method.procedure.centres.scored_on))
    return federated_task(job).train[device]


def anchor_to_centres(job: Job, device: int, trainer: DeviceTrainer, arrays: ArrayRecord | None,
                      state: RecordDict, server_round: int) -> dict[str, float]:
    """Set up a round against the centres (FedSoft Alg. 1, IFCA); returns what the device chose.

    FedSoft: every τ rounds (and on a device's first round) the importances ``u_k`` are
    re-estimated on the training examples and kept in ``context.state`` (lines 3–13);
    the device's own model is anchored to all centres by them (eq. 4). IFCA: the model
    becomes the centre with the lowest loss on the training examples, trained without a
    proximal term. FedEM: the E-step weighs each training example over the centres from the
    mixture π kept in ``context.state`` (uniform at first), and the M-step sets π from them.
    Either way the weights travel with the update (:func:`upload`)."""
    procedure = job.method.procedure.centres
    centres = received_centres(job, arrays)
    examples = centre_examples(job, device)
    losses = centre_losses(copy.deepcopy(trainer.model), centres, examples)
    ordered = tuple(centres[c] for c in sorted(centres))
    if procedure.assignment == "em":
        scores = example_nll(losses, examples, procedure.block_loss)
        posteriors = responsibilities(scores, device_mixture(state, len(centres)))
        mixture = mixture_of(posteriors)
        state[IMPORTANCE_KEY] = ConfigRecord({"u": mixture})
        trainer.anchors = ProximalAnchors(ordered, tuple(mixture), 0.0, posteriors)
        return {f"importance_{centre}": weight for centre, weight in enumerate(mixture)}
    if procedure.assignment == "hard":
        chosen = hard_assignment(losses)
        trainer.model.load_state_dict(centres[chosen], strict=False)
        weights = [float(centre == chosen) for centre in sorted(centres)]
        trainer.anchors = ProximalAnchors(ordered, tuple(weights), 0.0)
        return {"centre": chosen}
    if (server_round - 1) % procedure.estimation_interval == 0 or IMPORTANCE_KEY not in state:
        state[IMPORTANCE_KEY] = ConfigRecord({"u": importance_weights(losses, procedure.importance_floor)})
    weights = device_mixture(state, len(centres))
    trainer.anchors = ProximalAnchors(ordered, tuple(weights), procedure.proximal_lambda)
    return {f"importance_{centre}": weight for centre, weight in enumerate(weights)}


def device_mixture(state: RecordDict, clusters: int) -> list[float]:
    """The device's weights over the centres as it last set them (FedSoft's u_k, FedEM's π),
    uniform before its first round."""
    if IMPORTANCE_KEY in state:
        return [float(weight) for weight in state[IMPORTANCE_KEY]["u"]]
    return [1.0 / clusters] * clusters


def local_model_of(job: Job, device: int, model: nn.Module, centres: dict[int, Tensors],
                   state: RecordDict) -> None:
    """The model a device of a clustered method is tested with: FedSoft's own ``w_k`` (already
    in ``model``), IFCA's lowest-loss centre, FedEM's centre of largest π (FedSoft §5: "the
    center corresponding to the largest importance weight as a client's local model"; FedEM's
    own prediction, the π-mixture of the centres' outputs, is not built)."""
    assignment = job.method.procedure.centres.assignment
    if assignment == "hard":
        losses = centre_losses(copy.deepcopy(model), centres, centre_examples(job, device))
        model.load_state_dict(centres[hard_assignment(losses)], strict=False)
    elif assignment == "em":
        mixture = device_mixture(state, len(centres))
        model.load_state_dict(centres[max(range(len(mixture)), key=mixture.__getitem__)], strict=False)


def save_private_state(job: Job, device: int, trainer: DeviceTrainer, state: RecordDict) -> None:
    """Keep private tensors (all trained tensors with ``sharing.devices_keep_models``) and
    optimiser state for the device's next round (:mod:`~ondevice_moe.federation.device_state`)."""
    keep_all = trainer.method.sharing.devices_keep_models
    private = {n: t for n, t in trainable_state(trainer.model).items()
               if keep_all or trainer.method.role_of(n) is Role.PRIVATE}
    device_state.save_device_state(job, device, private, trainer.optimizer_state(), state)


def travels(method: Method, name: str) -> bool:
    """Whether a trained tensor may leave the device: shared and trained by the method."""
    return method.role_of(name) is Role.SHARED and method.is_trainable(name)


def shared_state(trainer: DeviceTrainer) -> dict[str, torch.Tensor]:
    """The tensors that leave the device: shared and trainable.

    With ``sharing.selected_only`` (Hermes §4.3), only each block's most used
    experts of the round travel (:func:`experts_left_home`).
    """
    left_home = experts_left_home(trainer.model) if trainer.method.sharing.selected_only else set()
    return {
        name: tensor.clone()
        for name, tensor in trainable_state(trainer.model).items()
        if travels(trainer.method, name) and name not in left_home
    }


def travelling_state(job: Job, trainer: DeviceTrainer) -> dict[str, torch.Tensor]:
    """A copy of every tensor that may leave the device, whichever experts travel this round:
    where the round's update starts from (recipe ``privacy``)."""
    return {name: tensor.clone() for name, tensor in trainable_state(trainer.model).items()
            if travels(job.method, name)}


def experts_left_home(model: nn.Module) -> set[str]:
    """Parameter names of the routed experts a device keeps this round.

    Hermes §4.3: "each client uploads only the parameters of its selected
    top-k PEFT modules". With per-token routing some token selects nearly
    every expert in a round, so counting any selection would save nothing.
    Per block, the router's ``top_k`` experts with the most tokens this round
    travel (never one that no token selected); the others stay home.
    """
    kept: set[int] = set()
    for router in hermes_routers(model):
        ranked = torch.argsort(router.usage, descending=True, stable=True).tolist()
        uploaded = {index for index in ranked[: router.top_k] if router.usage[index] > 0}
        for index, expert in enumerate(router.experts):
            if index not in uploaded:
                kept.update(id(param) for param in router.expert_params.get(expert, []))
    return {name for name, param in model.named_parameters() if id(param) in kept}


def upload_reference(job: Job, device: int) -> dict[str, torch.Tensor]:
    """Names, shapes and dtypes of every tensor the device may upload (whatever its usage),
    as empty tensors on the meta device: what the server checks an update against."""
    model = build_model(job, device)
    one = {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
           for name, tensor in trainable_state(model).items() if travels(job.method, name)}
    if not _trains_every_centre(job):
        return one
    return {centre_key(centre, name): tensor for centre in range(job.server_rule.clusters)
            for name, tensor in one.items()}


def _trains_every_centre(job: Job) -> bool:
    """FedEM: the device trains and sends every centre."""
    return job.method.procedure.centres is not None and job.method.procedure.centres.trains_every_centre


def upload(job: Job, trainer: DeviceTrainer) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """What the device sends after a round: its shared tensors and the numbers the server
    weighs them by — ``usage``: each uploaded expert tensor's usage count, when the server
    weighs experts by usage (Hermes); ``mixture``: the client's ``π`` (FLoRAL Alg. 1 line 12),
    or its weights over the cluster centres (FedSoft's ``u_k``, IFCA's one-hot choice, FedEM's π).
    FedEM's tensors are every centre it trained (``trainer.uploads``), not the model's."""
    tensors = shared_state(trainer) if trainer.uploads is None else trainer.uploads
    records: dict[str, dict] = {}
    if job.method.sharing.selected_only:
        records["usage"] = {name: count for name, count in expert_usage(trainer.model).items() if name in tensors}
    mixture = client_mixture(trainer.model)
    if mixture is not None:
        records["mixture"] = {"pi": mixture}
    if trainer.anchors is not None and job.method.procedure.centres is not None:
        records["mixture"] = {"pi": list(trainer.anchors.weights)}
    return tensors, records


def expert_usage(model: nn.Module) -> dict[str, float]:
    """Tokens routed to each routed expert's tensors since the round began (Hermes ``h``)."""
    by_id = {}
    for router in hermes_routers(model):
        for index, kind in enumerate(router.experts):
            for param in router.expert_params.get(kind, []):
                by_id[id(param)] = float(router.usage[index])
    return {name: by_id[id(param)] for name, param in model.named_parameters() if id(param) in by_id}


def start_round(model: nn.Module) -> None:
    """Reset the routers' usage counts: each upload reports one round's usage."""
    for router in hermes_routers(model):
        router.usage.zero_()


def epoch_sampler(examples, batch_size: int, seed: int):
    """``sample(i)``: batch ``i`` of seeded epoch permutations of a client's examples."""
    per_epoch = max(1, -(-len(examples) // batch_size))

    def sample(index: int) -> dict[str, torch.Tensor]:
        epoch, position = divmod(index - 1, per_epoch)
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(
            zlib.crc32(f"{seed}:epoch:{epoch}".encode())))
        return examples.batch(order[position * batch_size : (position + 1) * batch_size])

    return sample, per_epoch


def batch_sampler(blocks: torch.Tensor, batch_size: int, seed: int, stream: str):
    """``sample(i)``: a batch of random blocks, the same for the same ``(seed, stream, i)``."""

    def sample(index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{stream}:{index}".encode()))
        rows = torch.randint(0, blocks.shape[0], (batch_size,), generator=generator)
        return {"input_ids": blocks[rows], "labels": blocks[rows]}

    return sample


def checkpoint_path(job: Job, device: int):
    return job.run_dir / "checkpoints" / folder_name(job.method.name) / f"device_{device}.safetensors"


def save_checkpoint(job: Job, device: int, model: nn.Module) -> None:
    """Write everything the device learned (shared and private) after the last round."""
    from safetensors.torch import save_file

    path = checkpoint_path(job, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in trainable_state(model).items()}, str(path))


def record_device_finished(job: Job, device: int) -> None:
    """On a real device, make its run folder one that ``eval`` and ``export`` open: the recipe, which
    device it is (``node.json``) and a ``done`` record for the method, beside the checkpoint."""
    import yaml

    from ondevice_moe.federation.node import NODE_FILE
    from ondevice_moe.report import MetricsLog

    folder = job.run_dir
    (folder / "recipe.yaml").write_text(yaml.safe_dump(job.recipe.model_dump(mode="json"), sort_keys=False),
                                        encoding="utf-8")
    (folder / NODE_FILE).write_text(job.node.to_json(), encoding="utf-8")
    log = MetricsLog(folder / "metrics.jsonl")
    log.discard(job.method.name)
    log.write({"method": job.method.name, "kind": "done", "device": device})


def server_checkpoint_path(job: Job):
    return job.run_dir / "checkpoints" / folder_name(job.method.name) / "server.safetensors"


def save_server_checkpoint(job: Job, tensors: dict[str, torch.Tensor]) -> None:
    """Write what the server holds after the last round and no device does (FedSoft's centres)."""
    from safetensors.torch import save_file

    path = server_checkpoint_path(job)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}, str(path))


def formed_centres(job: Job) -> dict[int, Tensors]:
    """The cluster centres the server of a finished FedSoft, IFCA or FedEM run formed (a centre no
    client ever contributed to is not among them); a method without centres or a missing file ends
    with a clear message."""
    from safetensors.torch import load_file

    if job.method.procedure.centres is None:
        raise UserError(f"method '{job.method.name}' has no cluster centres", "export a fedsoft, ifca or fedem method")
    path = server_checkpoint_path(job)
    if not path.is_file():
        raise UserError(f"no centres for method '{job.method.name}': {path} is missing",
                        "rerun the recipe with this version of ondevice-moe (earlier runs did not keep the centres)")
    return split_centres(load_file(str(path)))


def load_centre(job: Job, centre: int, model: nn.Module) -> None:
    """Load cluster centre ``centre`` of a finished FedSoft, IFCA or FedEM run into ``model``; a method
    without centres, a centre the server never formed or a missing file ends with a clear message."""
    centres = formed_centres(job)
    if centre not in centres:
        raise UserError(f"centre {centre} was never formed in this run", f"use one of: {sorted(centres)}")
    model.load_state_dict(centres[centre], strict=False)


def load_checkpoint(job: Job, device: int, model: nn.Module) -> None:
    """Load a device's checkpoint; a missing or corrupt file ends with a clear message."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = checkpoint_path(job, device)
    if not path.is_file() and job.recipe.data is not None and job.recipe.data.brought_by_devices:
        raise UserError(f"{job.run_dir} is the server's folder of a run on real devices: each device keeps its own "
                        "model", "run it on the device, on its folder <state-dir>/<recipe name> (docs/deployment.md)")
    if not path.is_file():
        raise UserError(f"no checkpoint for method '{job.method.name}', device {device}: {path} is missing",
                        "finish the run first (run the same `ondevice-moe finetune` command again to resume)")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise UserError(f"checkpoint {path} is unreadable ({error})",
                        "delete it and the method's lines in metrics.jsonl, then rerun to retrain") from None
    own = model.state_dict()
    unexpected = set(state) - set(own)
    if unexpected:
        raise UserError(f"checkpoint {path} does not fit the recipe's model (e.g. {sorted(unexpected)[:2]})",
                        "evaluate it with the recipe.yaml it was trained with")
    mismatch = shape_mismatch(own, state)
    if mismatch:
        raise UserError(f"checkpoint {path} does not fit the recipe's model: {mismatch}",
                        "evaluate it with the recipe.yaml it was trained with")
    model.load_state_dict(state, strict=False)


def run_local_procedure(job: Job, device: int, trainer: DeviceTrainer, seed: int) -> tuple[dict[str, float], int]:
    """Run the method's local procedure for one round; returns train metrics and the example count."""
    if _trains_every_centre(job):
        return _train_every_centre(job, device, trainer, seed)
    if job.recipe.is_language_modelling:
        return _train_language_model(job, device, trainer, seed)
    return _train_classifier(job, device, trainer, seed)


def _train_language_model(job: Job, device: int, trainer: DeviceTrainer, seed: int) -> tuple[dict, int]:
    if job.method.procedure.flow is not None:  # Flow, FedAvgFT: epochs over the halves of the blocks
        return flow_round(trainer, *flow_examples(job, device), seed)
    batch = _language_model_batch(job, device)
    train_blocks = device_split(job, device, "train")
    router_split = job.method.procedure.router_data
    metrics = trainer.train_iterations(
        job.recipe.federation.local_iterations,
        batch_sampler(train_blocks, batch, seed, "train"),
        batch_sampler(router_blocks(job, device), batch, seed, f"router-{router_split}"),
    )
    return metrics, int(train_blocks.shape[0])


def _train_classifier(job: Job, device: int, trainer: DeviceTrainer, seed: int) -> tuple[dict, int]:
    if job.method.procedure.flow is not None:
        return flow_round(trainer, *flow_examples(job, device), seed)
    examples = federated_task(job).train[device]
    sampler, per_epoch = epoch_sampler(examples, job.recipe.task.batch_size, seed)
    # The trainer's iteration count runs on across rounds, and so do the epochs.
    metrics = trainer.train_iterations(_local_steps(job, per_epoch), sampler, sampler)
    return metrics, len(examples)


def _language_model_batch(job: Job, device: int) -> int:
    """A language model's training batch: the centralized upper bound sees every user's batch at
    once (CoMiGS: 64 × 4)."""
    return job.recipe.data.batch_size * len(users_of_device(job, device))


def flow_examples(job: Job, device: int) -> tuple[object, int]:
    """The training examples a round of Flow, FedAvgFT, Ditto or APFL runs over (a language
    model's blocks, a classifier's examples), and its batch size."""
    if job.recipe.is_language_modelling:
        return BlockExamples(device_split(job, device, "train")), _language_model_batch(job, device)
    return federated_task(job).train[device], job.recipe.task.batch_size


def adapted_for_test(job: Job, device: int, model: nn.Module) -> nn.Module:
    """The model a Flow-family device is tested with: with ``evaluation: adapted``, a copy of
    ``model`` adapted on the device's training data (:func:`~ondevice_moe.methods.flow.procedure.adapt_for_test`,
    seeded by the device, so ``ondevice-moe eval`` repeats it); else ``model`` itself."""
    if not adapts_before_test(job.method.procedure.flow):
        return model
    twin = build_model(job, device)  # its own router: the routed layers read their gates from it
    twin.load_state_dict(model.state_dict())
    trainer = DeviceTrainer(twin, job.method, job.training)
    adapt_for_test(trainer, *flow_examples(job, device), device_seed(job, device))
    trainer.model.eval()
    return trainer.model


def device_seed(job: Job, device: int) -> int:
    """The seed of a device's training draws (batches, Flow's halves)."""
    return job.recipe.seed * 1000 + device


def _local_steps(job: Job, per_epoch: int) -> int:
    """A round's steps: ``local_epochs`` epochs of a classifier's examples, else ``local_iterations``."""
    epochs = job.recipe.federation.local_epochs
    if epochs and not job.recipe.is_language_modelling:
        return epochs * per_epoch
    return job.recipe.federation.local_iterations


def _train_every_centre(job: Job, device: int, trainer: DeviceTrainer, seed: int) -> tuple[dict, int]:
    """FedEM's local step (Marfoq et al., 2021, Alg. 1, LocalSolver): every centre ``s`` in turn,
    from its received value, takes the round's steps on ``Σ_i q(z_i = s) ℓ_s(i)`` (batch means
    of the E-step's weights times the losses, as the authors' ``fit_epochs(…, weights)``) with a
    fresh optimiser; the trained centres become the upload. The authors' learners keep their
    optimisers across rounds; here only the iteration count (and so the epochs drawn) runs on."""
    examples = centre_examples(job, device)
    batch_size = job.recipe.data.batch_size if job.recipe.is_language_modelling else job.recipe.task.batch_size
    anchors = trainer.anchors
    trained, losses, start = {}, [], trainer.iteration
    for centre, tensors in enumerate(anchors.centres):
        trainer.model.load_state_dict(tensors, strict=False)
        learner = DeviceTrainer(trainer.model, trainer.method, trainer.config)
        learner.iteration = start
        sampler, per_epoch = epoch_sampler(WeightedExamples(examples, anchors.posteriors[centre]), batch_size,
                                           zlib.crc32(f"{seed}:centre:{centre}".encode()))
        losses.append(learner.train_iterations(_local_steps(job, per_epoch), sampler, sampler)["train_loss"])
        trained.update({centre_key(centre, name): tensor for name, tensor in shared_state(learner).items()})
        trainer.iteration = learner.iteration
    trainer.uploads = trained
    return {"train_loss": sum(losses) / len(losses), "iteration": float(trainer.iteration)}, len(examples)
