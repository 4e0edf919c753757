"""The recipe: one YAML file that says everything about a run.

``load_recipe`` validates it with pydantic; every problem (an unknown key, a
wrong type, an unknown model or data source) becomes one :class:`UserError`
naming the key and what would be valid.
"""

from __future__ import annotations

import glob
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from ondevice_moe import strict_yaml
from ondevice_moe.data.sources import SOURCES
from ondevice_moe.data.tasks import TASKS
from ondevice_moe.errors import UserError
from ondevice_moe.methods.base import Method, MethodContext, MethodOptions
from ondevice_moe.methods.registry import (
    BUILT_IN,
    METHODS,
    available_methods,
    build_method,
    family_sections,
    method_options,
)
from ondevice_moe.methods.spec import CLASSIFICATION, LANGUAGE, SMALL
from ondevice_moe.models.registry import MODEL_ALIASES
from ondevice_moe.models.small import SMALL_MODELS
from ondevice_moe.names import folder_name, name_problem
from ondevice_moe.overrides import apply_override
from ondevice_moe.server_rules.robust import Aggregation
from ondevice_moe.server_rules.transport import Transport
from ondevice_moe.tracking.section import LoggingSection


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """The frozen base model. ``device``: ``auto`` picks CUDA when present, else CPU. ``dtype``:
    ``float32``, ``bfloat16``, ``float16``, or ``auto`` (bfloat16 where the device computes it natively,
    else float32: an AVX2 CPU emulates bfloat16 at about 100 times float32's cost).
    ``bias: false`` drops every layer's bias from a small model (FedSoft App. C: linear
    regression "without the intercept term"). ``activation_checkpointing: true`` replays each
    block in the backward pass instead of keeping its activations (transformers models;
    :mod:`~ondevice_moe.models.checkpointing`): less memory for one more forward per step."""

    name: str = "smollm2-135m"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    quantization: Literal["none", "nf4", "int8"] = "none"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    bias: bool = True
    activation_checkpointing: bool = False

    @model_validator(mode="before")
    @classmethod
    def _auto_dtype(cls, data: Any) -> Any:
        """``dtype: auto``: bfloat16 where the model's device computes it natively, else float32
        (:func:`~ondevice_moe.models.devices.preferred_dtype`), decided where the recipe is loaded."""
        if isinstance(data, dict) and data.get("dtype") == "auto":
            from ondevice_moe.models.devices import preferred_dtype

            data = {**data, "dtype": preferred_dtype(str(data.get("device", "auto")))}
        return data

    @model_validator(mode="after")
    def _bias_of_small_models_only(self) -> ModelSection:
        if not self.bias and self.name not in SMALL_MODELS:
            raise ValueError(f"model.bias: false applies to the small models ({', '.join(SMALL_MODELS)}), "
                             f"not to '{self.name}'; drop it")
        return self

    @model_validator(mode="after")
    def _checkpointing_of_transformers_models_only(self) -> ModelSection:
        if self.activation_checkpointing and self.name in SMALL_MODELS:
            raise ValueError(f"model '{self.name}' has no transformer blocks to checkpoint; drop "
                             "model.activation_checkpointing or use a transformers model")
        return self

    @field_validator("name")
    @classmethod
    def _known_model(cls, name: str) -> str:
        if name in MODEL_ALIASES or "/" in name or Path(name).expanduser().is_dir():
            return name
        raise ValueError(f"unknown model '{name}'; use an alias ({', '.join(MODEL_ALIASES)}), "
                         "a hub id such as 'openai-community/gpt2', or a local folder")


MAX_DEVICES = 10_000  # devices (users, clients) of one recipe: more is a typo, and would exhaust memory first
MAX_BATCH = 65_536
MAX_TOKENS = 10**10  # a split's token budget


class SourceSection(_Section):
    """One data source; the options a source does not use are ignored by it."""

    source: str
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    path: str | None = None
    categories: list[str] | None = None
    dataset: str | None = None
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    filter: dict[str, Any] | None = None
    prompt_field: str = "prompt"          # instruction-file: the prompt's column
    response_field: str = "response"      # instruction-file: the response's column
    messages_field: str | None = None     # instruction-file: a column of chat messages, in place of the two

    @field_validator("source")
    @classmethod
    def _known_source(cls, source: str) -> str:
        if source not in SOURCES:
            raise ValueError(f"unknown data source '{source}'; use one of {', '.join(SOURCES)}")
        return source

    def options(self) -> dict[str, object]:
        """The keyword options passed to the source's reader."""
        return self.model_dump(exclude={"source", "weight"}, exclude_none=True)


class UserSection(_Section):
    """A user's domain: ``source: NAME`` (plus options) or ``sources: [...]`` for a mixture.

    ``train_tokens`` / ``valid_tokens`` / ``test_tokens`` override the data
    section's budgets for this user (CoMiGS Table 3 sizes differ per user).
    """

    name: str
    sources: list[SourceSection] = Field(min_length=1)
    train_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    valid_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    test_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        if isinstance(value, dict) and "source" in value:
            value = dict(value)
            own = ("name", "sources", "train_tokens", "valid_tokens", "test_tokens")
            single = {k: value.pop(k) for k in list(value) if k not in own}
            value["sources"] = [single]
        return value


