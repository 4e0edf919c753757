"""Which SuperNode may be which user: a user slot (``partition-id``) belongs to a key.

With SuperNode authentication every node proves a key that an operator registered with the
SuperLink (``flwr supernode register``), and Flower lists each node's public key and when it was
registered and activated (``NodeInfo``). A slot then belongs, for the whole run and across its
restarts, to the registered key that first claims it, or to the key the submitter bound it to up
front (``finetune --federation NAME --bind USER=KEY.pub``); any other node claiming it is refused,
and the refusal is in ``report.md`` and in the command's output. Keys are named by their OpenSSH
fingerprint, the one ``ssh-keygen -lf KEY.pub`` prints.

Without authentication a SuperNode makes itself a fresh key every time it starts and registers it
as it connects: such a key proves nothing and is not held to a slot. The first node to claim a slot
holds it while it answers, and a restarted device takes it back once the old node stops answering
(:meth:`~ondevice_moe.federation.handshake.NodeRoster.refresh`).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable
from pathlib import Path

from ondevice_moe.errors import UserError
from ondevice_moe.federation.server_runs import RunIdentity

BIND_FIX = "give --bind USER=FILE with FILE the device's OpenSSH public key (deviceN.pub, docs/deployment.md)"


def fingerprint(public_key: bytes) -> str | None:
    """The OpenSSH fingerprint (``SHA256:...``) of a key as Flower holds it (PEM), or of an OpenSSH
    public key line; ``None`` for no key (a node without authentication)."""
    if not public_key:
        return None
    from cryptography.hazmat.primitives import serialization

    try:
        if public_key.lstrip().startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(public_key)
        else:
            key = serialization.load_ssh_public_key(public_key.strip())
        line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    except (ValueError, TypeError, IndexError) as error:
        raise ValueError(f"not a public key ({error})") from None
    blob = base64.b64decode(line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def key_file_fingerprint(path: Path) -> str:
    """The fingerprint of an OpenSSH public key file (``--bind USER=FILE``)."""
    try:
        found = fingerprint(path.expanduser().read_bytes())
    except OSError as error:
        raise UserError(f"cannot read the public key {path} ({error.strerror})", BIND_FIX) from None
    except ValueError as error:
        raise UserError(f"{path} is {error}", BIND_FIX) from None
    if found is None:
        raise UserError(f"{path} is empty", BIND_FIX)
    return found


def parse_bindings(pairs: Iterable[str], users: list[str]) -> dict[int, str]:
    """``USER=FILE`` pairs as slot → key fingerprint; an unknown user, a slot bound twice or one key
    for two users is a :class:`UserError`."""
    bound: dict[int, str] = {}
    for pair in pairs:
        user, sep, file = pair.partition("=")
        if not sep or not user or not file:
            raise UserError(f"--bind {pair!r} is not USER=FILE", BIND_FIX)
        if user not in users:
            raise UserError(f"--bind names user {user!r}, which the recipe does not have", f"use one of {users}")
        slot = users.index(user)
        if slot in bound:
            raise UserError(f"--bind names user {user!r} twice", "bind each user to one key")
        bound[slot] = key_file_fingerprint(Path(file))
    holders = list(bound.values())
    if len(set(holders)) != len(holders):
        raise UserError("--bind gives one key to two users", "give each device its own key pair")
    return bound


SELF_REGISTERED_S = 1.0  # a SuperNode without authentication registers and activates in one go


def registered_ahead(node: object) -> bool:
    """Whether the node's key was registered before the node first came online (by an operator, as
    SuperNode authentication requires), rather than by the SuperNode as it connected."""
    from datetime import datetime

    try:
        registered = datetime.fromisoformat(node.registered_at)
        activated = datetime.fromisoformat(node.last_activated_at)
    except (ValueError, TypeError, AttributeError):
        return False
    return (activated - registered).total_seconds() >= SELF_REGISTERED_S


def node_fingerprints(nodes: Iterable[object]) -> dict[int, str | None]:
    """Node id → the fingerprint of its registered key, or ``None`` for a node whose key proves nothing
    (one it made itself as it connected), from Flower's ``NodeInfo``s."""
    found: dict[int, str | None] = {}
    for node in nodes:
        try:
            found[int(node.node_id)] = fingerprint(bytes(node.public_key)) if registered_ahead(node) else None
        except (ValueError, AttributeError):
            found[int(node.node_id)] = None
    return found


def claim_problem(identity: RunIdentity | None, device: int, node: int, key: str | None) -> str | None:
    """Why node ``node`` (with key ``key``) may not hold slot ``device`` in this run, or ``None`` when it
    may. A keyless node is judged by the liveness rule instead (the caller's)."""
    if identity is None or key is None:
        return None
    holder = identity.bound.get(device) or identity.claims.get(device)
    if holder is not None and holder != key:
        how = "bound to" if device in identity.bound else "held in this run by"
        return f"node {node} (key {key}) claims partition-id {device}, which is {how} key {holder}"
    other = next((slot for slot, held in {**identity.claims, **identity.bound}.items()
                  if held == key and slot != device), None)
    if other is not None:
        return f"node {node} (key {key}) claims partition-id {device}, but its key holds partition-id {other}"
    return None


class SlotKeeper:
    """The run's slots and keys as the server applies them: the nodes' keys as Flower lists them
    (:meth:`see`), and for each claim whether it may stand (:meth:`problem`) or now stands (:meth:`accept`)."""

    def __init__(self, identity: RunIdentity | None) -> None:
        self.identity = identity
        self.keys: dict[int, str | None] = {}
        self._grid: object | None = None

    def see(self, grid: object) -> None:
        """Read every node's key from the SuperLink (``Grid.get_nodes``); a node not seen yet is
        looked up on this grid again when it is judged."""
        self._grid = grid
        self.keys = node_fingerprints(grid.get_nodes())

    def key_of(self, node: int) -> str | None:
        if node not in self.keys and self._grid is not None:
            self.see(self._grid)
        return self.keys.get(node)

    def problem(self, device: int, node: int) -> str | None:
        return claim_problem(self.identity, device, node, self.key_of(node))

    def accept(self, device: int, node: int) -> None:
        """``node`` now holds ``device``: its key holds the slot for the rest of the run."""
        key = self.key_of(node)
        if self.identity is not None and key is not None and self.identity.claims.get(device) != key:
            self.identity.claim(device, key)
