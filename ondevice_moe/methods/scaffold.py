"""``ondevice-moe new-method NAME DEST [--template T]``: a method folder that runs as generated.

The folder is a Python package with the parts of every method (``docs/architecture.md``) and what
makes it usable: ``options.py`` (its recipe options), ``method.py`` (its layout per device and its
builder), ``rule.py`` (its server rule), ``__init__.py`` (``METHODS``, what a recipe's ``plugins:``
entry or a package's entry point registers), a tiny ``recipe.yaml`` that runs it on the small digits
task beside the toolkit method it equals at one setting, and ``test_<name>.py`` checking that. Three
templates (:data:`TEMPLATES`), each a different hook to start from:

* ``proximal`` — a device-side change: FedProx's proximal term (Li et al. 2020, eq. 2) in
  ``procedure.py``; at ``mu: 0`` it is FedAvg of the same adaptor (``fedavg-adaptor``).
* ``private-head`` — a sharing change: the whole model trains, the task head never leaves the device
  (FedPer, Arivazhagan et al. 2019); at ``private_head: false`` it is FedAvg of the whole model (``fed-ft``).
* ``custom-rule`` — a server-side change: FedAvgM's server momentum (Hsu et al. 2019, Alg. 1) in
  ``rule.py``; at ``beta: 0`` it is FedAvg of the same adaptor (``fedavg-adaptor``).
"""

from __future__ import annotations

import re
from pathlib import Path

from ondevice_moe.errors import UserError
from ondevice_moe.names import is_plain_name

INIT = '''"""{name}: a method of ondevice-moe (scaffolded by ``ondevice-moe new-method``).

A recipe uses it with ``plugins: [path/to/{package}]`` and ``methods: [{name}]`` (run with
``--trust-plugins``); a package exposes it through the entry point group ``ondevice_moe.methods``:
``{name} = "{package}:SPEC"``.
"""

from ondevice_moe.methods.spec import ANY_TASK, MethodSpec

from .method import build
from .options import Options

SPEC = MethodSpec(Options, build, ANY_TASK)
METHODS = {{"{name}": SPEC}}
'''

OPTIONS = '''"""{name}'s options in a recipe's method entry (``{{name: {name}, mu: 0.1}}``)."""

from pydantic import Field

from ondevice_moe.methods.base import MethodOptions


class Options(MethodOptions):
    """``mu``: the weight of the proximal term (FedProx, Li et al. 2020, eq. 2; the paper tries
    0.001 to 1); ``budget``: the relative parameter budget of the one shared adaptor on every layer;
    ``train_base``: the base model trains with the adaptor (a small model learns its task from scratch,
    as FLoRAL's Alg. 1 trains its base; a frozen Hugging Face base sets it false)."""

    mu: float = Field(0.1, ge=0)
    budget: float = Field(0.01, gt=0, le=1)
    train_base: bool = True
'''

METHOD = '''"""{name} as a layout, a procedure and a server rule."""

from ondevice_moe.experts.layer import AdaptorKinds
from ondevice_moe.layout import ExpertSpec, Layout, RouterSpec
from ondevice_moe.methods.base import Method, MethodContext, same_for_all

from .options import Options
from .procedure import ProximalProcedure
from .rule import server_rule


def build(options: Options, context: MethodContext) -> Method:
    """One shared adaptor on every layer of every device (it travels and is averaged), trained with
    a proximal term to the round's received adaptor."""
    layout = Layout((ExpertSpec("layers", "shared"),), RouterSpec("none"), "every-layer",
                    adaptor_kinds=AdaptorKinds(budget=options.budget))
    procedure = ProximalProcedure(full_finetune=options.train_base, mu=options.mu)
    return Method("{name}", same_for_all(context.num_users, layout), procedure,
                  server_rule(options, context))
'''

PROCEDURE = '''"""{name}'s device side: plain local training plus FedProx's proximal term (Li et al. 2020,
eq. 2), ``(mu / 2) * ||w - w_t||^2`` to the shared tensors as the round received them.

Override only what differs from :class:`~ondevice_moe.methods.procedure.Procedure`: here
``begin_round`` (keep ``w_t``) and ``loss_terms`` (add the term to every expert step).
"""

from dataclasses import dataclass

import torch

from ondevice_moe.methods.procedure import OnDevice, Procedure, Tensors
from ondevice_moe.training import DeviceTrainer

RECEIVED = "received"


@dataclass(frozen=True)
class ProximalProcedure(Procedure):
    mu: float = 0.01

    def begin_round(self, device: OnDevice, trainer: DeviceTrainer, received: Tensors | None,
                    server_round: int) -> dict[str, float]:
        trainer.round_state[RECEIVED] = {{name: param.detach().clone() for name, param in trainer.trainable
                                         if device.travels(name)}}
        return {{}}

    def loss_terms(self, trainer: DeviceTrainer, *, train_experts: bool, train_router: bool) -> torch.Tensor | None:
        anchor = trainer.round_state.get(RECEIVED)
        if not train_experts or not anchor or self.mu == 0:
            return None
        distance = sum((param - anchor[name]).pow(2).sum() for name, param in trainer.trainable if name in anchor)
        return 0.5 * self.mu * distance
'''

