"""FLoRAL's device side: plain local training whose LoRA and ConvLoRA gradients may be
preconditioned before each step (App. D, eq. 36; :mod:`ondevice_moe.experts.preconditioning`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ondevice_moe.experts.preconditioning import low_rank_modules, precondition_gradients
from ondevice_moe.methods.floral.rule import MIXTURE
from ondevice_moe.methods.procedure import Procedure, Tensors
from ondevice_moe.routing import client_mixture

if TYPE_CHECKING:
    from ondevice_moe.training import DeviceTrainer

LOW_RANK_MODULES = "low-rank-modules"


@dataclass(frozen=True)
class AdaptorProcedure(Procedure):
    """FLoRAL, its Ensemble, the Local Adaptor and the FedAvg of one adaptor: with ``lora_preconditioning`` every
    LoRA and ConvLoRA gradient is preconditioned between backward and the step (App. D, designed
    for SGD; it runs under whichever optimiser the recipe names)."""

    lora_preconditioning: bool = False

    def upload(self, trainer: DeviceTrainer, tensors: Tensors, records: dict[str, dict]
               ) -> tuple[Tensors, dict[str, dict]]:
        """With a client-mixture router, its ``π`` travels with the adaptors (Alg. 1 line 12): the
        server weighs each adaptor ``c`` by ``π_c`` (:class:`~ondevice_moe.methods.floral.rule.MixtureRule`)."""
        pi = client_mixture(trainer.model)
        return tensors, records if pi is None else {**records, MIXTURE: {"pi": pi}}

    def adjust_gradients(self, trainer: DeviceTrainer) -> None:
        if not self.lora_preconditioning:
            return
        if LOW_RANK_MODULES not in trainer.round_state:
            trainer.round_state[LOW_RANK_MODULES] = low_rank_modules(trainer.model)
        precondition_gradients(trainer.round_state[LOW_RANK_MODULES])