class DataSection(_Section):
    """The users' domains and how their text is cut. Each user is one device, unless ``clients``
    deals ``clients`` devices over the users' domains in turn: device ``k`` holds domain
    ``users[k mod D]`` (D users), drawn with its own seed so devices sharing a domain hold different
    samples of it, and is named ``<user>-<k // D>``.

    ``eval_split``: the split the users' perplexities are scored on, ``test`` (the default) or
    ``valid``, each user's validation split (``data.valid_tokens``), for choosing a learning rate or
    another setting without looking at the test split (``eval/lr_sweep.py``). The report's title and
    ``summary.json``'s ``eval_split`` say which split was scored. A method that learns on the
    validation split (CoMiGS's routers, FDLoRA's fusion weight, FedSoft with ``importance_split:
    valid``) is then scored on blocks it has seen. FedSoft's and IFCA's centre-by-source table stays on
    each source's own test blocks."""

    users: list[UserSection] = Field(min_length=1, max_length=MAX_DEVICES)
    clients: int | None = Field(None, ge=1, le=MAX_DEVICES)
    context_length: int = Field(128, ge=8, le=131_072)
    batch_size: int = Field(64, ge=1, le=MAX_BATCH)
    eval_batch_size: int = Field(16, ge=1, le=MAX_BATCH)
    train_tokens: int = Field(1_000_000, ge=1, le=MAX_TOKENS)
    valid_tokens: int = Field(200_000, ge=1, le=MAX_TOKENS)
    test_tokens: int = Field(200_000, ge=1, le=MAX_TOKENS)
    max_eval_blocks: int | None = Field(None, ge=1)
    router_validation: Literal["own", "union"] = "own"
    eval_split: Literal["test", "valid"] = "test"

    @property
    def brought_by_devices(self) -> bool:
        """Whether some user's data is the device's own (``source: device``, read from its --node-config)."""
        return any(source.source == "device" for user in self.users for source in user.sources)

    @property
    def devices(self) -> int:
        """How many devices (simulated clients) the data is dealt to."""
        return self.clients or len(self.users)

    def domain(self, device: int) -> UserSection:
        """The user section whose domain device ``device`` holds."""
        return self.users[device % len(self.users)]

    @property
    def device_names(self) -> list[str]:
        """The devices' names: the users', or ``<user>-<k // D>`` under ``clients``."""
        if self.clients is None:
            return [user.name for user in self.users]
        return [f"{self.domain(k).name}-{k // len(self.users)}" for k in range(self.clients)]

    def budgets(self, device: int) -> dict[str, int]:
        """Token budgets of one device's train / valid / test splits."""
        section = self.domain(device)
        return {split: getattr(section, f"{split}_tokens") or getattr(self, f"{split}_tokens")
                for split in ("train", "valid", "test")}

    @model_validator(mode="after")
    def _every_domain_has_a_client(self) -> DataSection:
        if self.clients is not None and self.clients < len(self.users):
            raise ValueError(f"clients={self.clients} leaves some of the {len(self.users)} users' domains without a "
                             f"device; use at least {len(self.users)} clients, or drop `clients`")
        return self

    @field_validator("users")
    @classmethod
    def _unique_names(cls, users: list[UserSection]) -> list[UserSection]:
        names = [u.name for u in users]
        if len(set(names)) != len(names):
            raise ValueError(f"user names must be unique, got {names}")
        return users


