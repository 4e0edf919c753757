"""Every method of the harness, by name: its options schema and its builder.

A built-in method is its folder under ``methods/`` and one line here; a method of another
package or of a recipe's own file registers itself (:mod:`ondevice_moe.methods.plugins`).
A recipe's method entry is validated by the method's own options schema
(:func:`method_options`); :func:`build_method` turns the options into a
:class:`~ondevice_moe.methods.base.Method` for a recipe's devices.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ondevice_moe.errors import UserError
from ondevice_moe.methods.base import Method, MethodContext, MethodOptions
from ondevice_moe.methods.comigs import baselines as comigs_baselines
from ondevice_moe.methods.comigs.config import (
    CoMiGSOptions,
    FedAvgMoEOptions,
    HeterogeneousRankOptions,
    HetLoRAOptions,
    LoRABaselineOptions,
    LoRASizes,
    MoEBaselineOptions,
    PCLOptions,
)
from ondevice_moe.methods.comigs.method import comigs
from ondevice_moe.methods.fedsoft import method as fedsoft_methods
from ondevice_moe.methods.fedsoft import report as fedsoft_report
from ondevice_moe.methods.fedsoft.config import FedSoftOptions, FedSoftSizes
from ondevice_moe.methods.floral import method as floral_methods
from ondevice_moe.methods.floral.config import FedAvgAdaptorOptions, FLoRALOptions, FLoRALSizes, LocalAdaptorOptions
from ondevice_moe.methods.flow import method as flow_methods
from ondevice_moe.methods.flow import report as flow_report
from ondevice_moe.methods.flow.config import FlowOptions, FlowSizes
from ondevice_moe.methods.hermes import baselines as hermes_baselines
from ondevice_moe.methods.hermes.config import HermesBaselineOptions, HermesOptions, HermesSizes
from ondevice_moe.methods.hermes.method import hermes
from ondevice_moe.methods.mixture.config import MixtureOptions
from ondevice_moe.methods.mixture.method import mixture
from ondevice_moe.methods.plugins import Registry
from ondevice_moe.methods.spec import ANY_TASK, CLASSIFICATION, LANGUAGE, SMALL, MethodSpec
from ondevice_moe.report.reporter import Reporter

_LM = frozenset({LANGUAGE})
_TEXT = frozenset({LANGUAGE, CLASSIFICATION})
_ANY = ANY_TASK
_SMALL = frozenset({SMALL})

BUILT_IN: dict[str, MethodSpec] = {
    "pretrained": MethodSpec(LoRABaselineOptions, comigs_baselines.pretrained, _ANY, "experts"),
    "local": MethodSpec(LoRABaselineOptions, comigs_baselines.local, _LM, "experts"),
    "fedavg": MethodSpec(LoRABaselineOptions, comigs_baselines.fedavg, _LM, "experts"),
    "fedavg-two-lora": MethodSpec(LoRABaselineOptions, comigs_baselines.fedavg_two_lora, _LM, "experts"),
    "local-moe": MethodSpec(MoEBaselineOptions, comigs_baselines.local_moe, _LM, "experts"),
    "fedavg-moe": MethodSpec(FedAvgMoEOptions, comigs_baselines.fedavg_moe, _LM, "experts"),
    "pfedmoe": MethodSpec(LoRABaselineOptions, comigs_baselines.pfedmoe, _LM, "experts"),
    "pcl": MethodSpec(PCLOptions, comigs_baselines.pcl, _LM, "experts"),
    "fdlora": MethodSpec(LoRABaselineOptions, comigs_baselines.fdlora, _LM, "experts"),
    "ffa-lora": MethodSpec(LoRABaselineOptions, comigs_baselines.ffa_lora, _LM, "experts"),
    "fedsa-lora": MethodSpec(LoRABaselineOptions, comigs_baselines.fedsa_lora, _LM, "experts"),
    "centralized": MethodSpec(LoRABaselineOptions, comigs_baselines.centralized, _LM, "experts"),
    "hetlora": MethodSpec(HetLoRAOptions, comigs_baselines.hetlora, _LM, "experts"),
    "flexlora": MethodSpec(HeterogeneousRankOptions, comigs_baselines.flexlora, _LM, "experts"),
    "comigs": MethodSpec(CoMiGSOptions, comigs, _LM, "experts"),
    "hermes": MethodSpec(HermesOptions, hermes, _TEXT, "hermes"),
    "fed-ft": MethodSpec(HermesBaselineOptions, hermes_baselines.fed_ft, _ANY, "hermes"),
    "fed-lora": MethodSpec(HermesBaselineOptions, hermes_baselines.single_kind("lora"), _TEXT, "hermes"),
    "fed-adapter": MethodSpec(HermesBaselineOptions, hermes_baselines.single_kind("adapter"), _TEXT, "hermes"),
    "fed-prefix": MethodSpec(HermesBaselineOptions, hermes_baselines.single_kind("prefix"), _TEXT, "hermes"),
    "fed-unipelt": MethodSpec(HermesBaselineOptions, hermes_baselines.fed_unipelt, _TEXT, "hermes"),
    "mixture": MethodSpec(MixtureOptions, mixture, _ANY),
    "floral": MethodSpec(FLoRALOptions, floral_methods.floral, _ANY, "floral"),
    "ensemble": MethodSpec(FLoRALOptions, floral_methods.ensemble, _SMALL, "floral"),
    "local-adaptor": MethodSpec(LocalAdaptorOptions, floral_methods.local_adaptor, _ANY, "floral"),
    "fedavg-adaptor": MethodSpec(FedAvgAdaptorOptions, floral_methods.fedavg_adaptor, _ANY, "floral"),
    "fedsoft": MethodSpec(FedSoftOptions, fedsoft_methods.fedsoft, _ANY, "fedsoft", fedsoft_report.REPORTER),
    "ifca": MethodSpec(FedSoftOptions, fedsoft_methods.ifca, _ANY, "fedsoft", fedsoft_report.REPORTER),
    "fedem": MethodSpec(FedSoftOptions, fedsoft_methods.fedem, _ANY, "fedsoft", fedsoft_report.REPORTER),
    "fedavg-cluster-adapter": MethodSpec(FedSoftOptions, fedsoft_methods.fedavg_cluster_adapter, _ANY, "fedsoft"),
    "flow": MethodSpec(FlowOptions, flow_methods.flow, _ANY, "flow", flow_report.REPORTER),
    "fedavgft": MethodSpec(FlowOptions, flow_methods.fedavg_ft, _ANY, "flow", flow_report.REPORTER),
    "ditto": MethodSpec(FlowOptions, flow_methods.ditto, _ANY, "flow", flow_report.REPORTER),
    "apfl": MethodSpec(FlowOptions, flow_methods.apfl, _ANY, "flow", flow_report.REPORTER),
}

# Each family's recipe section: its shared defaults, validated by this schema (the section's name is
# the specs' ``defaults_section``).
_SECTIONS = {"experts": LoRASizes, "hermes": HermesSizes, "floral": FLoRALSizes, "fedsoft": FedSoftSizes,
             "flow": FlowSizes}
BUILT_IN = {name: replace(spec, section=_SECTIONS[spec.defaults_section]) if spec.defaults_section else spec
            for name, spec in BUILT_IN.items()}

REGISTRY = Registry(BUILT_IN)
METHODS = REGISTRY.specs
"""Every method by name: the built-in ones, then those of installed packages and of a recipe's
plug-in files as they are registered (:mod:`ondevice_moe.methods.plugins`)."""


def available_methods(plugin_files: tuple[Path, ...] = ()) -> dict[str, MethodSpec]:
    """Every method: built-in, of installed packages, and of the recipe's ``plugin_files``."""
    REGISTRY.read_entry_points()
    REGISTRY.load_files(plugin_files)
    return METHODS


