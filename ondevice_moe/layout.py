"""One expert system: which experts (kind, role) sit where in a model, under which router.

A :class:`Layout` lists a device's *routed experts* — each a kind
(``lora``, ``adapter``, ``prefix``) and a role (``shared``: aggregated by the
server; ``private``: never leaves the device) — the *router* that mixes them,
and where the mixing happens:

* ``mixing="mlp"`` — CoMiGS §2 / App. B.1.2: the router reads the MLP input
  and the block's MLP output is ``Σ_j w_j E_j(x)``, each expert being the MLP
  with its own LoRA on every MLP linear layer, or the MLP followed by its own
  bottleneck adapter. :class:`~ondevice_moe.mixture.MixtureMLP` computes it
  exactly, running the frozen MLP once.
* ``mixing="block"`` — Hermes §4.2: the router reads the block input (eq. 4)
  and each expert adds its residual where it naturally sits, scaled by the
  token's weight for it (eq. 9): LoRA on the attention query and value
  projections, an adapter after the FFN, a prefix inside attention (one
  gated SDPA call, :mod:`ondevice_moe.experts.prefix`).
* ``mixing="every-layer"`` — FLoRAL §3.2 and §5 (FML): each expert (kind
  ``layers``) is a set of adaptors on every layer of the model (inside the
  transformer blocks of a Hugging Face model) — LoRA on Linear, ConvLoRA on
  Conv2d, bias and norm adaptors, as ``adaptor_kinds`` says — and every layer
  adds ``Σ_c π_c · adaptor_c``, ``π`` being the client's mixture
  (router ``client-mixture``, one vector per device).
* ``mixing="ensemble"`` — FLoRAL's Ensemble baseline (Tables 1, 3): each
  expert (kind ``model``) is a whole copy of a small model, and the output is
  ``Σ_c π_c f_c(x)``.
* ``mixing="layer-copies"`` — Flow §3 (eq. 2–3): every Linear and Conv2d layer of a small
  model is routed between its global self (shared) and one private copy (kind
  ``layer-copy``, :class:`~ondevice_moe.experts.layer_copy.RoutedLayer`), per instance,
  by the policy network ψ (router ``instance-policy``, one exit per routed layer). On a
  Hugging Face model the copies are PEFT experts: a global (``shared_0``) and a local
  (``private_0``) LoRA on each block's routed projections, one exit per block, plus
  copies of the task head's Linear layers.

Independently of the routed experts, ``attention_lora`` puts one always-on
LoRA of the given role on every attention projection (CoMiGS App. B.1.2).

Parameter names carry the expert's name, ``<role>_<i>`` (``shared_0``,
``private_1``; the attention LoRA is plainly ``shared`` or ``private``), and
``router`` for routers, so roles follow from names alone
(:meth:`ondevice_moe.methods.base.Method.role_of`).

:func:`attach_layout` returns a *new* module tree that shares the frozen base
weights with the model it was given, so one process can hold several layouts
(e.g. CoMiGS-1GXs users with different expert counts) over one base model.
"""

from __future__ import annotations

import copy
import math
import zlib
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from ondevice_moe.errors import UserError
from ondevice_moe.experts import LoRA, LoRAAdaptedLinear, linear_features
from ondevice_moe.experts.adapter import Adapter, AdapterAfter
from ondevice_moe.experts.layer import AdaptedLayer, AdaptorKinds, LayerAdaptor, layer_adaptor
from ondevice_moe.experts.layer_copy import RoutedLayer
from ondevice_moe.experts.lora import gated
from ondevice_moe.experts.prefix import Prefix, register_prefix_attention
from ondevice_moe.mixture import MixedForward, MixtureMLP, gpt2_mixed_forward, llama_mixed_forward
from ondevice_moe.routing import ClientMixtureRouter, ClientRouter, TokenTopKRouter, UniformRouter
from ondevice_moe.routing.block import BlockRouter, route_block_input
from ondevice_moe.routing.hermes import HermesRouter
from ondevice_moe.routing.instance_policy import GLOBAL, LOCAL, InstancePolicyRouter, SequenceRepresentation
from ondevice_moe.routing.routers import BalanceForm