class TaskSection(_Section):
    """What the clients learn, one of three kinds of task:

    * a registered text task dealt to ``clients`` by Dirichlet(α) label skew (Hermes §5.1);
      ``clusters`` = C shifts the labels of client ``k``'s cluster ``c = k mod C`` to
      ``(y + c) mod L`` (FLoRAL's label-shift concept shift);
    * a small vector or image task (``floral-linear``, ``fedsoft-10-90``, ``digits-rotate``, ...):
      ``clients`` and ``clusters`` default to the paper's K and C, ``data_fraction: 0.05`` is FLoRAL's
      Reduced variant and ``dirichlet_alpha`` skews ``digits-dirichlet``;
    * the user's own labelled data, read through ``datasets``: ``path`` (a ``.csv``, ``.tsv``, ``.json``,
      ``.jsonl`` or ``.parquet`` file, a glob or a folder of them, or a folder written by ``save_to_disk``)
      dealt to ``clients`` by Dirichlet(α) label skew, or ``files``, one file per client (client ``k``
      reads file ``k``, named under the folder ``path``; a glob such as ``"*.csv"`` lists the files it
      matches, sorted; ``clients`` is the number of files, and ``max_*_examples`` cap each client);
      ``text_columns`` (one, or two for sentence pairs), ``label_column`` (class names or indices),
      ``labels`` (the class names, in index order) and ``metric``; ``name`` is then the user's own.

    ``valid_examples`` holds that many examples out of the task's training split as a validation
    split, dealt to the clients as the test split is (each client's own under ``files``; under
    ``max_train_examples`` from the rows that cap leaves out, so training is what it was without one;
    not on the synthetic tasks, which draw their examples from a model). ``eval_split: valid`` scores
    every client on it instead of the test split, for choosing a learning rate or another setting
    without looking at the test split (``eval/lr_sweep.py``); the report's title and ``summary.json``'s
    ``eval_split`` say so. FedSoft's and IFCA's centre-by-source table stays on the test split.
    """

    name: str
    clients: int = Field(8, ge=1, le=MAX_DEVICES)
    dirichlet_alpha: float = Field(1.0, gt=0)
    max_train_examples: int | None = Field(None, ge=1)
    max_test_examples: int | None = Field(None, ge=1)
    max_length: int = Field(128, ge=4, le=131_072)
    batch_size: int = Field(32, ge=1, le=MAX_BATCH)
    eval_batch_size: int = Field(64, ge=1, le=MAX_BATCH)
    path: str | None = None
    files: list[str] | None = Field(None, min_length=1)
    text_columns: list[str] = Field(default_factory=lambda: ["text"], min_length=1, max_length=2)
    label_column: str = "label"
    labels: list[str] | None = None
    metric: Literal["accuracy", "f1", "mcc"] = "accuracy"
    clusters: int | None = Field(None, ge=1)
    data_fraction: float = Field(1.0, gt=0, le=1)
    valid_examples: int | None = Field(None, ge=1)
    eval_split: Literal["test", "valid"] = "test"

    @model_validator(mode="before")
    @classmethod
    def _paper_clients(cls, value: Any) -> Any:
        """A small task without ``clients`` gets its paper's K."""
        if isinstance(value, dict) and "clients" not in value and value.get("path") is None:
            task = TASKS.get(value.get("name"))
            if task is not None and task.clients is not None:
                value = {**value, "clients": task.clients}
        return value

    @model_validator(mode="before")
    @classmethod
    def _one_client_per_file(cls, value: Any) -> Any:
        """``files`` as a glob becomes the sorted names it matches under ``path``; without ``clients``,
        there are as many clients as files."""
        files = value.get("files") if isinstance(value, dict) else None
        if isinstance(files, str):
            folder = Path(value.get("path") or ".").expanduser()
            files = sorted(name for name in glob.glob(files, root_dir=folder, recursive=True)
                           if (folder / name).is_file())
            if not files:
                raise ValueError(f"task.files '{value['files']}' matches no file in {folder}")
        if isinstance(files, list):
            value = {"clients": len(files), **value, "files": files}
        return value

    @model_validator(mode="after")
    def _fits_task(self) -> TaskSection:
        from ondevice_moe.data.small import check_small_options

        # Keys set away from their defaults (a resolved recipe round-trips with every key written out).
        changed = {key for key, field in type(self).model_fields.items()
                   if getattr(self, key) != field.get_default(call_default_factory=True)}
        file_keys = sorted({"text_columns", "label_column", "labels", "metric"} & changed)
        small_keys = sorted({"clusters", "data_fraction"} & changed)
        own_data = self.path is not None or self.files is not None
        if not own_data and self.name not in TASKS:
            raise ValueError(f"unknown task '{self.name}'; use one of {', '.join(TASKS)}, "
                             "or give `path` (and `labels`) to read your own labelled data")
        if not own_data and file_keys:
            raise ValueError(f"{file_keys} only apply to your own labelled data: give `path` or `files` too, "
                             "or drop them")
        if own_data and self.name in TASKS:
            raise ValueError(f"'{self.name}' is a registered task; give the task read from your data another name")
        if own_data and self.label_column in self.text_columns:
            raise ValueError(f"text_columns {self.text_columns} include the label_column '{self.label_column}': the "
                             "model would read the answer; name the columns that hold the text")
        if own_data and self.labels is None:
            raise ValueError("a task read from your own data needs `labels`: its class names in index order, "
                             "e.g. [negative, positive]")
        if self.files is not None and self.clients != len(self.files):
            raise ValueError(f"task.clients={self.clients}, but task.files names {len(self.files)} files and each "
                             f"client reads one: drop `clients`, or name {self.clients} files")
        if self.files is not None and "dirichlet_alpha" in changed:
            raise ValueError("dirichlet_alpha deals one data set over the clients; under task.files each client "
                             "reads its own file: drop it")
        if self.eval_split == "valid" and self.valid_examples is None:
            raise ValueError("task.eval_split: valid scores each client's validation split, and the task holds none: "
                             "set task.valid_examples too (the examples to hold out of its training split)")
        try:
            task = self.spec()
            if not task.is_text:
                check_small_options(task, self.clients, self.clusters, self.data_fraction, self.valid_examples)
        except UserError as error:
            raise ValueError(f"{error.problem}; {error.fix}") from None
        if task.is_text and "data_fraction" in small_keys:
            raise ValueError(f"data_fraction only applies to the small tasks, not to '{self.name}'")
        if task.is_text and self.clusters is not None and (task.is_regression or self.clusters > task.num_labels):
            raise ValueError(f"clusters={self.clusters} cannot shift the labels of '{self.name}' "
                             f"({task.num_labels} label(s)): use 2 to {task.num_labels} clusters on a "
                             "classification task")
        return self

    def spec(self) -> Any:
        """The :class:`~ondevice_moe.data.tasks.TaskSpec`: a registered task, or one over the user's data."""
        from ondevice_moe.data.tasks import UserTaskFile, user_task

        if self.path is None and self.files is None:
            return TASKS[self.name]
        path = Path(self.path or ".").expanduser()
        client_files = tuple(path / Path(name).expanduser() for name in self.files or ())
        file = UserTaskFile(path, tuple(self.text_columns), self.label_column, client_files)
        return user_task(self.name, self.labels, file, self.metric)