RULE = '''"""{name}'s server rule: FedAvg, the shared tensors averaged by the federation's weighting.

Subclass :class:`~ondevice_moe.server_rules.rules.ServerRule` to change what the server keeps, sends or
how uploads combine."""

from ondevice_moe.server_rules.rules import ServerRule
from ondevice_moe.methods.base import MethodContext

from .options import Options


def server_rule(options: Options, context: MethodContext) -> ServerRule:
    return ServerRule(context.weighting)
'''

RECIPE = '''name: {name}-tiny
description: {name} beside itself at {knob} = 0, which is FedAvg of the same adaptor and base, on the small digits task.
seed: 0
plugins: [.]          # this folder: its METHODS register {name}
model: {{name: mlp}}
task: {{name: digits-rotate, clients: 4, clusters: 2, batch_size: 32, eval_batch_size: 256}}
federation: {{rounds: 3, local_epochs: 1, cpus_per_client: 1, weighting: num_examples}}
training: {{lr: 0.05, optimizer: sgd, grad_clip: null, lr_schedule: constant}}
methods:
  - {name}
  - {{name: {name}, {knob}: 0.0, label: {name}-{label}}}
  - {{name: fedavg-adaptor, preconditioning: false}}   # the toolkit's FedAvg of the same adaptor: equals {knob} = 0
'''

RUNS_THROUGH_FLOWER = '''

def test_the_recipe_runs_through_flower_and_one_setting_is_the_toolkits_fedavg(tmp_path):
    env = {{**os.environ, "HF_HUB_OFFLINE": "1"}}
    subprocess.run([sys.executable, "-m", "ondevice_moe", "finetune", str(HERE / "recipe.yaml"), "--trust-plugins",
                    "--output", str(tmp_path / "run")], check=True, env=env, timeout=3600)
    methods = json.loads((tmp_path / "run" / "summary.json").read_text())["methods"]
    assert {{"{name}", "{name}-{label}", "{peer}"}} <= set(methods)
    # There the method is the toolkit's FedAvg of the same experts and base: the same numbers.
    assert methods["{name}-{label}"]["{score}"] == methods["{peer}"]["{score}"]
'''

TEST = '''"""{name} runs through Flower on the tiny recipe, and its proximal term does what it says."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
''' + RUNS_THROUGH_FLOWER + '''

def test_the_proximal_term_is_zero_at_the_received_weights_and_grows_away_from_them():
    import torch
    from torch import nn

    from ondevice_moe.methods.base import Method
    from ondevice_moe.training import DeviceTrainer, TrainingConfig

    from {package}.procedure import ProximalProcedure

    procedure = ProximalProcedure(mu=2.0)
    model = nn.Sequential(nn.Linear(2, 2))
    trainer = DeviceTrainer(model, Method("{name}", (None,), procedure), TrainingConfig())
    procedure.begin_round(_Device(), trainer, None, 1)
    assert float(procedure.loss_terms(trainer, train_experts=True, train_router=False).detach()) == 0.0
    with torch.no_grad():
        model[0].weight.add_(1.0)
    term = procedure.loss_terms(trainer, train_experts=True, train_router=False)
    assert float(term.detach()) == 4.0  # mu/2 · 4 weights · 1²


class _Device:
    def travels(self, name):
        return True
'''


PRIVATE_HEAD_OPTIONS = '''"""{name}'s options in a recipe's method entry (``{{name: {name}, private_head: false}}``)."""

from ondevice_moe.methods.base import MethodOptions


class Options(MethodOptions):
    """``private_head``: the task head stays on each device (FedPer's personalisation layers); false sends
    it too, which is FedAvg of the whole model."""

    private_head: bool = True
'''