ExpertKind = Literal["lora", "adapter", "prefix", "layers", "model", "layer-copy"]
RoleName = Literal["shared", "private"]
RouterKind = Literal["none", "uniform", "token-topk", "hermes", "sigmoid", "client", "client-mixture",
                     "instance-policy"]
Mixing = Literal["mlp", "block", "every-layer", "ensemble", "layer-copies"]

EXPERT_KINDS: tuple[str, ...] = ("lora", "adapter", "prefix", "layers", "model", "layer-copy")
ROUTER_KINDS: tuple[str, ...] = ("none", "uniform", "token-topk", "hermes", "sigmoid", "client", "client-mixture",
                                 "instance-policy")
CLIENT_LEVEL_KINDS = {"every-layer": "layers", "ensemble": "model"}


# -- where experts go, per architecture ------------------------------------------


@dataclass(frozen=True)
class Sites:
    """Module paths of one model family, relative to a transformer block.

    ``attention_linears``: every attention projection (the always-on attention
    LoRA); ``routed_lora``: the projections a routed LoRA expert adapts under
    block mixing (Hermes: query and value); ``mlp`` / ``mlp_linears`` /
    ``mixed_forward``: the MLP and its exact mixture (``None`` where the
    architecture has no separable MLP module); ``ffn_output``: where adapter
    experts attach under block mixing.
    """

    blocks: tuple[str, ...]
    attention: str
    attention_linears: tuple[str, ...]
    routed_lora: tuple[str, ...]
    ffn_output: str
    mlp: str | None = None
    mlp_linears: tuple[str, ...] = ()
    mixed_forward: MixedForward | None = None


_BERT_LIKE = {
    "attention": "attention.self",
    "attention_linears": ("attention.self.query", "attention.self.key", "attention.self.value",
                          "attention.output.dense"),
    "routed_lora": ("attention.self.query", "attention.self.value"),
    "ffn_output": "output.dense",
}
SITES: dict[str, Sites] = {
    "gpt2": Sites(("transformer.h",), "attn", ("attn.c_attn", "attn.c_proj"), ("attn.c_attn",), "mlp",
                  "mlp", ("c_fc", "c_proj"), gpt2_mixed_forward),
    "llama": Sites(("model.layers",), "self_attn",
                   ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
                   ("self_attn.q_proj", "self_attn.v_proj"), "mlp",
                   "mlp", ("gate_proj", "up_proj", "down_proj"), llama_mixed_forward),
    "bert": Sites(("bert.encoder.layer", "encoder.layer"), **_BERT_LIKE),
    "roberta": Sites(("roberta.encoder.layer", "encoder.layer"), **_BERT_LIKE),
}


def sites_of(model: nn.Module) -> tuple[Sites, nn.ModuleList]:
    """The sites of ``model``'s architecture and its list of transformer blocks."""
    config = getattr(model, "config", None)
    if config is None:
        raise UserError(f"{type(model).__name__} is a small model without transformer blocks",
                        "put experts on its layers with `mixing: every-layer` (kind `layers`), or use "
                        "a GPT-2, LLaMA, BERT or RoBERTa model")
    model_type = getattr(config, "model_type", None)
    sites = SITES.get(model_type)
    if sites is None:
        raise UserError(f"model type {model_type!r} has no expert sites", f"use one of {sorted(SITES)}")
    for path in sites.blocks:
        try:
            return sites, model.get_submodule(path)
        except AttributeError:
            continue
    raise UserError(f"cannot find the transformer blocks of this {model_type} model", "load it with a standard class")


# -- the layout ---------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertSpec:
    """One routed expert: its kind, its role and, for a LoRA expert, its own rank
    (default: the layout's ``sizes.lora_rank``; HetLoRA and FlexLoRA give devices
    different ranks)."""

    kind: ExpertKind
    role: RoleName
    rank: int | None = None