FaultKind = Literal["crash", "nan", "wrong-shape", "slow", "sign-flip", "constant", "noise", "stale",
                    "inflated-count", "label-flip"]
LYING_FAULTS = ("sign-flip", "constant", "noise", "stale", "inflated-count", "label-flip")


class FaultSection(_Section):
    """A simulated unreliable or lying device, for robustness studies (:mod:`ondevice_moe.federation.faults`).

    Unreliable: ``crash``: the device raises; ``nan``: it uploads non-finite values;
    ``wrong-shape``: it uploads a tensor of the wrong shape; ``slow``: it sleeps ``delay_s`` seconds
    before replying (past ``reply_timeout_s`` it is dropped). Byzantine (it trains, then lies):
    ``sign-flip``: it sends the model it received moved ``scale`` times its update the other way;
    ``constant``: every value it sends is ``value``; ``noise``: Gaussian noise of std ``std`` added to
    what it sends; ``stale``: it sends, every round, what it sent in the first round the fault was
    active; ``inflated-count``: it claims ``examples`` training examples; ``label-flip``: it trains on
    its data with every class ``c`` read as ``C − 1 − c`` (a classification task's). ``rounds``: ``all``
    or a list of rounds (1-based).
    """

    device: int = Field(ge=0)
    kind: FaultKind
    rounds: Literal["all"] | list[int] = "all"
    delay_s: float = Field(30.0, gt=0)
    scale: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False)
    value: float = Field(100.0, allow_inf_nan=False)
    std: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False)
    examples: int = Field(1_000_000_000, ge=1, le=2**31 - 1)

    def active(self, server_round: int) -> bool:
        return self.rounds == "all" or server_round in self.rounds


class SecAggPlusSection(_Section):
    """The parameters of Flower's SecAgg+ (``flwr.server.workflow.SecAggPlusWorkflow``;
    Bell et al., 2020), with Flower's meanings and defaults; ``num_shares`` /
    ``reconstruction_threshold`` as in Flower's SecAgg+ example (an int counts devices,
    a float is a fraction). ``max_weight`` bounds a device's weight under
    ``weighting: num_examples`` (uniform weighting sends weight 1)."""

    num_shares: int | float = 3
    reconstruction_threshold: int | float = 2
    clipping_range: float = Field(8.0, gt=0)
    quantization_range: int = Field(2**22, gt=0)
    max_weight: float = Field(1000.0, gt=0)

    @model_validator(mode="after")
    def _flower_accepts(self) -> SecAggPlusSection:
        from flwr.server.workflow import SecAggPlusWorkflow

        try:
            SecAggPlusWorkflow(**self.model_dump())
        except (TypeError, ValueError) as error:
            raise ValueError(f"Flower's SecAgg+ refuses these parameters: {error}") from None
        return self


