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

The package: :mod:`.spec` (what a layout is), :mod:`.sites` (where experts go per architecture),
:mod:`.building` (the frozen copy and seeded experts), :mod:`.routers` (a factory per router kind),
one module per mixing (:mod:`.mlp_mixture`, :mod:`.block_mixture`, :mod:`.client_mixture`,
:mod:`.layer_copies`) and :mod:`.attach` (the table of mixings and :func:`attach_layout`).
"""

from __future__ import annotations

from ondevice_moe.layout.attach import MIXINGS, attach_layout, routing_sites, total_balance_loss
from ondevice_moe.layout.building import expert_generator, frozen_copy
from ondevice_moe.layout.routers import ROUTERS
from ondevice_moe.layout.sites import SITES, Sites, sites_of
from ondevice_moe.layout.spec import (
    CLIENT_LEVEL_KINDS,
    EXPERT_KINDS,
    ROUTER_KINDS,
    ExpertKind,
    ExpertSizes,
    ExpertSpec,
    Layout,
    Mixing,
    RoleName,
    RouterKind,
    RouterSpec,
    lora_experts,
)

__all__ = [
    "CLIENT_LEVEL_KINDS", "EXPERT_KINDS", "MIXINGS", "ROUTERS", "ROUTER_KINDS", "SITES", "ExpertKind", "ExpertSizes",
    "ExpertSpec", "Layout", "Mixing", "RoleName", "RouterKind", "RouterSpec", "Sites", "attach_layout",
    "expert_generator", "frozen_copy", "lora_experts", "routing_sites", "sites_of", "total_balance_loss",
]
