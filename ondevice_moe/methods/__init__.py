"""Methods: which experts a device holds, which of them the server aggregates,
and how the device trains them. One registry for CoMiGS and its baselines."""

from ondevice_moe.methods.base import Method, Role
from ondevice_moe.methods.registry import LM_METHODS, METHODS, build_method

__all__ = ["LM_METHODS", "METHODS", "Method", "Role", "build_method"]