class FederationSection(_Section):
    """Rounds, local work and the server's sampling and failure policy.

    ``fraction_train`` / ``clients_per_round``: how many devices train each
    round (default: all); ``min_clients``: a round with fewer good replies
    fails the method (default: 1); ``reply_timeout_s``: how long the server
    waits for replies; ``eval_every``: evaluate every n rounds (and always
    after the last); ``transport``: how shared tensors travel both ways,
    ``fp32`` (as they are), ``bf16``/``fp16`` (cast) or ``int8`` (symmetric,
    one scale per tensor; :mod:`ondevice_moe.server_rules.transport`);
    ``secure_aggregation``: ``none`` or ``secaggplus`` (Flower's SecAgg+, parameters
    under ``secaggplus``; :mod:`ondevice_moe.federation.secure_aggregation`); ``device_state``: where
    a device keeps its private tensors and optimiser state between rounds, ``memory``
    (Flower's ``context.state``), ``disk`` (a file per device in the run folder;
    :mod:`ondevice_moe.federation.device_state`) or ``auto`` (the default: memory, and disk for a
    device whose state passes 64 MiB, as when a method trains the whole base); ``messages_in_flight``: at most this many
    messages out at a time, the next built and sent as a reply comes back (default: two per
    simulation worker; all at once under ``flwr run``;
    :mod:`ondevice_moe.federation.window`); ``aggregation``: ``mean`` (the method's rule), or a
    Byzantine-robust ``median``, ``trimmed-mean`` (``trim_fraction`` cut from each end) or ``krum``
    (``byzantine`` devices assumed to lie) for methods whose rule is a plain weighted mean
    (:mod:`ondevice_moe.server_rules.robust`); ``update_norm_bound``: an upload whose L2 norm exceeds this
    many times the norm of what the server holds (at least 1) is rejected (``null``: no bound);
    ``join_wait_s``: on real devices, how long a method waits for every device before it starts with
    at least ``min_clients`` of them (the others join from the round after they connect);
    ``evaluation_rides``: a round's evaluation rides on the next round's training messages where
    they carry the same tensors to every device, one exchange instead of two (``null``, the default:
    on real devices, where each exchange costs a SuperNode's pick-up and four hops of the tensors;
    :mod:`ondevice_moe.federation.riding`).
    """

    rounds: int = Field(20, ge=1, le=1_000_000)
    local_iterations: int = Field(10, ge=1, le=1_000_000)
    local_epochs: int | None = Field(None, ge=1, le=10_000)
    weighting: Literal["uniform", "num_examples"] = "uniform"
    cpus_per_client: float = Field(2.0, ge=0.1)
    gpus_per_client: float = Field(0.0, ge=0)
    fraction_train: float | None = Field(None, gt=0, le=1)
    clients_per_round: int | None = Field(None, ge=1)
    min_clients: int = Field(1, ge=1)
    reply_timeout_s: float = Field(3600.0, gt=0)
    eval_every: int = Field(1, ge=1)
    transport: Transport = "fp32"
    faults: list[FaultSection] = Field(default_factory=list)
    secure_aggregation: Literal["none", "secaggplus"] = "none"
    secaggplus: SecAggPlusSection = SecAggPlusSection()
    device_state: Literal["auto", "memory", "disk"] = "auto"
    messages_in_flight: int | None = Field(None, ge=1)
    aggregation: Aggregation = "mean"
    trim_fraction: float = Field(0.2, ge=0, lt=0.5)
    byzantine: int = Field(1, ge=0)
    update_norm_bound: float | None = Field(100.0, gt=0)
    join_wait_s: float = Field(60.0, ge=0)
    evaluation_rides: bool | None = None

    @model_validator(mode="after")
    def _one_sampling_rule(self) -> FederationSection:
        if self.fraction_train is not None and self.clients_per_round is not None:
            raise ValueError("give `fraction_train` or `clients_per_round`, not both")
        return self

    @model_validator(mode="after")
    def _secure_aggregation_fits(self) -> FederationSection:
        if self.secure_aggregation == "none":
            return self
        if self.transport != "fp32":
            raise ValueError(f"secure_aggregation: secaggplus quantizes uploads into its own integer ring "
                             f"(secaggplus.quantization_range), so transport {self.transport} does not apply; "
                             "set transport: fp32")
        corrupting = sorted({f.kind for f in self.faults} & {"nan", "wrong-shape", *LYING_FAULTS})
        if corrupting:
            raise ValueError(f"faults {corrupting} corrupt or forge one device's upload, which the server cannot see, "
                             "check or drop under secure_aggregation: secaggplus (only the masked sum); "
                             "use crash or slow faults, or secure_aggregation: none")
        return self


class PrivacySection(_Section):
    """Differential privacy of what leaves a device (:mod:`ondevice_moe.federation.privacy`):
    each round's update of the shared tensors is clipped to L2 norm ``clip_norm`` and gets
    Gaussian noise of std ``noise_multiplier · clip_norm`` on the device. Off by default.
    ``delta``: the δ at which ε is reported (:mod:`ondevice_moe.federation.accountant`); keep it
    well below 1 / the number of devices."""

    clip_norm: float | None = Field(None, gt=0)
    noise_multiplier: float = Field(0.0, ge=0)
    delta: float = Field(1e-5, gt=0, lt=1)

    @property
    def enabled(self) -> bool:
        return self.clip_norm is not None

    @model_validator(mode="after")
    def _noise_needs_a_bound(self) -> PrivacySection:
        if self.noise_multiplier > 0 and self.clip_norm is None:
            raise ValueError("noise_multiplier scales the noise to clip_norm: give clip_norm too")
        return self


