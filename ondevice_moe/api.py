"""The toolkit from Python: fine-tune a recipe, or put a mixture of experts on any model.

* :func:`finetune` does what ``ondevice-moe finetune`` does: every method of a recipe
  through Flower, the run folder and its report; it returns a :class:`FinetuneResult`.
* :func:`load_recipe` reads a recipe (a file, a bundled recipe's name, or a
  :class:`~ondevice_moe.recipe.Recipe`) with overrides, without running it.
* :func:`get_mixture_model` attaches the expert system (experts and routers, as a
  :class:`MixtureConfig` says) to a Hugging Face or torch model, for a training loop
  of your own, without federation.

``docs/api.md`` shows each with an example that runs.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.launch import find_recipe, set_run_environment
from ondevice_moe.layout import CLIENT_LEVEL_KINDS, Layout, attach_layout, sites_of
from ondevice_moe.methods.registry import method_spec

if TYPE_CHECKING:
    from ondevice_moe.experts.conv_lora import ConvForm
    from ondevice_moe.layout import Mixing, RoleName, RouterKind
    from ondevice_moe.recipe import Recipe
    from ondevice_moe.routing.routers import BalanceForm

OPTIONS_PREFIX = "method 'mixture': "  # how method_options starts its problems

Overrides = Mapping[str, Any] | Sequence[str]
"""Recipe overrides: ``{"federation.rounds": 5}`` (Python values), or the CLI's ``--set`` texts
``["federation.rounds=5"]`` (values parsed as YAML)."""


# -- recipes ------------------------------------------------------------------------------


def load_recipe(recipe: str | os.PathLike[str] | Recipe, overrides: Overrides | None = None,
                seed: int | None = None, *, trust_plugins: bool = False) -> Recipe:
    """Read and validate a recipe, with ``overrides`` and ``seed`` applied.

    ``recipe``: a YAML file, the name of a bundled recipe (``"demo"``, as in
    ``ondevice-moe recipes list``), or a :class:`~ondevice_moe.recipe.Recipe` to change.
    ``overrides``: keys to set, dotted as in ``--set`` (``"federation.rounds"``,
    ``"data.users.0.source"``), either as a mapping of keys to Python values or as
    ``"key=value"`` texts whose values are YAML. ``seed`` replaces the recipe's seed.
    ``trust_plugins``: let the method plug-in files the recipe names (``plugins:``) run their
    code, in this process and the workers it starts (``--trust-plugins``); without it such a
    recipe is refused.

    Any problem (a missing file, an unknown key, a bad value) is one
    :class:`~ondevice_moe.errors.UserError` that names it and says how to fix it.
    """
    import ondevice_moe.recipe as recipes

    if trust_plugins:
        from ondevice_moe.methods.plugins import trust_plugins as trust

        trust()
    texts = _override_texts(overrides)
    if isinstance(recipe, recipes.Recipe):
        if not texts and seed is None:
            return recipe
        from ondevice_moe.overrides import apply_override

        raw = recipe.model_dump(mode="json")
        for text in texts:
            apply_override(raw, text)
        if seed is not None:
            raw["seed"] = seed
        return recipes.validate_recipe(raw, source=f"recipe '{recipe.name}'")
    if not isinstance(recipe, str | os.PathLike):
        raise UserError(f"cannot read a recipe from a {type(recipe).__name__}",
                        "pass a YAML file's path, a bundled recipe's name (e.g. 'demo') or a Recipe")
    return recipes.load_recipe(find_recipe(Path(recipe)), texts, seed)


def _override_texts(overrides: Overrides | None) -> list[str]:
    """``overrides`` as the CLI's ``key=value`` texts (a mapping's values written as YAML)."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if not isinstance(overrides, Mapping):
        return [str(text) for text in overrides]
    texts = []
    for key, value in overrides.items():
        plain = os.fspath(value) if isinstance(value, os.PathLike) else value
        try:
            text = yaml.safe_dump(plain, default_flow_style=True, width=float("inf"))
        except yaml.YAMLError:
            raise UserError(f"override '{key}': {value!r} is not a value a recipe can hold",
                            "pass a str, number, bool, None, list or dict") from None
        texts.append(f"{key}={text.strip()}")  # a lone scalar's "..." (end of document) reads back alike
    return texts


