"""What a device says of itself: its ``--node-config`` on ``flower-supernode``.

On real devices (Flower's deployment engine) each SuperNode is started with

    flower-supernode ... --node-config 'partition-id=0 data-path="/data/mine" state-dir="/var/lib/ondevice-moe"'

* ``partition-id``: which user entry of the recipe this device is (required);
* ``data-path``: the device's own data, for a user entry ``source: device`` of the recipe: a text
  folder, a ``.jsonl`` file, or a folder saved by ``datasets`` (``save_to_disk``);
* ``state-dir``: where the device keeps what never leaves it — its private experts, routers,
  optimiser state, Flower context and final checkpoints — under ``<state-dir>/<recipe>/``
  (default ``~/.ondevice-moe/devices/partition-<id>``).

Nothing the server sends becomes a path on the device: the recipe's and methods' names are
plain names (:mod:`ondevice_moe.names`), and the server's run folder is never named to a device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ondevice_moe.errors import UserError

PARTITION = "partition-id"
DATA_PATH = "data-path"
STATE_DIR = "state-dir"
REFUSED = "refused"  # the key of the query that tells a node why the server will not use it
FIX = ("start flower-supernode with --node-config 'partition-id=<i> data-path=\"<your data>\" "
       "state-dir=\"<a folder of the device's>\"' (docs/deployment.md)")


@dataclass(frozen=True)
class NodeFacts:
    """A device's ``--node-config``, checked."""

    partition_id: int
    data_path: Path | None
    state_dir: Path

    def folder(self, recipe_name: str) -> Path:
        """The device's run folder for a recipe: its checkpoints and private state live here."""
        return self.state_dir / recipe_name

    def to_json(self) -> str:
        return json.dumps({PARTITION: self.partition_id, DATA_PATH: self.data_path and str(self.data_path)})


NODE_FILE = "node.json"  # in a device's run folder: which device it is, so `eval` and `export` work there


def folder_node(run_dir: Path) -> NodeFacts | None:
    """The device a run folder belongs to (its ``node.json``), or ``None`` for a server's or a simulation's."""
    path = run_dir / NODE_FILE
    if not path.is_file():
        return None
    try:
        facts = json.loads(path.read_text(encoding="utf-8"))
        return node_facts({**facts, STATE_DIR: str(run_dir.parent)})
    except (OSError, ValueError, TypeError, AttributeError) as error:
        raise UserError(f"{path} is damaged ({error})", "it names the device this folder belongs to: restore it, "
                        "or evaluate on the device with the same --node-config again") from None


def node_facts(node_config: dict[str, object]) -> NodeFacts:
    """The device's facts from its node config; a missing or malformed entry is a :class:`UserError`."""
    raw = node_config.get(PARTITION)
    if raw is None:
        raise UserError("this device's --node-config has no partition-id", FIX)
    try:
        partition = int(raw)
    except (TypeError, ValueError):
        raise UserError(f"this device's partition-id {raw!r} is not a whole number", FIX) from None
    if partition < 0 or str(partition) != str(raw).strip():
        raise UserError(f"this device's partition-id {raw!r} is not a whole number from 0", FIX)
    data = node_config.get(DATA_PATH)
    state = node_config.get(STATE_DIR)
    default_state = Path.home() / ".ondevice-moe" / "devices" / f"partition-{partition}"
    return NodeFacts(partition, Path(str(data)).expanduser() if data else None,
                     Path(str(state)).expanduser() if state else default_state)
