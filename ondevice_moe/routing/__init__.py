"""Routers decide, per token, how much each expert contributes."""

from ondevice_moe.routing.balance import generalist_balance_loss, switch_balance_loss
from ondevice_moe.routing.routers import (
    ClientMixtureRouter,
    ClientRouter,
    Routing,
    TokenTopKRouter,
    UniformRouter,
    client_mixture,
)

__all__ = [
    "ClientMixtureRouter",
    "ClientRouter",
    "Routing",
    "TokenTopKRouter",
    "UniformRouter",
    "client_mixture",
    "generalist_balance_loss",
    "switch_balance_loss",
]
