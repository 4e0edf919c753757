"""Nothing a device tells the server names a place on the device.

A device's error goes to the server (and into its log, report and database), and a message that
names a file is a probe: a server could learn what exists on the device by asking for it. So an
error leaves a real device without its paths: the device's own folders by name (``<data-path>``,
``<state-dir>``), any other path as ``<a path on the device>``. The device's own log keeps the
error whole (:func:`~ondevice_moe.federation.client_app.device_side`).
"""

from __future__ import annotations

import re
from pathlib import Path

from ondevice_moe.federation.node import NodeFacts

ELSEWHERE = "<a path on the device>"
# A path: from a / or ~ not inside a word or a URL, to the next space, quote or closing bracket.
_PATH = re.compile(r"(?<![\w.:/<>-])[~/][^\s'\"`<>|,;()\[\]{}]*")


def path_free(text: str, node: NodeFacts | None) -> str:
    """``text`` with every path on the device replaced by what it is (``<data-path>``,
    ``<state-dir>``) or by :data:`ELSEWHERE`."""
    named: list[tuple[str, str]] = []
    if node is not None:
        if node.data_path is not None:
            named.append((str(node.data_path), "<data-path>"))
        named.append((str(node.state_dir), "<state-dir>"))
    named.append((str(Path.home()), "<home>"))
    for place, label in sorted(named, key=lambda pair: -len(pair[0])):
        if len(place) > 1:
            text = re.sub(re.escape(place) + r"(?:/[^\s'\"`<>|,;()\[\]{}]*)?", label, text)
    return _PATH.sub(ELSEWHERE, text)