PRIVATE_HEAD_METHOD = '''"""{name} as a layout, a procedure, a server rule and a sharing policy (FedPer,
Arivazhagan et al. 2019, §3: base layers shared, personalisation layers private)."""

from ondevice_moe.methods.base import HEAD, Method, MethodContext, Procedure, Sharing, same_for_all

from .options import Options
from .rule import server_rule


def build(options: Options, context: MethodContext) -> Method:
    """The whole model trains on every device (no experts: layout ``None``); every tensor but the head's
    travels and is averaged. ``Sharing.private_modules`` is the one place that says what stays home: the
    device, the server's checks, ``--dry-run`` and export all read it."""
    private = (HEAD,) if options.private_head else ()
    return Method("{name}", same_for_all(context.num_users, None), Procedure(full_finetune=True),
                  server_rule(options, context), sharing=Sharing(private_modules=private))
'''

PRIVATE_HEAD_RECIPE = '''name: {name}-tiny
description: {name} (private heads) beside itself with shared heads (FedAvg of the whole model), on small digits.
seed: 0
plugins: [.]          # this folder: its METHODS register {name}
model: {{name: mlp}}
task: {{name: digits-rotate, clients: 4, clusters: 2, batch_size: 32, eval_batch_size: 256}}
federation: {{rounds: 3, local_epochs: 1, cpus_per_client: 1, weighting: num_examples}}
training: {{lr: 0.01, lr_schedule: constant}}
methods:
  - {name}
  - {{name: {name}, private_head: false, label: {name}-{label}}}
  - fed-ft            # the toolkit's FedAvg of the whole model: equals private_head false
'''

PRIVATE_HEAD_TEST = '''"""{name} runs through Flower on the tiny recipe, and its heads stay on the devices."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
''' + RUNS_THROUGH_FLOWER + '''

def test_the_dry_run_uploads_everything_but_the_head(monkeypatch, tmp_path):
    from ondevice_moe.methods.plugins import TRUST_ENV
    from ondevice_moe.plan import plan_recipe
    from ondevice_moe.recipe import load_recipe

    monkeypatch.setenv(TRUST_ENV, "1")
    plans = {{plan.name: plan.devices[0] for plan in plan_recipe(load_recipe(HERE / "recipe.yaml"), tmp_path)}}
    private, shared = plans["{name}"], plans["{name}-shared-head"]
    assert private.trainable == shared.trainable == shared.uploaded > private.uploaded > 0
'''

MOMENTUM_OPTIONS = '''"""{name}'s options in a recipe's method entry (``{{name: {name}, beta: 0.9}}``)."""

from pydantic import Field

from ondevice_moe.methods.base import MethodOptions


class Options(MethodOptions):
    """``beta``: the server's momentum (FedAvgM, Hsu et al. 2019, Alg. 1; 0 is FedAvg); ``budget``: the
    relative parameter budget of the one shared adaptor on every layer; ``train_base``: the base model
    trains with the adaptor (a small model learns its task from scratch)."""

    beta: float = Field(0.9, ge=0, lt=1)
    budget: float = Field(0.01, gt=0, le=1)
    train_base: bool = True
'''

MOMENTUM_METHOD = '''"""{name} as a layout, a procedure and a server rule."""

from ondevice_moe.experts.layer import AdaptorKinds
from ondevice_moe.layout import ExpertSpec, Layout, RouterSpec
from ondevice_moe.methods.base import Method, MethodContext, Procedure, same_for_all

from .options import Options
from .rule import server_rule


def build(options: Options, context: MethodContext) -> Method:
    """One shared adaptor on every layer of every device, trained as FedAvg trains it; the server
    combines the uploads with momentum (``rule.py``)."""
    layout = Layout((ExpertSpec("layers", "shared"),), RouterSpec("none"), "every-layer",
                    adaptor_kinds=AdaptorKinds(budget=options.budget))
    return Method("{name}", same_for_all(context.num_users, layout), Procedure(full_finetune=options.train_base),
                  server_rule(options, context))
'''

