"""Routers decide, per token, how much each expert contributes."""

from ondevice_moe.routing.balance import generalist_balance_loss, switch_balance_loss
from ondevice_moe.routing.routers import ClientRouter, Routing, TokenTopKRouter, UniformRouter

__all__ = [
    "ClientRouter",
    "Routing",
    "TokenTopKRouter",
    "UniformRouter",
    "generalist_balance_loss",
    "switch_balance_loss",
]