class TrainingSection(_Section):
    lr: float = Field(2e-3, gt=0)
    router_lr: float = Field(2e-3, gt=0)
    router_period: int = Field(30, ge=1)
    router_steps: int = Field(10, ge=0)
    balance_weight: float = Field(0.01, ge=0)
    warmup_fraction: float = Field(0.05, gt=0, lt=1)
    grad_clip: float | None = Field(1.0, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    router_weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    lr_schedule: Literal["one-cycle-cosine", "cosine", "constant"] = "one-cycle-cosine"
    optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: float = Field(0.0, ge=0, lt=1)
    compile: bool = False  # torch.compile each device's model: compiles once per process, then faster steps
    fused_experts: bool = False  # each expert site computes its experts batched (ondevice_moe/layout/fused.py)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= beta < 1 for beta in betas):
            raise ValueError(f"AdamW betas must lie in [0, 1), got {list(betas)}")
        return betas

    @model_validator(mode="after")
    def _momentum_is_sgds(self) -> TrainingSection:
        if self.momentum and self.optimizer != "sgd":
            raise ValueError("momentum is SGD's (AdamW has betas): set optimizer: sgd, or drop momentum")
        return self


class MethodEntry(BaseModel):
    """A method of the run: ``name`` plus the options its own schema takes
    (``ondevice_moe.methods.registry``); a bare string is a method with defaults."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        methods = available_methods()
        if name not in methods:
            raise ValueError(f"unknown method '{name}'; use one of {', '.join(methods)}")
        return name

    def raw_options(self) -> dict[str, Any]:
        """The entry's own options, as written."""
        return dict(self.model_extra or {})


class _RecipeHead(_Section):
    """A recipe's first keys: what it is called, its seeds and its base model."""

    name: str
    description: str = ""
    seed: int = Field(0, ge=0, lt=2**32)
    data_seed: int | None = Field(None, ge=0, lt=2**32)
    model: ModelSection = ModelSection()


# The built-in method families' sections (``experts:``, ``hermes:``, …), each owned by its family's
# MethodSpec (``defaults_section``, ``section``): the recipe imports none of them.
_RecipeWithFamilies = create_model(
    "_RecipeWithFamilies", __base__=_RecipeHead,
    **{name: (schema, schema()) for name, schema in family_sections(BUILT_IN).items()})


class Recipe(_RecipeWithFamilies):
    """A run: language modelling (``data`` with users) or classification (``task``). A plug-in family's
    section sits at the top level like a built-in one; it is kept in ``plugin_sections`` and written
    back at the top level."""

    data: DataSection | None = None
    task: TaskSection | None = None
    federation: FederationSection = FederationSection()
    privacy: PrivacySection = PrivacySection()
    training: TrainingSection = TrainingSection()
    logging: LoggingSection = LoggingSection()
    plugins: list[str] = Field(default_factory=list)
    """Python files or package folders of methods of the recipe's own (:mod:`ondevice_moe.methods.plugins`),
    relative to the recipe; their code runs only where the user trusts it (``--trust-plugins``)."""
    methods: list[MethodEntry] = Field(min_length=1)
    plugin_sections: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _register_plugins(cls, data: Any) -> Any:
        """Register the plug-ins' methods before the method entries are read, and set aside the
        sections their families own (checked by each family's schema once the recipe is read)."""
        plugins = data.get("plugins") if isinstance(data, dict) else None
        if isinstance(plugins, list) and all(isinstance(path, str) for path in plugins):
            available_methods(tuple(Path(path) for path in plugins))
            owned = {key for key in family_sections() if key not in cls.model_fields}
            if owned & set(data):
                sections = {key: value for key, value in data.items() if key in owned}
                data = {key: value for key, value in data.items() if key not in owned}
                held = data.get("plugin_sections", {})
                data["plugin_sections"] = {**held, **sections} if isinstance(held, dict) else held
        return data

    @model_validator(mode="after")
    def _plugin_sections_fit(self) -> Recipe:
        schemas = family_sections()
        for name, values in self.plugin_sections.items():
            if name not in schemas:
                raise ValueError(f"no method family owns the recipe section '{name}'")
            schemas[name].model_validate(values)
        return self

    @model_serializer(mode="wrap")
    def _sections_at_the_top(self, handler: Any) -> dict[str, Any]:
        """A plug-in family's section is written where the recipe holds it: at the top level."""
        dumped = handler(self)
        return {**{key: value for key, value in dumped.items() if key != "plugin_sections"},
                **dumped.get("plugin_sections", {})}

    def family_section(self, name: str) -> dict[str, Any]:
        """A family's section, as its shared defaults (a built-in one filled in by its schema)."""
        if name in type(self).model_fields:
            return getattr(self, name).model_dump()
        return family_sections()[name].model_validate(self.plugin_sections.get(name, {})).model_dump()

    @property
    def split_seed(self) -> int:
        """The seed of the data: users' splits, the Dirichlet partition, synthetic tasks.
        ``data_seed`` when given, so that runs over training ``seed``s share one split
        and their spread is training variance; otherwise ``seed``."""
        return self.seed if self.data_seed is None else self.data_seed

    @model_validator(mode="after")
    def _one_kind_of_run(self) -> Recipe:
        if (self.data is None) == (self.task is None):
            raise ValueError("give either `data` (language modelling, one domain per user) "
                             "or `task` (classification with Dirichlet clients), not both or neither")
        kind = self.task_kind
        small_model = self.model.name in SMALL_MODELS
        if small_model != (kind == SMALL):
            raise ValueError(f"model '{self.model.name}' does not fit a {kind} task: the small models "
                             f"({', '.join(SMALL_MODELS)}) go with the small tasks, language models with text")
        wrong = [m.name for m in self.methods if kind not in METHODS[m.name].tasks]
        if wrong:
            valid = [name for name, spec in METHODS.items() if kind in spec.tasks]
            raise ValueError(f"methods {wrong} do not run on a {kind} recipe; use {', '.join(valid)}")
        built = [self._method_for_validation(index) for index in range(len(self.methods))]
        for method in built:
            layouts = [layout for layout in method.layouts if layout is not None and layout.router.kind == "token-topk"
                       and len(layout.experts) > 1]  # one expert needs no router
            widest = max((len(layout.experts) for layout in layouts), default=0)
            if layouts and layouts[0].router.top_k > widest:
                raise ValueError(f"{method.name} routes each token to its top_k = {layouts[0].router.top_k} experts, "
                                 f"but no device holds more than {widest}: set top_k to at most {widest}")
        problems = [problem for m in built for problem in m.procedure.recipe_problems(
            m.name, hugging_face=not small_model, language_modelling=kind == LANGUAGE, private=self.privacy.enabled)]
        if problems:
            raise ValueError("; ".join(problems))
        whole = [m.name for m in built if m.procedure.full_finetune]
        way_out = "drop them, give FLoRAL and Local Adaptor entries `train_base: false`, or set"
        if whole and self.model.quantization != "none":
            raise ValueError(f"methods {whole} train every base weight, which a {self.model.quantization} "
                             f"base cannot: quantized weights are frozen; {way_out} model.quantization: none")
        if whole and self.model.dtype != "float32":
            raise ValueError(f"methods {whole} train every base weight, which a {self.model.dtype} base "
                             "holds too coarsely: an optimizer step below half a weight's spacing (in bfloat16 "
                             f"1/256 to 1/512 of the weight) rounds away; {way_out} model.dtype: float32")
        if self.federation.aggregation != "mean":
            from ondevice_moe.server_rules.rules import ServerRule

            plain = [m.name for m in built if type(m.server_rule) is not ServerRule or m.centralized]
            if plain:
                raise ValueError(f"federation.aggregation: {self.federation.aggregation} replaces a plain weighted "
                                 f"mean of the devices' uploads, which methods {plain} do not take (their rules "
                                 "weigh by usage, π, centres, peers or ranks); drop them or use aggregation: mean")
            if self.federation.secure_aggregation != "none":
                raise ValueError("federation.aggregation needs each device's upload, which SecAgg+ hides; "
                                 "use aggregation: mean or secure_aggregation: none")
        if self.federation.secure_aggregation != "none":
            refused = [f"{m.name}: {why}" for m in built if (why := secure_aggregation_refusal(m))]
            if refused:
                raise ValueError("secure_aggregation: secaggplus only sums one weighted vector per device, so it "
                                 "cannot run " + "; ".join(refused) + ". Drop these methods or set "
                                 "federation.secure_aggregation: none")
        self._faults_fit()
        names = [m.name for m in built]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"two method entries resolve to the same name {repeated}; "
                             "give one of them `label: <another name>`")
        labels = [str(entry.raw_options()["label"]) for entry in self.methods if "label" in entry.raw_options()]
        problems = [problem for label in labels if (problem := name_problem("method label", label))]
        if problems:
            raise ValueError(problems[0])
        folders = [folder_name(name) for name in names]
        if len(set(folders)) != len(folders):
            raise ValueError(f"method names {names} would share a folder ({folders}); give one entry a `label`")
        return self

    def _faults_fit(self) -> None:
        """Simulated faults name devices and rounds the recipe has; SecAgg+ has at least two devices a round."""
        devices, rounds = len(self.user_names), self.federation.rounds
        for fault in self.federation.faults:
            if fault.device >= devices:
                raise ValueError(f"a fault names device {fault.device}, but the recipe has devices 0 to {devices - 1}")
            outside = sorted(r for r in ([] if fault.rounds == "all" else fault.rounds) if not 1 <= r <= rounds)
            if outside:
                raise ValueError(f"a fault of device {fault.device} names rounds {outside}, outside 1 to {rounds}")
            if fault.kind == "label-flip" and (self.task is None or self.task.spec().is_regression):
                raise ValueError(f"a label-flip fault (device {fault.device}) flips a classification task's classes; "
                                 "this recipe has none: use another fault kind")
        per_round = self.federation.clients_per_round or max(1, int((self.federation.fraction_train or 1) * devices))
        if self.federation.secure_aggregation != "none" and per_round < 2:
            raise ValueError(f"secure_aggregation: secaggplus masks each device's update with the others', so "
                             f"it needs at least 2 devices a round (this recipe has {per_round})")
        self._robust_rule_fits(per_round)

    def _robust_rule_fits(self, per_round: int) -> None:
        """A Byzantine-robust aggregation does something with the round's devices: Krum needs
        ``n ≥ f + 3`` (Blanchard et al. 2017: ``n − f − 2`` neighbours), a trimmed mean cuts at least one
        value from each end (``⌊β n⌋ ≥ 1``), at the devices a round trains."""
        federation = self.federation
        if federation.aggregation == "krum" and per_round < federation.byzantine + 3:
            raise ValueError(f"aggregation: krum with byzantine: {federation.byzantine} needs at least "
                             f"{federation.byzantine + 3} devices a round; this recipe has {per_round}: lower "
                             "federation.byzantine or use aggregation: median")
        if federation.aggregation == "trimmed-mean" and int(federation.trim_fraction * per_round) < 1:
            raise ValueError(f"aggregation: trimmed-mean with trim_fraction {federation.trim_fraction} trims nothing "
                             f"from a round of {per_round} devices: a plain mean; set trim_fraction to at least "
                             f"{1 / per_round:.3g}")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        problem = name_problem("recipe name", name)
        if problem:
            raise ValueError(problem)
        return name

    def method_options(self, index: int) -> MethodOptions:
        """Entry ``index``'s options, validated by its method's schema, with its family's section as defaults."""
        entry = self.methods[index]
        section = METHODS[entry.name].defaults_section
        defaults = self.family_section(section) if section else {}
        try:
            return method_options(entry.name, entry.raw_options(), defaults)
        except UserError as error:
            raise ValueError(f"{error.problem} ({error.fix})") from None

    def method_context(self) -> MethodContext:
        clusters = None
        if self.task is not None and self.task.path is None and self.task.files is None:
            clusters = self.task.clusters or self.task.spec().clusters
        return MethodContext(num_users=len(self.user_names), weighting=self.federation.weighting, clusters=clusters,
                             seed=self.seed)

    def method(self, index: int) -> Method:
        """Entry ``index`` resolved for the recipe's devices."""
        return build_method(self.methods[index].name, self.method_options(index), self.method_context())

    def method_name(self, index: int) -> str:
        """The name entry ``index``'s results are reported under."""
        return self.method(index).name

    def _method_for_validation(self, index: int) -> Method:
        try:
            return self.method(index)
        except UserError as error:
            raise ValueError(f"{error.problem} ({error.fix})") from None

    @property
    def metric(self) -> str:
        """What the run is scored by: ``perplexity`` for language modelling, else the task's metric."""
        return "perplexity" if self.is_language_modelling else self.task.spec().metric

    @property
    def task_kind(self) -> str:
        """Language modelling, text classification, or a small-model task (vectors and images)."""
        if self.is_language_modelling:
            return LANGUAGE
        return CLASSIFICATION if self.task.spec().is_text else SMALL

    @property
    def is_language_modelling(self) -> bool:
        return self.data is not None

    @property
    def user_names(self) -> list[str]:
        if self.data is not None:
            return self.data.device_names
        return [f"client_{i}" for i in range(self.task.clients)]


