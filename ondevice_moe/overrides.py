"""``--set key.sub=value`` overrides of a raw recipe mapping (values parsed as YAML)."""

from __future__ import annotations

from typing import Any

import yaml

from ondevice_moe.errors import UserError


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply ``a.b.c=value`` (value parsed as YAML) to the raw recipe mapping."""
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise UserError(f"override '{override}' is not of the form key=value", "write e.g. --set federation.rounds=5")
    parts = key.split(".")
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = _list_item(node, part, ".".join(parts[: depth + 1]))
        else:
            node = node.setdefault(part, {})
    last = parts[-1]
    value = yaml.safe_load(text) if text else None
    if isinstance(node, list):
        node[_index(node, last, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        raise UserError(f"override '{key}': '{'.'.join(parts[:-1])}' is not a section", "check the key path")


def _index(node: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise UserError(f"override '{key}': '{part}' is not an index of a list of {len(node)}", "use 0-based indices")
    return int(part)


def _list_item(node: list, part: str, key: str) -> Any:
    return node[_index(node, part, key)]
