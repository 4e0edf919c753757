"""A client's side of FedSoft and IFCA: scoring the centres on its data, and the proximal anchors.

* importance (Alg. 1 lines 5–10): each of the client's examples is matched to the
  centre with the lowest loss on it, ``n_ks`` counts the matches, and the client
  reports ``u_ks = max(n_ks / n_k, σ)``;
* IFCA's hard assignment (Ghosh et al., 2020): the one centre with the lowest
  loss over all the client's examples;
* the proximal term of eq. (4), ``(λ/2) Σ_s u_ks ‖w − c_s‖²``, whose gradient is
  ``λ (Σ_s u_ks w − Σ_s u_ks c_s)`` — eq. (5) when ``Σ_s u_ks = 1``.

Centres travel as ``cluster_<s>/<name>`` (:func:`centre_key`); a centre the server
does not hold yet is started from its own seed (:func:`centre_seed`), the same on
every client.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.data.splits import BlockExamples
from ondevice_moe.likelihood import block_nll
from ondevice_moe.models.devices import model_device

Tensors = dict[str, torch.Tensor]
CLUSTER_PREFIX = "cluster_"


def cluster_slot(centre: int) -> str:
    """The server slot of centre ``centre``."""
    return f"{CLUSTER_PREFIX}{centre}"


def centre_key(centre: int, name: str) -> str:
    """A sent centre tensor's name: ``cluster_<s>/<name>``."""
    return f"{cluster_slot(centre)}/{name}"


def split_centres(tensors: Tensors) -> dict[int, Tensors]:
    """Sent tensors by centre: ``{s: {name: tensor}}`` from ``cluster_<s>/<name>`` keys."""
    centres: dict[int, Tensors] = {}
    for key, tensor in tensors.items():
        slot, name = key.split("/", 1)
        centres.setdefault(int(slot.removeprefix(CLUSTER_PREFIX)), {})[name] = tensor
    return centres


def centre_seed(seed: int, centre: int) -> int:
    """The seed centre ``centre`` is initialised from: independent of the clients' own
    initialisation and of the other centres (§5: "randomly initialized … so that the
    association among clients, centers, and cluster distributions is built automatically")."""
    return zlib.crc32(f"{seed}:centre:{centre}".encode())


@torch.no_grad()
def example_losses(model: nn.Module, examples, batch_size: int = 512) -> torch.Tensor:
    """The loss of ``model`` on each example, shape ``(n,)``: squared error averaged over the
    outputs for a small regressor (``model.regression``), cross-entropy for a classifier, and a
    language model's mean next-token loss over each block (a block of text is an example)."""
    if isinstance(examples, BlockExamples):
        return block_nll(model, examples.blocks, batch_size) / (examples.blocks.shape[1] - 1)
    model.eval()
    device = model_device(model)
    losses = []
    for start in range(0, len(examples), batch_size):
        batch = examples.batch(torch.arange(start, min(start + batch_size, len(examples))))
        labels = batch.pop("labels").to(device)
        logits = model(**{key: value.to(device) for key, value in batch.items()}).logits.float()
        if _is_regressor(model):
            losses.append((logits - labels.float().view_as(logits)).pow(2).flatten(1).mean(dim=1).cpu())
        else:
            losses.append(nn.functional.cross_entropy(logits, labels.long(), reduction="none").cpu())
    return torch.cat(losses)


def _is_regressor(model: nn.Module) -> bool:
    """A small model says so; a Hugging Face classifier with one output regresses."""
    if hasattr(model, "regression"):
        return bool(model.regression)
    return getattr(model.config, "num_labels", 2) == 1


def centre_losses(model: nn.Module, centres: dict[int, Tensors], examples) -> torch.Tensor:
    """``(S, n)`` losses of each centre (loaded into ``model`` in turn) on each example.
    ``model`` is left holding the last centre; callers reload what they need."""
    rows = []
    for centre in sorted(centres):
        model.load_state_dict(centres[centre], strict=False)
        rows.append(example_losses(model, examples))
    return torch.stack(rows)


def importance_weights(losses: torch.Tensor, floor: float) -> list[float]:
    """Alg. 1 lines 6–10: ``u_s = max(n_s / n, σ)``, ``n_s`` the examples whose lowest loss
    (column-wise over the ``(S, n)`` ``losses``) is centre ``s``'s."""
    centres, examples = losses.shape
    counts = torch.bincount(losses.argmin(dim=0), minlength=centres).double()
    return [max(float(count) / examples, floor) for count in counts]


def hard_assignment(losses: torch.Tensor) -> int:
    """IFCA: the centre with the lowest total loss over the client's examples."""
    return int(losses.sum(dim=1).argmin())


@dataclass(frozen=True)
class ProximalAnchors:
    """The centres a round's local steps are anchored to, with the client's weights on them.

    ``weights[s]`` is ``u_ks`` (FedSoft) or IFCA's one-hot assignment; they also travel
    with the update, for the server's eq. (6). ``strength`` is λ of eq. (4); zero adds
    no term (IFCA, and FedSoft with λ = 0: the Local baseline)."""

    centres: tuple[Tensors, ...]
    weights: tuple[float, ...]
    strength: float

    def penalty(self, parameters: list[tuple[str, nn.Parameter]]) -> torch.Tensor | None:
        """Eq. (4)'s ``(λ/2) Σ_s u_ks ‖w − c_s‖²`` over the named trainable ``parameters`` that the
        centres hold (a centre holds every one in FedSoft; Ditto anchors the local copies only)."""
        if self.strength == 0:
            return None
        total = sum(weight * sum((param - centre[name].to(param)).pow(2).sum()
                                 for name, param in parameters if name in centre)
                    for weight, centre in zip(self.weights, self.centres, strict=True))
        return 0.5 * self.strength * total
