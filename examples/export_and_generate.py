"""Take one user's model out of a finished run as a PEFT adapter, load it with ``peft``, and write.

    python examples/finetune_a_recipe.py                       # first, a run: runs/quickstart
    python examples/export_and_generate.py runs/quickstart --user code --prompt "def read_lines(path):"

The export (``ondevice-moe export`` from Python) writes a PEFT adapter that
``transformers`` and ``peft`` load without this toolkit. Online, the adapter's config names
the base on the Hub, and ``AutoPeftModelForCausalLM.from_pretrained(folder)`` is all it takes;
offline, as here, the base the run trained on comes from the toolkit's loader and
``PeftModel.from_pretrained`` puts the adapter on it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from peft import PeftModel

from ondevice_moe import load_recipe
from ondevice_moe.export import export_user
from ondevice_moe.models.registry import load_base_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished run folder")
    parser.add_argument("--method", default="fedavg", help="FedAvg's model is one PEFT adapter")
    parser.add_argument("--user", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--to", type=Path, help="the export folder (default: RUN/export-METHOD-USER)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()

    folder = args.to or args.run / f"export-{args.method}-{args.user}"
    export = export_user(args.run, args.method, args.user, folder, force=True)
    print(f"exported {args.method} of {args.user} to {export.folder}")

    recipe = load_recipe(args.run / "recipe.yaml")
    base = load_base_model(recipe.model.name, recipe.model.dtype, seed=recipe.seed)  # the run's own base
    model = PeftModel.from_pretrained(base.model, str(folder)).eval()  # nothing of ondevice_moe from here on
    tokenizer = base.tokenizer

    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=args.max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = output[0, ids.shape[1]:]
    print(args.prompt + tokenizer.decode(new, skip_special_tokens=True))
    print(f"({new.numel()} new tokens)")


if __name__ == "__main__":
    main()
