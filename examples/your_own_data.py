"""Fine-tune on your own text: one user per file or folder, FedAvg against CoMiGS-1G1S.

    python examples/your_own_data.py alice=~/notes/ "bob=~/mail.jsonl#body" "carol=~/chats/*.csv#message"

Each ``USER=PATH[#FIELD]`` is one device's data: a ``.txt``/``.md`` file or a folder of them
(a document per file), ``.jsonl``/``.json``, ``.csv``/``.tsv`` or ``.parquet`` (a document per
row, its text in the column ``FIELD``, default ``text``), a glob, or a folder written by
``datasets``' ``save_to_disk``. Everything is read through ``datasets`` where it lies: nothing is copied or
uploaded. The recipe is the quickstart's with your users in place of its own, and is written
to the run folder as ``recipe.yaml``. To check the data first (token counts per user, no
training), the CLI's ``ondevice-moe finetune RECIPE --dry-run`` reads it the same way.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ondevice_moe
from ondevice_moe.errors import UserError


def user_entry(argument: str) -> dict[str, str]:
    """``USER=PATH[#FIELD]`` as a recipe's user entry of ``source: files``."""
    name, sep, where = argument.partition("=")
    path, _, field = where.partition("#")
    if not sep or not name or not path:
        raise SystemExit(f"error: '{argument}' is not USER=PATH[#FIELD] (e.g. alice=~/notes/ or bob=mail.jsonl#body)")
    return {"name": name, "source": "files", "path": os.path.expanduser(path), "text_field": field or "text"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("users", nargs="+", metavar="USER=PATH[#FIELD]",
                        help="a device's data and the column holding its text, e.g. bob=~/mail.jsonl#body")
    parser.add_argument("--model", default="smollm2-135m", help="the base model (alias, hub id or folder)")
    parser.add_argument("--output", default="runs/own-data")
    args = parser.parse_args()

    overrides = {
        "model.name": args.model,
        "data.users": [user_entry(argument) for argument in args.users],
        "data.train_tokens": 4096,  # per user: raise these for real work (and federation.rounds)
        "data.valid_tokens": 1024,
        "data.test_tokens": 512,
    }
    try:
        result = ondevice_moe.finetune("quickstart", overrides, output=args.output)
    except UserError as error:  # one message naming the problem and the fix
        raise SystemExit(f"error: {error}") from None
    for method in result.methods:
        figures = result.summary["methods"][method]["per_user"]
        print(method, {user: round(values["in"], 2) for user, values in figures.items()})
    print(f"report: {result.report}")


if __name__ == "__main__":
    main()
