"""Options of FedSoft and IFCA (FedSoft §3–5, App. C).

The recipe's ``fedsoft:`` section sets these for every method of the family;
an entry may override them (``{name: fedsoft, proximal_lambda: 0, label: local}``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ondevice_moe.methods.base import MAX_RANK, MethodOptions


class FedSoftSizes(BaseModel):
    """``clusters``: S centres (default: the task's sources); ``proximal_lambda``: λ of
    eq. (4) (App. C: 1.0 on the synthetic data, 0.1 on letters; 0 leaves every client
    alone — the Local baseline of Table 5); ``estimation_interval``: τ, the rounds an
    importance estimate is used for (Alg. 1 line 3; §5: 2); ``importance_floor``: σ,
    the counter smoother of Alg. 1 line 10 (§5: 1e-4); ``selection_size``: K clients
    drawn per centre with probabilities v_sk (Alg. 1 line 16; §5: 60 of 100), or
    ``None`` for full participation, ``c_s = Σ_k v_sk w_k`` (§3, after Alg. 1).
    ``lora_rank``: on a Hugging Face model, each centre and each client's own model is a LoRA
    of this rank on every attention projection, the base frozen (cluster adapters; ``None``
    trains and sends the whole model, as on the small models); ``centre_spread``: the std of
    each LoRA centre's ``B`` at the start. FedSoft's code draws its centres from N(0, σ0²); a
    zero ``B``, LoRA's usual start, would start every centre as the same model, and centres
    averaged from the same clients would stay equal. ``fedem_block_loss``: how FedEM's E-step scores
    a block of text. ``sum`` (the paper: an example's likelihood is ``exp(−ℓ)``, Marfoq et al. 2021,
    Assumption 2, and a block's log-likelihood is the sum over its tokens) or ``mean`` (the authors'
    code, ``LanguageModelingLearner.gather_losses``: the mean per token, which tempers the E-step's
    posteriors by one over the tokens scored). Examples that are not blocks are scored by their loss.
    ``selected_train`` (with ``selection_size``): only the clients drawn for some centre train each
    round, as Alg. 1 lines 16–18, instead of every client training and the draw made among the
    uploads (:mod:`~ondevice_moe.methods.fedsoft.rule`); FedSoft only.
    ``importance_split``: the blocks of text a FedSoft or IFCA client scores the centres on (Alg. 1
    lines 5–10; IFCA's choice): ``train`` (the paper: the client's training data) or ``valid``, the
    held-out validation blocks of the user's text (``data.valid_tokens``). On a few dozen blocks a
    centre averaged from a client's own model wins that client's training blocks by having seen
    them, whatever their domain; held-out blocks it has not seen go to the centre that fits their
    domain. Language-modelling recipes only (the small tasks have no validation split).
    ``lora_centres``: how the server folds cluster adapters into a centre (with ``lora_rank``).
    ``factors``: ``A`` and ``B`` averaged apart by eq. (6), ``(Σ_k v_sk B_k)(Σ_k v_sk A_k)``, which
    is not the average of the clients' models ``W_0 + B_k A_k`` when their ``A`` differ. ``product``:
    eq. (6) on the models themselves, ``ΔW_s = Σ_k v_sk B_k A_k``, refactored to rank ``lora_rank``
    by truncated SVD — exact when the clients' updates span at most ``r`` directions, otherwise the
    nearest rank-``r`` update (Eckart–Young; :mod:`~ondevice_moe.methods.fedsoft.rule`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clusters: int | None = Field(None, ge=1)
    proximal_lambda: float = Field(1.0, ge=0)
    estimation_interval: int = Field(2, ge=1)
    importance_floor: float = Field(1e-4, gt=0, lt=1)
    selection_size: int | None = Field(None, ge=1)
    lora_rank: int | None = Field(None, ge=1, le=MAX_RANK)
    centre_spread: float = Field(0.02, ge=0)
    fedem_block_loss: Literal["sum", "mean"] = "sum"
    importance_split: Literal["train", "valid"] = "train"
    lora_centres: Literal["factors", "product"] = "factors"
    selected_train: bool = False


class FedSoftOptions(FedSoftSizes, MethodOptions):
    """FedSoft and IFCA take the same options; IFCA reads only ``clusters``."""