@dataclass(frozen=True)
class FinetuneResult:
    """What :func:`finetune` leaves: the run folder (absolute), the recipe with the overrides and
    seed applied, and the results.

    ``summary`` is ``summary.json``: per method (``summary["methods"][name]``) the final
    value of every user (``per_user``) and their mean and std over users (``mean_in`` /
    ``mean_out`` test perplexity for language modelling, ``mean_score`` of the task's metric
    otherwise), with the bytes each device sent per round. ``report`` is ``report.md``.
    """

    run_dir: Path
    recipe: Recipe
    summary: dict[str, Any]
    report: Path

    @property
    def methods(self) -> list[str]:
        """The names of the methods that finished, as the report and ``export`` name them."""
        return list(self.summary["methods"])

    @property
    def metrics_file(self) -> Path:
        """``metrics.jsonl``: one JSON record per event (training, evaluation, bytes sent) of every round."""
        return self.run_dir / "metrics.jsonl"

    def records(self) -> list[dict[str, Any]]:
        """The records of ``metrics.jsonl``, in the order they were written."""
        from ondevice_moe.report import MetricsLog

        return MetricsLog(self.metrics_file).read()


def finetune(
    recipe: str | os.PathLike[str] | Recipe,
    overrides: Overrides | None = None,
    *,
    output: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    device: str | None = None,
    federation: str | None = None,
    on_method: Callable[[str, int, int], None] | None = None,
    on_round: Callable[[int, int, str], None] | None = None,
    trust_plugins: bool = False,
    overwrite: bool = False,
) -> FinetuneResult:
    """Fine-tune every method of a recipe through Flower and write the report, as
    ``ondevice-moe finetune`` does.

    ``recipe``, ``overrides``, ``seed`` and ``trust_plugins`` are read as by :func:`load_recipe`
    (``overrides`` are the CLI's ``--set``). ``output``: the run folder (default ``runs/<recipe name>``);
    running the same recipe into a folder again resumes it, keeping the methods that
    finished, and a folder of another recipe is refused unless ``overwrite`` (which also starts this
    recipe's run over), as ``--overwrite`` does once the inputs check out. ``device``: ``auto``, ``cpu`` or
    ``cuda`` (the recipe's ``model.device``). ``federation``: run on real devices, through
    the SuperLink of this name in Flower's connection config (docs/deployment.md);
    default: Flower's simulation on this machine. ``on_method(name, index, count)`` is
    called as each method starts and ``on_round(done, total, line)`` after each round.

    Like the CLI, this sets the environment the simulation wants (no Flower telemetry,
    quiet logs, idle threads that sleep) where the variables are not set already.
    Bad input is a :class:`~ondevice_moe.errors.UserError`, raised before anything trains;
    a method that fails does not stop the others, and is reported at the end as one
    :class:`~ondevice_moe.errors.UserError`.
    """
    from ondevice_moe.runner import run_recipe

    set_run_environment()
    texts = _override_texts(overrides)
    if device is not None:
        texts.append(f"model.device={device}")
    loaded = load_recipe(recipe, texts, seed, trust_plugins=trust_plugins)
    if federation is not None:
        _warn_if_insecure(federation)
    else:
        _warn_if_slow_bfloat16(loaded)
    result = run_recipe(loaded, Path(output) if output is not None else None, on_method, on_round, federation,
                        overwrite)
    return FinetuneResult(result.run_dir.resolve(), loaded, result.summary, result.report.resolve())


def _warn_if_slow_bfloat16(recipe: Recipe) -> None:
    """Warn when the recipe's bfloat16 base would run on a CPU that emulates bfloat16."""
    from ondevice_moe.models.devices import slow_bfloat16

    why = slow_bfloat16(recipe.model.dtype, recipe.model.device)
    if why:
        warnings.warn(why, UserWarning, stacklevel=3)


def _warn_if_insecure(federation: str) -> None:
    """Warn when Flower's config links to this SuperLink without encryption (``insecure = true``)."""
    from ondevice_moe.federation.submit import connection

    entry = connection(federation)
    if entry.get("insecure"):
        warnings.warn(f"the link to SuperLink '{federation}' ({entry['address']}) is insecure: shared experts and "
                      "metrics travel unencrypted; use TLS (root-certificates) and SuperNode authentication "
                      "(docs/deployment.md)", UserWarning, stacklevel=3)


# -- a mixture of experts on any model -------------------------------------------------------


# MixtureConfig's fields are options of the recipe's `mixture` method, with its defaults: one source for both.
_OPTIONS = method_spec("mixture").options.model_fields


# Options of the recipe's `mixture` method that shape its federated training, not the model.
_FEDERATION_ONLY = ("label", "routers_train", "router_data", "aggregation", "upload", "preconditioning")