@dataclass(frozen=True)
class RouterSpec:
    """How a site's experts mix.

    ``none``: every expert always on at weight 1 (single-PEFT baselines);
    ``uniform``: fixed equal weights; ``token-topk``: CoMiGS's linear gate,
    softmax, top-k renormalised, with a balance loss (``balance`` form, eq. 6–7);
    ``hermes``: the dual-view router of Hermes eq. (4)–(8) (``use_feature`` /
    ``use_gradient`` switch views off for the ablations); ``sigmoid``:
    FedUniPELT's dense sigmoid gates; ``client``: one weight per expert for the
    whole device, set by the method (FDLoRA); ``client-mixture``: FLoRAL's learned
    ``π = softmax(θ)`` for the whole device, or the one-hot ``π*`` on expert ``optimal``;
    ``instance-policy``: Flow's ψ (eq. 2), ``policy_hidden`` units per base layer, and with
    ``interpolation`` APFL's private α starting there; ``noise``: the uniform noise a
    ``client-mixture`` router adds to θ in training (the FLoRAL authors' code; 0 is Alg. 1).
    """

    kind: RouterKind = "token-topk"
    top_k: int = 2
    balance: BalanceForm = "uniform"
    temperature: float = 0.1
    gamma: float = 0.5
    bias_rate: float = 0.05
    gradient_ema: float = 0.9
    use_feature: bool = True
    use_gradient: bool = True
    optimal: int | None = None
    policy_hidden: int = 64
    interpolation: float | None = None
    noise: float = 0.0


@dataclass(frozen=True)
class ExpertSizes:
    """Hyper-parameters of the expert kinds (CoMiGS App. B.1.2; Hermes §5.1)."""

    lora_rank: int = 8
    lora_alpha: float = 16.0
    rank_stabilised: bool = True  # CoMiGS eq. (5) γ = α/√r; False gives Hu et al.'s α/r (Hermes)
    adapter_rank: int = 16
    prefix_length: int = 16


@dataclass(frozen=True)
class Layout:
    """What one device holds at every block (see the module docstring)."""

    experts: tuple[ExpertSpec, ...] = ()
    router: RouterSpec = field(default_factory=RouterSpec)
    mixing: Mixing = "mlp"
    attention_lora: RoleName | None = None
    sizes: ExpertSizes = field(default_factory=ExpertSizes)
    adaptor_kinds: AdaptorKinds = field(default_factory=AdaptorKinds)

    def __post_init__(self) -> None:
        kinds = [e.kind for e in self.experts]
        unknown = sorted(set(kinds) - set(EXPERT_KINDS))
        if unknown:
            raise UserError(f"unknown expert kind(s) {unknown}", f"use some of {list(EXPERT_KINDS)}")
        if (self.mixing == "layer-copies") != ("layer-copy" in kinds) or (
                self.mixing == "layer-copies" and (self.experts != (ExpertSpec("layer-copy", "private"),)
                                                   or self.router.kind != "instance-policy")):
            raise UserError(f"mixing '{self.mixing}' with experts {kinds} under router '{self.router.kind}'",
                            "Flow's layout is mixing layer-copies, one private layer-copy expert, router "
                            "instance-policy; the other mixings take no layer-copy experts")
        client_kind = CLIENT_LEVEL_KINDS.get(self.mixing)
        if (client_kind is not None and set(kinds) != {client_kind}) or \
                (client_kind is None and set(kinds) & set(CLIENT_LEVEL_KINDS.values())):
            raise UserError(f"mixing '{self.mixing}' cannot hold experts of kinds {sorted(set(kinds))}",
                            "every-layer mixing takes `layers` experts, ensemble mixing `model` experts, "
                            "and the other mixings the PEFT kinds")
        if client_kind is not None and self.router.kind not in ("client-mixture", "none"):
            raise UserError(f"mixing '{self.mixing}' mixes experts per client, not with router "
                            f"'{self.router.kind}'", "use router client-mixture (or none for one expert)")
        # A token top-k router takes min(k, n) experts (CoMiGS-1GXs devices hold 1 to n);
        # Hermes's k is a choice of the method (Fig. 3a), so a k above n is a mistake.
        if self.router.kind == "hermes" and self.experts and not 1 <= self.router.top_k <= len(self.experts):
            raise UserError(
                f"top_k = {self.router.top_k} but each block holds {len(self.experts)} expert(s) {kinds}",
                f"set top_k between 1 and {len(self.experts)}",
            )
        if self.mixing == "mlp" and "prefix" in kinds:
            raise UserError("prefix experts sit inside attention, not in the MLP mixture",
                            "use `mixing: block` for layouts with prefix experts")
        if self.mixing == "mlp" and self.router.kind in ("none", "sigmoid") and len(self.experts) > 1:
            raise UserError(f"the exact MLP mixture needs weights that sum to one; router '{self.router.kind}' "
                            "does not give them", "use router uniform, token-topk or hermes, or `mixing: block`")

    @property
    def expert_names(self) -> list[str]:
        """``<role>_<i>``, numbered within each role in layout order."""
        counts = {"shared": 0, "private": 0}
        names = []
        for expert in self.experts:
            names.append(f"{expert.role}_{counts[expert.role]}")
            counts[expert.role] += 1
        return names

    @property
    def uses_prefix(self) -> bool:
        return any(e.kind == "prefix" for e in self.experts)


