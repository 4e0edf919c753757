"""YAML as the toolkit reads recipes: safe (no tags that build objects), without aliases (a
"billion laughs" recipe of a few lines would expand without end) and without duplicate keys
(the second would silently win). Either is a :class:`yaml.YAMLError` naming the line, and so is a
document nested too deeply to read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases and duplicate mapping keys."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.constructor.ConstructorError(
                None, None, f"the alias *{event.anchor} is not allowed: write the value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key '{key}' appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """The YAML document in ``text``, read strictly; one nested past Python's recursion limit (a few
    hundred levels) is a :class:`yaml.YAMLError`, as any other malformed document."""
    try:
        return yaml.load(text, Loader=StrictLoader)
    except RecursionError:
        raise yaml.YAMLError("it nests lists or mappings hundreds of levels deep") from None


def read_mapping(path: Path, fix: str) -> dict[str, Any]:
    """The YAML mapping in file ``path``; an unreadable, malformed or non-mapping file is a
    :class:`UserError` naming it, with ``fix``."""
    from ondevice_moe.errors import UserError

    try:
        raw = load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise UserError(f"{path} cannot be read as YAML ({error})", fix) from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} is not a mapping of keys to values", fix)
    return raw