@dataclass(frozen=True)
class MixtureConfig:
    """Which experts :func:`get_mixture_model` puts in a model, and how they are mixed.

    The fields are the options of the recipe's ``mixture`` method (docs/methods.md) that
    shape the model, with the same defaults; it is validated as that method's options are.

    **Experts** — ``experts``: one entry per routed expert, ``"kind"`` or ``"kind:role"``
    (``"lora"``, ``"adapter:private"``), or a mapping ``{"kind": ..., "role": ...}``.
    Kinds: ``lora``, ``adapter``, ``prefix`` (Hugging Face models), ``layers`` (adaptors on
    every layer, for ``mixing="every-layer"``, the one choice for a plain torch model).
    Roles: ``shared`` (default; what a federation averages) or ``private`` (what stays on a
    device): without federation the role only names the expert (``shared_0``, ``private_0``)
    and seeds it, private experts differently per ``user``. ``lora_rank``, ``lora_alpha``,
    ``rank_stabilised`` (scale ``alpha/sqrt(rank)``, else ``alpha/rank``), ``adapter_rank``
    and ``prefix_length`` size them; ``budget`` (the relative parameter budget of each
    adaptor), ``conv_lora``, ``bias`` and ``norm`` choose the adaptors of ``layers`` experts.

    **Where they sit** (``mixing``): ``"mlp"`` — each block's MLP becomes the exact
    router-weighted mixture of the experts, each a LoRA on every MLP linear layer or an
    adapter after the MLP (GPT-2: ``mlp.c_fc``, ``mlp.c_proj``; LLaMA: ``mlp.gate_proj``,
    ``up_proj``, ``down_proj``). ``"block"`` — one router per block on its input; a LoRA
    expert adapts the attention query and value projections (GPT-2 ``attn.c_attn``, LLaMA
    ``self_attn.q_proj``/``v_proj``, BERT and RoBERTa ``attention.self.query``/``value``), an
    adapter follows the feed-forward output, a prefix sits in attention; BERT and RoBERTa
    need it. ``"every-layer"`` — ``layers`` experts on every layer of the blocks (of a plain
    torch model, every layer), mixed per model by ``router="client-mixture"``.
    ``attention_lora`` adds one always-on LoRA of that role on every attention projection.

    **Router** — ``router``: ``"token-topk"`` (CoMiGS: a learned linear gate per token,
    top-``top_k`` softmax, a balance loss of form ``balance_form``), ``"hermes"`` (Hermes's
    dual-view router: ``temperature``, ``gamma``, ``bias_rate``, ``gradient_ema``),
    ``"sigmoid"`` (dense gates), ``"uniform"`` (fixed equal weights), ``"none"`` (every expert
    at weight 1) or ``"client-mixture"`` (FLoRAL: one learned mixture for the whole model).

    ``modules_to_save``: module paths of the model (e.g. ``("classifier",)``, a new task
    head) that are copied, not shared with the base, and trained whole beside the experts.

    A combination that cannot be built is a :class:`~ondevice_moe.errors.UserError` when
    the config is made, naming the field and the valid choices.
    """

    experts: Sequence[str | Mapping[str, str]]
    router: RouterKind = _OPTIONS["router"].default
    mixing: Mixing = _OPTIONS["mixing"].default
    top_k: int = _OPTIONS["top_k"].default
    attention_lora: RoleName | None = _OPTIONS["attention_lora"].default
    lora_rank: int = _OPTIONS["lora_rank"].default
    lora_alpha: float = _OPTIONS["lora_alpha"].default
    rank_stabilised: bool = _OPTIONS["rank_stabilised"].default
    adapter_rank: int = _OPTIONS["adapter_rank"].default
    prefix_length: int = _OPTIONS["prefix_length"].default
    balance_form: BalanceForm = _OPTIONS["balance_form"].default
    temperature: float = _OPTIONS["temperature"].default
    gamma: float = _OPTIONS["gamma"].default
    bias_rate: float = _OPTIONS["bias_rate"].default
    gradient_ema: float = _OPTIONS["gradient_ema"].default
    budget: float = _OPTIONS["budget"].default
    conv_lora: ConvForm | Literal["none"] = _OPTIONS["conv_lora"].default
    bias: bool = _OPTIONS["bias"].default
    norm: bool = _OPTIONS["norm"].default
    modules_to_save: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if isinstance(self.experts, str | Mapping):
            raise UserError(f"MixtureConfig: experts must be a list of experts, got {self.experts!r}",
                            f"write experts=[{self.experts!r}]")
        object.__setattr__(self, "experts", tuple(self.experts))
        object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))
        self.layout()  # a bad combination fails here, where it was written

    def layout(self) -> Layout:
        """The :class:`~ondevice_moe.layout.Layout` these options give: built by the recipe's
        ``mixture`` method from its options, so a recipe and a config with the same values
        make the same model."""
        from ondevice_moe.methods.base import MethodContext
        from ondevice_moe.methods.registry import build_method, method_options

        raw = {item.name: getattr(self, item.name) for item in dataclasses.fields(self)
               if item.name != "modules_to_save"}
        raw["experts"] = [_expert_entry(entry) for entry in self.experts]
        try:
            options = method_options("mixture", raw)
            return build_method("mixture", options, MethodContext(num_users=1)).layouts[0]
        except UserError as error:  # the option's problem, or the layout's (e.g. prefix experts in the MLP)
            option = error.problem.startswith(OPTIONS_PREFIX)
            raise UserError(f"MixtureConfig: {error.problem.removeprefix(OPTIONS_PREFIX)}",
                            "see MixtureConfig's fields (docs/api.md)" if option else error.fix) from None


