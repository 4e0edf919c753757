"""Flower's object pulls, asked again after milliseconds rather than a second.

In Flower 1.41 a message travels as its head and its objects (a packed message: the index and one
buffer, :mod:`~ondevice_moe.federation.wire`), and whoever asks for an object that is not stored yet
where it asks waits 1 s before asking again, then 2, 4, 8 and 10 s (``PULL_INITIAL_BACKOFF``,
``PULL_BACKOFF_CAP``). On a round's every hop one side asks while the other is still storing:

- the device asks its SuperNode for the message the SuperNode is still pulling from the SuperLink
  (the SuperNode hands out the task before its objects have arrived);
- the SuperNode asks the SuperLink for objects the server is still pushing;
- the server asks the SuperLink for a reply whose objects the SuperNode is still pushing.

So each hop lost about a second even for a message of a few kilobytes (a round of the tiny model on
three localhost devices: 0.15 s of work, 3–5 s of wire). :func:`prompt` makes a process's Flower
pulls retry after :data:`FIRST_RETRY_S`, doubling up to Flower's own cap: a few more requests in the
first second, none more after it. Nothing else of the pull changes (its threads, its time limit, its
tries per object).
"""

from __future__ import annotations

from functools import partial
from types import ModuleType

FIRST_RETRY_S = 0.02
PULLS = ("pull_objects", "pull_and_inflate_object_from_tree")


def prompt(module: ModuleType) -> None:
    """Make ``module``'s Flower object pulls (the functions of :data:`PULLS` it imported) retry first
    after :data:`FIRST_RETRY_S`; a second call changes nothing. A module that imported none of them is
    a :class:`RuntimeError`: the Flower installed is not the one this was written against."""
    from flwr.supercore.inflatable import inflatable_utils

    pulls = {name: getattr(module, name) for name in PULLS if hasattr(module, name)}
    if not pulls:
        raise RuntimeError(f"{module.__name__} pulls Flower's objects in a way this toolkit does not know")
    for name, pull in pulls.items():
        if pull is getattr(inflatable_utils, name):
            setattr(module, name, partial(pull, initial_backoff=FIRST_RETRY_S))


def prompt_server() -> None:
    """The server's pulls of the devices' replies from the SuperLink (Flower's HTTP grid)."""
    from flwr.superlink.grid import http_grid

    prompt(http_grid)


def prompt_supernode() -> None:
    """A SuperNode's pulls of its messages from the SuperLink."""
    from flwr.supernode import start_client_internal

    prompt(start_client_internal)


def prompt_device() -> None:
    """A device's pulls of its message from its SuperNode (``ondevice-moe device``)."""
    from flwr.supernode.runtime import run_clientapp

    prompt(run_clientapp)