MOMENTUM_RULE = '''"""{name}'s server rule: FedAvgM, server momentum (Hsu et al. 2019, Alg. 1).

Each round the server averages the uploads as FedAvg does (``x̄``), takes the change from its global
tensors, ``Δ = x̄ − x``, folds it into a velocity ``v ← β v + Δ`` and moves ``x ← x + v``. At
``β = 0`` that is ``x ← x̄``: FedAvg. The velocity is a slot of its own: the server keeps it between
rounds (and across a restart) and never sends it.
"""

from dataclasses import dataclass

from ondevice_moe.server_rules.aggregation import Update, average
from ondevice_moe.server_rules.rules import GLOBAL, ServerRule, Slots
from ondevice_moe.methods.base import MethodContext

from .options import Options

VELOCITY = "velocity"


@dataclass(frozen=True)
class MomentumRule(ServerRule):
    beta: float = 0.9

    @property
    def needs_each_update(self) -> str | None:
        return None  # it reads only the weighted mean of the uploads, which secure aggregation gives too

    def initial_slots(self) -> Slots:
        return {{GLOBAL: {{}}, VELOCITY: {{}}}}

    def aggregate(self, slots: Slots, updates: list[Update]) -> Slots:
        if not any(update.tensors for update in updates):
            return slots
        mean = average(updates, self.weights())
        glob, velocity = dict(slots[GLOBAL]), dict(slots[VELOCITY])
        for name, tensor in mean.items():
            if name not in glob:  # the first round: nothing to move from
                glob[name] = tensor
                continue
            velocity[name] = self.beta * velocity.get(name, 0.0) + (tensor - glob[name])
            glob[name] = glob[name] + velocity[name]
        return {{**slots, GLOBAL: glob, VELOCITY: velocity}}


def server_rule(options: Options, context: MethodContext) -> ServerRule:
    return MomentumRule(context.weighting, beta=options.beta)
'''

MOMENTUM_TEST = '''"""{name} runs through Flower on the tiny recipe, and its rule moves as FedAvgM says."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ondevice_moe.server_rules.aggregation import Update
from ondevice_moe.server_rules.rules import GLOBAL

HERE = Path(__file__).resolve().parent
''' + RUNS_THROUGH_FLOWER + '''

def test_the_server_keeps_a_velocity_and_moves_by_it():
    from {package}.rule import MomentumRule

    rule = MomentumRule("uniform", beta=0.5)
    slots = rule.aggregate(rule.initial_slots(), [Update(0, {{"w": torch.tensor([2.0])}}, 1)])
    assert float(slots[GLOBAL]["w"]) == 2.0  # round 1: the mean
    slots = rule.aggregate(slots, [Update(0, {{"w": torch.tensor([4.0])}}, 1)])
    assert float(slots[GLOBAL]["w"]) == 4.0  # v = 0.5·0 + (4 − 2) = 2
    slots = rule.aggregate(slots, [Update(0, {{"w": torch.tensor([4.0])}}, 1)])
    assert float(slots[GLOBAL]["w"]) == 5.0  # v = 0.5·2 + (4 − 4) = 1: momentum carries on
'''

LANGUAGE_OPTIONS = '''"""{name}'s options in a recipe's method entry (``{{name: {name}, {knob}: 0.0}}``)."""

from pydantic import Field

from ondevice_moe.methods.base import MethodOptions


class Options(MethodOptions):
    """``{knob}``: {knob_doc}.
    ``lora_rank``: the attention LoRA's rank r (each MLP linear's is 2r, one LoRA per targeted module, as
    the toolkit's ``fedavg``)."""

    {knob}: float = Field({default}, ge=0, lt={bound})
    lora_rank: int = Field(8, ge=1)
'''

LANGUAGE_METHOD = '''"""{name} as a layout, a procedure and a server rule, on a causal language model."""

from ondevice_moe.layout import ExpertSizes, ExpertSpec, Layout, RouterSpec
from ondevice_moe.methods.base import {base_names}

from .options import Options
{procedure_import}from .rule import server_rule


def build(options: Options, context: MethodContext) -> Method:
    """One shared LoRA per targeted module of every block (rank 2r on each MLP linear, r on attention), the
    layout of the toolkit's ``fedavg``; {what}."""
    layout = Layout((ExpertSpec("lora", "shared", rank=2 * options.lora_rank),), RouterSpec("uniform"), "mlp",
                    attention_lora="shared", sizes=ExpertSizes(lora_rank=options.lora_rank))
    procedure = {procedure}
    return Method("{name}", same_for_all(context.num_users, layout), procedure, server_rule(options, context))
'''

LANGUAGE_RECIPE = '''name: {name}-tiny
description: {name} beside itself at {knob} = 0, which is the toolkit's fedavg, on a tiny GPT-2 and two offline domains.
seed: 0
plugins: [.]          # this folder: its METHODS register {name}
model: {{name: tiny-gpt2}}   # a 2-layer random GPT-2 for a quick check; smollm2-135m for a real model (offline)
data:
  context_length: 32
  batch_size: 4
  train_tokens: 4000
  valid_tokens: 1000
  test_tokens: 1000
  users:
    - {{name: code, source: python-code}}
    - {{name: news, source: bbc-news}}
federation: {{rounds: 2, local_iterations: 3, cpus_per_client: 1}}
training: {{lr: 0.01, lr_schedule: constant}}
methods:
  - {name}
  - {{name: {name}, {knob}: 0.0, label: {name}-{label}}}
  - fedavg            # the toolkit's FedAvg of the same LoRA: equals {knob} = 0
'''