def lora_experts(roles: tuple[RoleName, ...]) -> tuple[ExpertSpec, ...]:
    """LoRA experts of the given roles, in order."""
    return tuple(ExpertSpec("lora", role) for role in roles)


# -- attaching a layout ---------------------------------------------------------------


def expert_generator(seed: int, *parts: object) -> torch.Generator:
    """A generator whose seed depends only on ``seed`` and the expert's identity."""
    key = ":".join(str(p) for p in (seed, *parts))
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def _under(name: str, paths: tuple[str, ...]) -> bool:
    """Whether the module or parameter ``name`` is one of ``paths`` or inside one."""
    return any(name == path or name.startswith(path + ".") for path in paths)


def frozen_copy(base_model: nn.Module, own: tuple[str, ...] = ()) -> nn.Module:
    """A structural copy of ``base_model`` that shares its frozen weights.

    Parameters under the module paths in ``own`` (e.g. a classification head
    that each device trains) are copied instead, so training them never
    touches the shared base. Every parameter of the copy starts frozen.
    """
    shared: dict[int, object] = {
        id(tensor): tensor
        for name, tensor in (*base_model.named_parameters(), *base_model.named_buffers())
        if not _under(name, own)
    }
    shared.update(_int8_states(base_model))
    model = copy.deepcopy(base_model, memo=shared)
    model.requires_grad_(False)
    return model


def _int8_states(model: nn.Module) -> dict[int, object]:
    """The ``state`` of every bitsandbytes int8 layer, to be shared by all copies.

    The first forward of a ``Linear8bitLt`` moves the quantized weight (``weight.CB``,
    ``weight.SCB``) into its own ``state`` and clears it on the weight. The weight is shared
    between copies, so a copy with a state of its own would leave every later copy with
    neither, and they would multiply by the int8 codes as if they were values.
    """
    return {id(module.state): module.state for module in model.modules() if type(module).__name__ == "Linear8bitLt"}