def method_origins() -> dict[str, str]:
    """Where each method comes from: ``built-in``, ``package <name>`` or ``file <path>``."""
    available_methods()
    return dict(REGISTRY.origins)


def family_sections(specs: dict[str, MethodSpec] | None = None) -> dict[str, type[BaseModel]]:
    """Each method family's recipe section by name, with its schema, from ``specs`` (default: every
    method registered so far); two families claiming one section name with different schemas, or a
    family that names a section without giving its schema, is a :class:`UserError`."""
    sections: dict[str, type[BaseModel]] = {}
    for name, spec in (METHODS if specs is None else specs).items():
        if spec.defaults_section is None:
            continue
        if spec.section is None:
            raise UserError(f"method '{name}' names the recipe section '{spec.defaults_section}' without its schema",
                            "give its MethodSpec section=<a pydantic model of the section's keys>")
        known = sections.setdefault(spec.defaults_section, spec.section)
        if known is not spec.section:
            raise UserError(f"method '{name}' gives the recipe section '{spec.defaults_section}' another schema "
                            f"than the methods before it", "name the section of a new family after the family")
    return sections


def reporters(plugin_files: tuple[Path, ...] = ()) -> list[Reporter]:
    """Every method family's reporter (built-in, of installed packages and of ``plugin_files``), each
    once, in the registry's order: what a summary, a report or ``compare`` adds for the families."""
    found: list[Reporter] = []
    for spec in available_methods(plugin_files).values():
        if spec.reporter is not None and all(spec.reporter is not known for known in found):
            found.append(spec.reporter)
    return found


def method_spec(name: str) -> MethodSpec:
    methods = available_methods()
    if name not in methods:
        raise UserError(f"unknown method '{name}'", f"use one of {', '.join(methods)}")
    return methods[name]


def method_options(name: str, raw: dict[str, Any], defaults: dict[str, Any] | None = None) -> MethodOptions:
    """Validate a method entry's options with the method's own schema.

    ``defaults`` (the family's recipe section) fill the keys the entry does not
    set and the schema takes; an option the method does not take is an error
    naming the method and its valid options.
    """
    spec = method_spec(name)
    fields = spec.options.model_fields
    merged = {**{k: v for k, v in (defaults or {}).items() if k in fields}, **raw}
    try:
        return spec.options.model_validate(merged)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            key = ".".join(str(part) for part in item["loc"])
            if item["type"] == "extra_forbidden":
                problems.append(f"'{key}' is not an option of method '{name}'")
            else:
                problems.append(f"{key}: {item['msg']} (got {item.get('input')!r})")
        raise UserError(f"method '{name}': " + "; ".join(problems),
                        f"valid options of '{name}': {', '.join(fields)}") from None


def build_method(name: str, options: MethodOptions, context: MethodContext) -> Method:
    """The method ``name`` with validated ``options``, resolved for ``context.num_users`` devices."""
    method = method_spec(name).build(options, context)
    return replace(method, name=options.label) if options.label else method


def method_for(name: str, num_users: int, **options: Any) -> Method:
    """Build method ``name`` for ``num_users`` devices from keyword options (for scripts and tests)."""
    return build_method(name, method_options(name, options), MethodContext(num_users))