LANGUAGE = {
    "proximal": {"knob": "mu", "default": "0.1", "bound": "1000", "label": "mu0",
                 "knob_doc": "the weight of FedProx's proximal term (Li et al. 2020, eq. 2)",
                 "base_names": "Method, MethodContext, same_for_all",
                 "procedure_import": "from .procedure import ProximalProcedure\n",
                 "procedure": "ProximalProcedure(mu=options.mu)",
                 "what": "trained with a proximal term to the round's received LoRA"},
    "custom-rule": {"knob": "beta", "default": "0.9", "bound": "1", "label": "beta0",
                    "knob_doc": "the server's momentum (FedAvgM, Hsu et al. 2019, Alg. 1; 0 is FedAvg)",
                    "base_names": "Method, MethodContext, Procedure, same_for_all", "procedure_import": "",
                    "procedure": "Procedure()", "what": "the server combines the uploads with momentum"},
}
SMALL = {"proximal": {"knob": "mu", "label": "mu0", "peer": "fedavg-adaptor"},
         "custom-rule": {"knob": "beta", "label": "beta0", "peer": "fedavg-adaptor"},
         "private-head": {"knob": "private_head", "label": "shared-head", "peer": "fed-ft"}}
LANGUAGE_PEER = {"score": "mean_in", "peer": "fedavg"}
TASKS = ("small", "language")

TEMPLATES: dict[str, dict[str, str]] = {
    "proximal": {"options.py": OPTIONS, "method.py": METHOD, "procedure.py": PROCEDURE, "rule.py": RULE,
                 "recipe.yaml": RECIPE, "test.py": TEST},
    "private-head": {"options.py": PRIVATE_HEAD_OPTIONS, "method.py": PRIVATE_HEAD_METHOD, "rule.py": RULE,
                     "recipe.yaml": PRIVATE_HEAD_RECIPE, "test.py": PRIVATE_HEAD_TEST},
    "custom-rule": {"options.py": MOMENTUM_OPTIONS, "method.py": MOMENTUM_METHOD, "rule.py": MOMENTUM_RULE,
                    "recipe.yaml": RECIPE, "test.py": MOMENTUM_TEST},
}


def package_name(name: str) -> str:
    """The Python package of method ``name``: ``my-method`` → ``my_method``."""
    return re.sub(r"\W", "_", name).lstrip("_0123456789") or "method"


def scaffold(name: str, destination: Path, template: str = "proximal", task: str = "small") -> Path:
    """Write method ``name``'s folder under ``destination`` from ``template`` (a key of :data:`TEMPLATES`) for
    ``task`` (``small``: the digits MLP; ``language``: a causal language model, LoRA experts); returns it.
    An existing folder, a bad name, an unknown template or task is refused."""
    if not is_plain_name(name):
        raise UserError(f"method name {name!r} cannot name a folder", "use letters, digits and - only (e.g. fedprox)")
    if template not in TEMPLATES:
        raise UserError(f"unknown template {template!r}", f"use one of: {', '.join(TEMPLATES)}")
    if task not in TASKS:
        raise UserError(f"unknown task {task!r}", f"use one of: {', '.join(TASKS)}")
    if task == "language" and template not in LANGUAGE:
        raise UserError(f"template {template!r} is for the small model: a causal language model's head is its "
                        "tied output embedding", f"for a language model use one of: {', '.join(LANGUAGE)}")
    package = package_name(name)
    folder = Path(destination) / package
    if folder.exists():
        raise UserError(f"{folder} already exists", "choose another DEST or NAME, or remove that folder")
    files = {"__init__.py": INIT, **TEMPLATES[template]}
    fields = {"name": name, "package": package, "score": "mean_score", **SMALL[template]}
    if task == "language":
        files |= {"options.py": LANGUAGE_OPTIONS, "method.py": LANGUAGE_METHOD, "recipe.yaml": LANGUAGE_RECIPE}
        fields |= {**LANGUAGE[template], **LANGUAGE_PEER}
    folder.mkdir(parents=True)
    for file, text in files.items():
        target = f"test_{package}.py" if file == "test.py" else file
        (folder / target).write_text(text.format(**fields), encoding="utf-8")
    return folder