def attach_layout(base_model: nn.Module, layout: Layout, *, seed: int, user: int = 0,
                  own: tuple[str, ...] = ()) -> nn.Module:
    """A copy of ``base_model`` (sharing its frozen weights, except the modules in
    ``own``) with ``layout``'s experts and routers in every block.

    Shared experts start identical on every device (their initialisation
    depends on the seed and the expert's place only); private experts differ per ``user``.
    """
    model = frozen_copy(base_model, own)
    device = next(base_model.parameters()).device
    if layout.mixing == "layer-copies":
        _attach_layer_copies(model, layout, _ExpertBuilder(layout, getattr(model, "config", None), seed, user), own)
        _move_experts(model, device)
        return model
    if layout.mixing in CLIENT_LEVEL_KINDS:
        _attach_client_mixture(model, layout, _ExpertBuilder(layout, getattr(model, "config", None), seed, user), own)
        _move_experts(model, device)
        return model
    sites, blocks = sites_of(model)
    if layout.uses_prefix:
        _use_prefix_attention(model)
    builder = _ExpertBuilder(layout, model.config, seed, user)
    for index, block in enumerate(blocks):
        if layout.attention_lora is not None:
            for path in sites.attention_linears:
                _add_residual(block, path, layout.attention_lora,
                              builder.lora(block, path, index, layout.attention_lora), None, LoRAAdaptedLinear)
        if not layout.experts:
            continue
        if layout.mixing == "mlp":
            _attach_mlp_mixture(block, sites, layout, builder, index, model.config.hidden_size)
        else:
            _attach_block_mixture(block, sites, layout, builder, index, model.config)
    _move_experts(model, device)
    return model


def _move_experts(model: nn.Module, device: torch.device) -> None:
    """Put experts and routers where the base runs (they are built on the CPU from seeded generators)."""
    if device.type == "cpu":
        return
    for module in model.modules():
        if isinstance(module, LoRA | Adapter | Prefix | BlockRouter | HermesRouter | TokenTopKRouter | ClientRouter
                      | LayerAdaptor | ClientMixtureRouter | EnsembleNet | RoutedLayer | InstancePolicyRouter):
            module.to(device)


@dataclass
class _ExpertBuilder:
    """Makes expert modules with reproducible initialisations."""

    layout: Layout
    config: object
    seed: int
    user: int

    def _generator(self, index: int, where: str, name: str) -> torch.Generator:
        parts: tuple[object, ...] = (name,) if name.startswith("shared") else (name, "user", self.user)
        return expert_generator(self.seed, index, where, *parts)

    def router_generator(self, index: int) -> torch.Generator:
        """The router of block ``index`` starts the same on every device (shared routers need it)."""
        return expert_generator(self.seed, index, "router")

    def lora(self, block: nn.Module, path: str, index: int, name: str, rank: int | None = None) -> LoRA:
        sizes = self.layout.sizes
        layer = block.get_submodule(path)
        base = layer.base if isinstance(layer, LoRAAdaptedLinear) else layer
        return LoRA(*linear_features(base), rank or sizes.lora_rank, sizes.lora_alpha,
                    self._generator(index, path, name), rank_stabilised=sizes.rank_stabilised)

    def adapter(self, index: int, where: str, name: str) -> Adapter:
        return Adapter(self.config.hidden_size, self.layout.sizes.adapter_rank, self._generator(index, where, name))

    def prefix(self, index: int, name: str) -> Prefix:
        config = self.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return Prefix(heads, self.layout.sizes.prefix_length, head_dim, self._generator(index, "prefix", name))


def _add_residual(block: nn.Module, path: str, name: str, expert: nn.Module, gate,
                  site: type[LoRAAdaptedLinear | AdapterAfter]) -> None:
    """Attach ``expert`` under ``name`` to the module at ``path``, wrapping that module in ``site``
    (a LoRA-adapted linear layer, or a sublayer followed by adapters) the first time."""
    parent_path, _, leaf = path.rpartition(".")
    parent = block.get_submodule(parent_path) if parent_path else block
    layer = getattr(parent, leaf)
    if not isinstance(layer, site):
        layer = site(layer, {})
        setattr(parent, leaf, layer)
    layer.add(name, expert, gate)


