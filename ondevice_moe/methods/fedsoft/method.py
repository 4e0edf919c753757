"""FedSoft and IFCA as layouts, procedures and server rules (FedSoft §3–5).

* ``fedsoft`` (Alg. 1): every client keeps its own whole model ``w_k`` and its
  optimiser on the device; each round it minimises eq. (4),
  ``f_k(w) + (λ/2) Σ_s u_ks ‖w − c_s‖²``, from ``w_k``, with importances ``u_ks``
  re-estimated every τ rounds, and sends ``w_k`` with ``u_k``; the server folds
  them into S centres by eq. (6) (:class:`~ondevice_moe.methods.fedsoft.rule.CentreRule`).
  ``proximal_lambda: 0`` is Table 5's λ = 0: clients train alone (Local).
* ``ifca`` (Ghosh et al., 2020; FedSoft's baseline): each client trains the centre
  with the lowest loss on its data and the server averages each centre over the
  clients that chose it; a client's local model is that centre (§5).
* On a Hugging Face model with ``lora_rank``, the models are cluster adapters: a LoRA on
  every attention projection, the base frozen (issue: S LoRA centres on SmolLM2, each user's
  text a mixture of two domains).
* ``fedem`` (Marfoq et al., 2021, Alg. 1; FedSoft's other baseline): each client keeps a private
  mixture π over the centres; each round it weighs every training example over the centres
  (E-step), sets π to their mean (M-step), trains every centre on its weighted loss and sends all
  S of them; the server averages each centre by example count. Its local model, as FedSoft §5
  scores it, is the centre of largest π. S times FedSoft's local work and upload, the cost FedSoft
  §2 names.
* FedAvg is ``fed-ft`` (or ``fed-lora`` on a Hugging Face model, on query and value);
  ``fedavg-cluster-adapter`` is FedAvg of FedSoft's own model (the cluster adapter: a LoRA of
  ``lora_rank`` on every attention projection, or the whole small model): the same targets and
  trainable parameters as each FedSoft, IFCA or Local client's model.
"""

from __future__ import annotations

from typing import Literal

from ondevice_moe.errors import UserError
from ondevice_moe.layout import ExpertSizes, Layout
from ondevice_moe.methods.base import Method, MethodContext, Procedure, Sharing, same_for_all
from ondevice_moe.methods.fedsoft.config import FedSoftOptions
from ondevice_moe.methods.fedsoft.procedure import CentreProcedure
from ondevice_moe.methods.fedsoft.rule import CentreRule
from ondevice_moe.server_rules.rules import ServerRule


def _clusters(options: FedSoftOptions, context: MethodContext) -> int:
    """S, checked against the clients: each centre needs clients to learn from."""
    clusters = options.clusters or context.clusters
    if clusters is None:
        raise UserError("FedSoft and IFCA need a number of centres S: this task has no sources",
                        "set `clusters` in the recipe's fedsoft: section (the paper uses S = 2, 4 or 8)")
    if clusters > context.num_users:
        raise UserError(f"{clusters} centres but only {context.num_users} clients",
                        f"use at most {context.num_users} centres (fedsoft.clusters) or more clients (task.clients)")
    return clusters


def _selection(options: FedSoftOptions, context: MethodContext) -> int | None:
    if options.selected_train and options.selection_size is None:
        raise UserError("fedsoft.selected_train trains the clients each centre draws, and no draw size is set",
                        "set fedsoft.selection_size (K clients per centre; the paper: 60 of 100)")
    if options.selection_size is not None and options.selection_size > context.num_users:
        raise UserError(f"fedsoft.selection_size is {options.selection_size} but there are only "
                        f"{context.num_users} clients", f"use at most {context.num_users} (the paper: 60 of 100)")
    return options.selection_size


def _layout(options: FedSoftOptions) -> Layout | None:
    """The cluster adapters of a Hugging Face model (a LoRA on every attention projection, the
    role ``shared``: it travels), or ``None``: the whole model is the client's and the centres'."""
    if options.lora_rank is None:
        return None
    return Layout(attention_lora="shared", sizes=ExpertSizes(lora_rank=options.lora_rank,
                                                             lora_alpha=2.0 * options.lora_rank, rank_stabilised=False))


def fedsoft(options: FedSoftOptions, context: MethodContext) -> Method:
    """FedSoft: proximal local updates from each client's own model, S soft-clustered centres."""
    clusters = _clusters(options, context)
    layout = _layout(options)
    centres = CentreProcedure(full_finetune=layout is None, clusters=clusters, assignment="soft",
                              proximal_lambda=options.proximal_lambda, estimation_interval=options.estimation_interval,
                              importance_floor=options.importance_floor, lora_spread=options.centre_spread,
                              scored_on=options.importance_split)
    return Method("fedsoft", same_for_all(context.num_users, layout), procedure=centres,
                  server_rule=CentreRule(clusters=clusters, selection_size=_selection(options, context),
                                         seed=context.seed, lora_centres=options.lora_centres,
                                         selected_train=options.selected_train),
                  sharing=Sharing(devices_keep_models=True))


def _unanchored(name: str, assignment: Literal["hard", "em"], options: FedSoftOptions, context: MethodContext,
                every_centre: bool = False) -> Method:
    """A method whose clients train centres themselves, without a proximal term (IFCA, FedEM;
    FedEM's E-step weighs the blocks it trains on, so it scores the training blocks)."""
    clusters = _clusters(options, context)
    layout = _layout(options)
    procedure = CentreProcedure(full_finetune=layout is None, clusters=clusters, assignment=assignment,
                                lora_spread=options.centre_spread, block_loss=options.fedem_block_loss,
                                scored_on="train" if every_centre else options.importance_split)
    return Method(name, same_for_all(context.num_users, layout), procedure=procedure,
                  server_rule=CentreRule(clusters=clusters, seed=context.seed,
                                         every_centre=every_centre, lora_centres=options.lora_centres))


def ifca(options: FedSoftOptions, context: MethodContext) -> Method:
    """IFCA: each client trains its lowest-loss centre; centres are averaged over their clients by n_k."""
    return _unanchored("ifca", "hard", options, context)


def fedem(options: FedSoftOptions, context: MethodContext) -> Method:
    """FedEM: E-step responsibilities, every centre trained on its weighted loss, centres averaged by n_k."""
    return _unanchored("fedem", "em", options, context, every_centre=True)


def fedavg_cluster_adapter(options: FedSoftOptions, context: MethodContext) -> Method:
    """FedAvg of the model a FedSoft client trains (its cluster adapter, or the whole small model),
    averaged by examples: FedSoft's targets and sizes without centres. Reads ``lora_rank`` only."""
    layout = _layout(options)
    return Method("fedavg-cluster-adapter", same_for_all(context.num_users, layout),
                  procedure=Procedure(full_finetune=layout is None), server_rule=ServerRule(context.weighting))