def _expert_entry(entry: object) -> object:
    """``"kind"`` or ``"kind:role"`` as the ``mixture`` method's expert entry; anything else as given."""
    if isinstance(entry, str):
        kind, _, role = entry.partition(":")
        return {"kind": kind, "role": role} if role else {"kind": kind}
    return entry


def get_mixture_model(model: nn.Module, config: MixtureConfig | Layout, *, seed: int = 0, user: int = 0
                      ) -> nn.Module:
    """``model`` with the experts and routers of ``config`` attached, ready for a training loop.

    Like PEFT's ``get_peft_model``: the returned model shares its base weights with
    ``model`` and freezes them, so only the experts, the routers and ``modules_to_save``
    train (``[p for p in m.parameters() if p.requires_grad]`` is what to optimise). The
    experts start as the federation starts them, from ``seed`` (and ``user``, for private
    experts): a new LoRA or adapter adds nothing, so the model first computes what ``model``
    does. ``model``: a GPT-2, LLaMA, BERT or RoBERTa model of ``transformers`` (any head),
    or, with ``mixing="every-layer"``, any torch module (an ``nn.Sequential`` comes back as
    a :class:`SequentialHost`, its layers under ``net``). ``config`` may also be a
    :class:`~ondevice_moe.layout.Layout`, as the toolkit's methods build them.

    A ``token-topk`` router adds a balance term to minimise beside the task's loss
    (``ondevice_moe.layout.total_balance_loss(m)`` after each forward pass); a ``hermes``
    router learns from ``after_backward()`` after each backward pass and ``after_step()`` after each
    step, called on each of ``ondevice_moe.routing.lifecycle.round_aware(m)``.
    A model or config that does not fit is a :class:`~ondevice_moe.errors.UserError`.
    """
    if not isinstance(model, nn.Module):
        raise UserError(f"get_mixture_model needs a torch model (nn.Module), got a {type(model).__name__}",
                        "pass e.g. AutoModelForCausalLM.from_pretrained(...)")
    layout = config.layout() if isinstance(config, MixtureConfig) else config
    if not isinstance(layout, Layout):
        raise UserError(f"get_mixture_model needs a MixtureConfig, got a {type(config).__name__}",
                        "pass MixtureConfig(experts=[...], ...)")
    save = config.modules_to_save if isinstance(config, MixtureConfig) else ()
    if next(model.parameters(), None) is None:
        raise UserError(f"{type(model).__name__} has no parameters to put experts beside", "pass a trained model")
    names = dict(model.named_modules())
    missing = [path for path in save if path not in names or not path]
    if missing:
        heads = [name for name in names if name.rpartition(".")[2] in ("classifier", "score", "pooler", "lm_head")]
        raise UserError(f"modules_to_save {missing} are not modules of this {type(model).__name__}",
                        f"name module paths of the model, e.g. {heads or list(names)[1:4]}")
    if layout.mixing not in CLIENT_LEVEL_KINDS and layout.mixing != "layer-copies":
        sites_of(model)  # a model without expert sites fails before anything is frozen
    if isinstance(model, nn.Sequential):  # it would run a router set beside its layers as one more layer
        model = SequentialHost(model)
        save = tuple(f"net.{path}" for path in save)
    adapted = attach_layout(model, layout, seed=seed, user=user, own=save)
    for path in save:
        adapted.get_submodule(path).requires_grad_(True)
    return adapted


class SequentialHost(nn.Module):
    """An ``nn.Sequential`` as ``net``, so that a router can sit beside its layers (the
    Sequential itself would run every module set on it as a layer)."""

    def __init__(self, net: nn.Sequential) -> None:
        super().__init__()
        self.net = net

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.net(*args, **kwargs)