def _make_router(layout: Layout, hidden_size: int, generator: torch.Generator) -> nn.Module:
    spec, names = layout.router, layout.expert_names
    if spec.kind in ("hermes", "sigmoid"):
        return HermesRouter(hidden_size, tuple(names), min(spec.top_k, len(names)) if spec.kind == "hermes"
                            else len(names), spec.temperature, spec.gamma, spec.bias_rate, spec.gradient_ema,
                            spec.use_feature, spec.use_gradient, "sigmoid" if spec.kind == "sigmoid" else "hermes",
                            generator)
    if spec.kind == "client":
        return ClientRouter(len(names))
    if spec.kind == "token-topk" and len(names) > 1:
        return TokenTopKRouter(hidden_size, len(names), min(spec.top_k, len(names)), spec.balance, generator)
    return UniformRouter(len(names))


def _attach_mlp_mixture(block: nn.Module, sites: Sites, layout: Layout, builder: _ExpertBuilder, index: int,
                        hidden_size: int) -> None:
    """CoMiGS: the block's MLP becomes an exact router-weighted mixture of expert MLPs."""
    if sites.mlp is None or sites.mixed_forward is None:
        raise UserError("this architecture has no separable MLP for the exact CoMiGS mixture",
                        "use `mixing: block` (experts gated where they sit) on BERT/RoBERTa")
    mlp = block.get_submodule(sites.mlp)
    experts: dict[str, nn.Module] = {}
    for spec, name in zip(layout.experts, layout.expert_names, strict=True):
        if spec.kind == "adapter":
            experts[name] = builder.adapter(index, sites.mlp, name)
        else:
            experts[name] = nn.ModuleDict({
                linear: builder.lora(mlp, linear, index, name, spec.rank) for linear in sites.mlp_linears})
    router = _make_router(layout, hidden_size, builder.router_generator(index))
    _register_expert_params(router, experts)
    setattr(block, sites.mlp, MixtureMLP(mlp, experts, router, sites.mixed_forward))


def _attach_block_mixture(block: nn.Module, sites: Sites, layout: Layout, builder: _ExpertBuilder, index: int,
                          config) -> None:
    """Hermes: one router per block on its input; each expert's residual gated where it sits."""
    names = layout.expert_names
    router = (BlockRouter(_make_router(layout, config.hidden_size, builder.router_generator(index)), names)
              if layout.router.kind != "none" else None)
    expert_params: dict[str, list[nn.Parameter]] = {}
    for spec, name in zip(layout.experts, names, strict=True):
        gate = router.gate(name) if router is not None else None
        modules: list[nn.Module] = []
        if spec.kind == "lora":
            for path in sites.routed_lora:
                lora = builder.lora(block, path, index, name, spec.rank)
                _add_residual(block, path, name, lora, gate, LoRAAdaptedLinear)
                modules.append(lora)
        elif spec.kind == "adapter":
            adapter = builder.adapter(index, sites.ffn_output, name)
            _add_residual(block, sites.ffn_output, name, adapter, gate, AdapterAfter)
            modules.append(adapter)
        else:
            attention = block.get_submodule(sites.attention)
            if not hasattr(attention, "prefix"):
                attention.prefix = nn.ModuleDict()
                attention.prefix_gates = {}
            prefix = builder.prefix(index, name)
            attention.prefix[name] = prefix
            if gate is not None:
                attention.prefix_gates[name] = gate
            modules.append(prefix)
        expert_params[name] = [p for module in modules for p in module.parameters()]
    if router is not None:
        block.router = router
        if isinstance(router.router, HermesRouter):
            router.router.expert_params = expert_params
        block.register_forward_pre_hook(route_block_input, with_kwargs=True)


