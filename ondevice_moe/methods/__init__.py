"""Methods: a layout of experts per device, a local procedure and a server rule,
each method in its own folder; :mod:`ondevice_moe.methods.registry` names them."""

from ondevice_moe.methods.base import Method, MethodContext, MethodOptions, Role
from ondevice_moe.methods.registry import METHODS, build_method, method_for, method_options

__all__ = [
    "METHODS", "Method", "MethodContext", "MethodOptions", "Role", "build_method", "method_for", "method_options",
]
