"""``--set key.sub=value`` overrides of a raw recipe mapping (values parsed as YAML)."""

from __future__ import annotations

from typing import Any, NoReturn

import yaml

from ondevice_moe import strict_yaml
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
            node = node[_index(node, part, ".".join(parts[: depth + 1]))]
        elif isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            _not_a_section(key, parts[:depth])
    last = parts[-1]
    value = _parse_value(key, text)
    if isinstance(node, list):
        node[_index(node, last, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        _not_a_section(key, parts[:-1])


def _not_a_section(key: str, path: list[str]) -> NoReturn:
    raise UserError(f"override '{key}': '{'.'.join(path)}' is not a section", "check the key path")


def _parse_value(key: str, text: str) -> Any:
    """The YAML value of an override (empty text: null)."""
    try:
        return strict_yaml.load(text) if text else None
    except yaml.YAMLError as error:
        problem = " ".join(str(getattr(error, "problem", None) or error).split())
        raise UserError(f"override '{key}': the value {text!r} is not valid YAML ({problem})",
                        "close every bracket and quote, e.g. --set 'methods=[fedavg, local]'") from None


def _index(node: list, part: str, key: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise UserError(f"override '{key}': '{part}' is not an index of a list of {len(node)}", "use 0-based indices")
    return int(part)