# -- loading ------------------------------------------------------------------


def secure_aggregation_refusal(method: Method) -> str | None:
    """Why ``method`` cannot aggregate under SecAgg+, or ``None`` when its server rule is a plain
    weighted sum of the same tensors from every device (FedAvg, CoMiGS's generalists): its rule
    needs each device's update (:attr:`~ondevice_moe.server_rules.rules.ServerRule.needs_each_update`),
    its devices upload different tensors, or one device trains on everyone's data."""
    rule = method.server_rule
    if rule.needs_each_update:
        return rule.needs_each_update
    if rule.partial_uploads:
        return "devices upload only the experts they used, so their vectors differ in layout"
    if method.centralized:
        return "one device trains on every user's data, so there is no sum to hide"
    return None


MAX_RECIPE_BYTES = 2**20  # a recipe is a page of settings; more is a mistake or an attack


def load_recipe(path: str | Path, overrides: list[str] | None = None, seed: int | None = None) -> Recipe:
    """Read, override (``key.sub=value``) and validate a recipe file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist", "run `ondevice-moe recipes list` to see the bundled recipes")
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise UserError(f"recipe {path} is {path.stat().st_size / 2**20:.1f} MiB; a recipe is at most "
                        f"{MAX_RECIPE_BYTES // 2**20} MiB", "pass the recipe itself: data goes in the files it names")
    try:
        raw = strict_yaml.load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise UserError(f"recipe {path} is not valid YAML: {error}", "fix the YAML syntax") from None
    except OSError as error:
        raise UserError(f"recipe {path} cannot be read ({error.strerror})", "check its permissions") from None
    if not isinstance(raw, dict):
        raise UserError(f"recipe {path} must be a mapping of keys to values", "see recipes/demo.yaml for the shape")
    for override in overrides or []:
        apply_override(raw, override)
    if seed is not None:
        raw["seed"] = seed
    plugins = raw.get("plugins")
    if isinstance(plugins, list):  # relative to the recipe; kept absolute in the run folder's copy
        raw["plugins"] = [str((path.parent / entry).resolve()) if isinstance(entry, str) else entry
                          for entry in plugins]
    return validate_recipe(raw, source=str(path))


def validate_recipe(raw: dict[str, Any], source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(raw)
    except ValidationError as error:
        raise UserError(_describe(error, source), "fix these keys in the recipe (or the --set overrides)") from None


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"{source} has {error.error_count()} problem(s):"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            parent = _fields_at(item["loc"][:-1])
            allowed = f"; valid keys here: {', '.join(parent)}" if parent else ""
            lines.append(f"  - {location}: unknown key{allowed}")
        else:
            message = item["msg"].removeprefix("Value error, ")
            got = f" (got {item.get('input')!r})" if item["loc"] else ""  # a whole-recipe problem: no echo
            lines.append(f"  - {location or 'recipe'}: {message}{got}")
    return "\n".join(lines)


def _fields_at(location: tuple) -> list[str]:
    """The field names of the section at ``location`` of a recipe."""
    model: Any = Recipe
    for part in location:
        if isinstance(part, int) or model is None:
            continue
        if part not in model.model_fields:
            return []
        model = _section_type(model.model_fields[part].annotation)
    return list(model.model_fields) if model is not None else []


def _section_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _section_type(argument)
        if found is not None:
            return found
    return None