def _attach_client_mixture(model: nn.Module, layout: Layout, builder: _ExpertBuilder, own: tuple[str, ...]) -> None:
    """FLoRAL: one client-level router (``model.router``, private) and, per expert, adaptors on
    every layer (``every-layer``; of a Hugging Face model, every layer of its blocks and of the
    task head ``own``) or a whole copy of the network (``ensemble``)."""
    names = layout.expert_names
    spec = layout.router
    router = ClientMixtureRouter(len(names), spec.optimal, spec.noise) if spec.kind == "client-mixture" else None
    gates = [router.gate(i) if router is not None else _always_on for i in range(len(names))]
    if router is not None:
        model.router = router
        model.register_forward_pre_hook(router.resample)
    if layout.mixing == "ensemble":
        net = getattr(model, "net", None)
        if not isinstance(net, nn.Module) or hasattr(model, "config"):
            raise UserError("an ensemble of whole models is built for the small models (linear, mlp, cnn)",
                            "use every-layer adaptors on Hugging Face models")
        model.net = EnsembleNet({name: _fresh_copy(net, builder, name) for name in names}, gates)
        return
    for path, layer in _adaptable_layers(model, own):
        adapted = None
        kinds = layout.adaptor_kinds
        rank = kinds.head_rank if _under(path, own) else None
        for name, gate in zip(names, gates, strict=True):
            adaptor = layer_adaptor(layer, kinds, builder._generator(0, path, name), rank)
            if adaptor is None:
                break
            if adapted is None:
                adapted = AdaptedLayer(layer)
                parent, _, leaf = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, adapted)
            adapted.add(name, adaptor, gate)


def _attach_layer_copies(model: nn.Module, layout: Layout, builder: _ExpertBuilder, own: tuple[str, ...]) -> None:
    """Flow: ψ (``model.router``, shared, the same on every device) and a global/local pair for
    every routed layer, layer ``j`` read by exit ``j`` (eq. 2–3).

    A small model: every Linear and Conv2d layer becomes a :class:`RoutedLayer` (the layer and a
    private copy); ψ reads the network's flattened input. A Hugging Face model: each block's
    routed projections (query and value) get a global LoRA expert (``shared_0``) and a local
    one (``private_0``) under one exit per block, and every Linear layer of the task head
    ``own`` (pooler, classifier) becomes a :class:`RoutedLayer`; ψ reads the mean input
    embedding (:class:`SequenceRepresentation`)."""
    if hasattr(model, "config"):
        _attach_lora_copies(model, layout, builder, own)
        return
    net = getattr(model, "net", None)
    input_shape = getattr(model, "input_shape", ())
    if not isinstance(net, nn.Module) or not input_shape:
        raise UserError("Flow's global and local layer copies are built for the small models (linear, mlp, cnn) "
                        "and for Hugging Face models with expert sites",
                        "use model.name mlp, cnn or linear, or a GPT-2, LLaMA, BERT or RoBERTa model")
    paths = [path for path, layer in _adaptable_layers(model) if isinstance(layer, nn.Linear | nn.Conv2d)]
    router = InstancePolicyRouter(math.prod(input_shape), len(paths), layout.router.policy_hidden,
                                  _policy_generator(builder.seed), interpolation=layout.router.interpolation)
    model.router = router
    for index, path in enumerate(paths):
        _route_layer_copy(model, path, router, index)
    net.register_forward_pre_hook(router.before_network)


def _attach_lora_copies(model: nn.Module, layout: Layout, builder: _ExpertBuilder, own: tuple[str, ...]) -> None:
    """Flow on a Hugging Face model (see :func:`_attach_layer_copies`)."""
    sites, blocks = sites_of(model)
    head = [path for path, layer in _adaptable_layers(model, own)
            if isinstance(layer, nn.Linear) and _under(path, own)]
    # A language model (no task head) predicts its own tokens: each position is routed on its context only.
    representation = SequenceRepresentation(model.get_input_embeddings(), causal=not own)
    router = InstancePolicyRouter(model.config.hidden_size, len(blocks) + len(head), layout.router.policy_hidden,
                                  _policy_generator(builder.seed), representation, layout.router.interpolation)
    model.router = router
    for index, block in enumerate(blocks):
        for path in sites.routed_lora:
            copies = []
            for name, copy_index in (("shared_0", GLOBAL), ("private_0", LOCAL)):
                lora = builder.lora(block, path, index, name)
                _add_residual(block, path, name, lora, router.copy_gate(index, copy_index), LoRAAdaptedLinear)
                copies.append(lora)
            router.pairs.append((copies[0], copies[1]))
    for offset, path in enumerate(head):
        _route_layer_copy(model, path, router, len(blocks) + offset)
    model.register_forward_pre_hook(router.before_model, with_kwargs=True)


