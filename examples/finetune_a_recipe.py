"""Fine-tune a bundled recipe from Python and print each method's test perplexity per user.

    python examples/finetune_a_recipe.py                      # the quickstart: SmolLM2-135M, ~2 minutes
    python examples/finetune_a_recipe.py --recipe demo        # the README's table, ~7 minutes
    python examples/finetune_a_recipe.py --model tiny-gpt2    # a 2-layer random GPT-2: seconds, for a dry run

The run folder (default ``runs/<recipe>``) holds the recipe, ``metrics.jsonl``, ``report.md``,
``plots/`` and ``checkpoints/``; running the same command again resumes or, once finished,
only rewrites the report.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every bundled asset is on disk: never reach for the Hub

import ondevice_moe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="quickstart", help="a bundled recipe's name or a recipe file")
    parser.add_argument("--model", help="another base model, e.g. tiny-gpt2 (the recipe's model.name)")
    parser.add_argument("--output", help="the run folder (default: runs/<recipe name>)")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    overrides = {"model.name": args.model} if args.model else {}
    result = ondevice_moe.finetune(args.recipe, overrides, output=args.output, seed=args.seed,
                                   on_round=lambda done, total, line: print(line, flush=True))

    users = result.recipe.user_names
    print(f"\ntest perplexity after {result.recipe.federation.rounds} rounds (lower is better)")
    print(f"{'method':<16}" + "".join(f"{user:>12}" for user in users) + f"{'mean':>12}")
    for method in result.methods:
        figures = result.summary["methods"][method]
        per_user = "".join(f"{figures['per_user'][user]['in']:>12.2f}" for user in users)
        print(f"{method:<16}{per_user}{figures['mean_in']:>12.2f}")
    print(f"\nreport: {result.report}")


if __name__ == "__main__":
    main()
