"""A client's side of FedSoft and IFCA: scoring the centres on its data, and the proximal anchors.

* importance (Alg. 1 lines 5–10): each of the client's examples is matched to the
  centre with the lowest loss on it, ``n_ks`` counts the matches, and the client
  reports ``u_ks = max(n_ks / n_k, σ)``;
* IFCA's hard assignment (Ghosh et al., 2020): the one centre with the lowest
  loss over all the client's examples;
* FedEM's E- and M-steps (Marfoq et al., 2021, Alg. 1): each example's responsibilities
  ``q(z_i = s) ∝ π_s · exp(−ℓ_s(i))`` over the centres, and the client's mixture
  ``π_s = (1/n) Σ_i q(z_i = s)``;
* the proximal term of eq. (4), ``(λ/2) Σ_s u_ks ‖w − c_s‖²``, whose gradient is
  ``λ (Σ_s u_ks w − Σ_s u_ks c_s)`` — eq. (5) when ``Σ_s u_ks = 1``.

Centres travel as ``cluster_<s>/<name>`` (:func:`centre_key`); a centre the server
does not hold yet is started from its own seed (:func:`centre_seed`), the same on
every client.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ondevice_moe.data.splits import BlockExamples
from ondevice_moe.example_loss import example_loss
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
    """The loss of each of ``examples`` under ``model``, shape ``(n,)``
    (:func:`~ondevice_moe.example_loss.example_loss`; a block of text is an example)."""
    if isinstance(examples, BlockExamples):
        return block_nll(model, examples.blocks, batch_size) / (examples.blocks.shape[1] - 1)
    model.eval()
    device = model_device(model)
    losses = []
    for start in range(0, len(examples), batch_size):
        batch = examples.batch(torch.arange(start, min(start + batch_size, len(examples))))
        labels = batch.pop("labels").to(device)
        logits = model(**{key: value.to(device) for key, value in batch.items()}).logits
        losses.append(example_loss(model, logits, labels).cpu())
    return torch.cat(losses)


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


def responsibilities(losses: torch.Tensor, mixture: Sequence[float]) -> torch.Tensor:
    """FedEM's E-step (Marfoq et al., 2021, Alg. 1): ``(S, n)`` posteriors
    ``q(z_i = s) = π_s exp(−ℓ_s(i)) / Σ_s' π_s' exp(−ℓ_s'(i))`` from the ``(S, n)`` ``losses``
    and the client's mixture ``π`` (the authors' ``softmax(log π − losses)``); each column sums to one."""
    prior = torch.tensor(mixture, dtype=torch.float64).log().unsqueeze(1)
    return torch.softmax(prior - losses.double(), dim=0)


def example_nll(losses: torch.Tensor, examples, block_loss: str) -> torch.Tensor:
    """What FedEM's E-step scores an example by: its negative log-likelihood ``−log p(x_i)``
    (Marfoq et al., 2021, Assumption 2: ``p = exp(−ℓ)``). The ``(S, n)`` ``losses`` are per-example
    mean losses; a block of text's likelihood is the product over its tokens, so ``sum`` scales a
    block's mean by the tokens scored. ``mean`` keeps the mean per token, as the authors' code does
    (``LanguageModelingLearner.gather_losses``), tempering the posteriors by that count."""
    if block_loss == "sum" and isinstance(examples, BlockExamples):
        return losses * (examples.blocks.shape[1] - 1)
    return losses


def mixture_of(posteriors: torch.Tensor) -> list[float]:
    """FedEM's M-step for the client's mixture (Alg. 1): ``π_s = (1/n) Σ_i q(z_i = s)``."""
    return [float(weight) for weight in posteriors.mean(dim=1)]


def hard_assignment(losses: torch.Tensor) -> int:
    """IFCA: the centre with the lowest total loss over the client's examples."""
    return int(losses.sum(dim=1).argmin())


@dataclass(frozen=True)
class ProximalAnchors:
    """The centres a round's local steps are anchored to, with the client's weights on them.

    ``weights[s]`` is ``u_ks`` (FedSoft), IFCA's one-hot assignment or FedEM's ``π_s``; they
    also travel with the update, for the server's eq. (6). ``strength`` is λ of eq. (4); zero
    adds no term (IFCA, FedEM, and FedSoft with λ = 0: the Local baseline). ``posteriors``:
    FedEM's ``(S, n)`` E-step responsibilities of the client's training examples."""

    centres: tuple[Tensors, ...]
    weights: tuple[float, ...]
    strength: float
    posteriors: torch.Tensor | None = None

    def penalty(self, parameters: list[tuple[str, nn.Parameter]]) -> torch.Tensor | None:
        """Eq. (4)'s ``(λ/2) Σ_s u_ks ‖w − c_s‖²`` over the named trainable ``parameters`` that the
        centres hold (a centre holds every one in FedSoft; Ditto anchors the local copies only)."""
        if self.strength == 0:
            return None
        total = sum(weight * sum((param - centre[name].to(param)).pow(2).sum()
                                 for name, param in parameters if name in centre)
                    for weight, centre in zip(self.weights, self.centres, strict=True))
        return 0.5 * self.strength * total