def _policy_generator(seed: int) -> torch.Generator:
    """ψ starts the same on every device: it is shared."""
    return expert_generator(seed, "policy", "router")


def _route_layer_copy(model: nn.Module, path: str, router: InstancePolicyRouter, index: int) -> None:
    """Replace the layer at ``path`` by a global and a private copy of it under exit ``index``,
    both trainable. Both are the device's own tensors: the frozen copy of the model shares
    its weights with the base every device starts from."""
    parent, _, leaf = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    routed = RoutedLayer(copy.deepcopy(getattr(owner, leaf)), router.gate(index)).requires_grad_(True)
    setattr(owner, leaf, routed)
    router.pairs.append((routed.base, routed.local))


def _always_on() -> None:
    """No gate: the expert is always on (a tensor made here would sit on torch's default device)."""
    return None


def _adaptable_layers(model: nn.Module, own: tuple[str, ...] = ()) -> list[tuple[str, nn.Module]]:
    """The layers FLoRAL adapts, with their paths: every leaf layer of a small model; of a Hugging
    Face model, those inside its transformer blocks and its task head ``own`` (the embeddings and
    the language-model head keep their weights)."""
    if hasattr(model, "config"):
        _, blocks = sites_of(model)
        prefix = next(name for name, module in model.named_modules() if module is blocks)
        scope = [(name, module) for name, module in model.named_modules()
                 if name.startswith(prefix + ".") or _under(name, own)]
    else:
        scope = [(name, module) for name, module in model.named_modules() if name]
    return [(path, module) for path, module in scope if not list(module.children())]


def _fresh_copy(net: nn.Module, builder: _ExpertBuilder, name: str) -> nn.Module:
    """A copy of ``net`` re-initialised from the seed and the expert's name (the same on every
    device for a shared expert), trainable."""
    copy_ = copy.deepcopy(net)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(builder._generator(0, "ensemble", name).initial_seed()))
        for module in copy_.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return copy_.requires_grad_(True)


class EnsembleNet(nn.Module):
    """FLoRAL's Ensemble baseline: ``Σ_c π_c f_c(x)`` over whole copies ``f_c`` of a network."""

    def __init__(self, experts: dict[str, nn.Module], gates: list) -> None:
        super().__init__()
        self.experts = nn.ModuleDict(experts)
        self.gates = gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(gated(gate(), expert(x)) for gate, expert in zip(self.gates, self.experts.values(), strict=True))


def _register_expert_params(router: nn.Module, experts: dict[str, nn.Module]) -> None:
    if isinstance(router, HermesRouter):
        router.expert_params = {name: list(expert.parameters()) for name, expert in experts.items()}


def _use_prefix_attention(model: nn.Module) -> None:
    name = register_prefix_attention()
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError) as error:
        raise UserError(
            f"prefix experts need a model whose attention takes registered attention functions; "
            f"{type(model).__name__} does not ({error})",
            "drop `prefix` from the expert kinds, or use a BERT/RoBERTa, GPT-2 or LLaMA model",
        ) from None


# -- finding things in an adapted model ------------------------------------------------


def routing_sites(model: nn.Module) -> list[MixtureMLP | BlockRouter]:
    """The model's routing sites (MLP mixtures and block routers), in depth order."""
    return [m for m in model.modules() if isinstance(m, MixtureMLP | BlockRouter)]


def total_balance_loss(model: nn.Module) -> torch.Tensor | None:
    """Mean balance term over the model's routing sites after a forward pass."""
    losses = [s.last_balance_loss for s in routing_sites(model) if s.last_balance_loss is not None]
    return torch.stack(losses).mean() if losses else None
