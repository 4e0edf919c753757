"""Installed versions of the toolkit and the libraries a run or an export depends on."""

from __future__ import annotations

from importlib import metadata

VERSIONED = ("ondevice-moe", "peft", "flwr", "torch", "transformers")


def versions() -> dict[str, str]:
    """``{package: version}`` for :data:`VERSIONED` (``not installed`` for a missing one)."""
    found = {}
    for package in VERSIONED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found
