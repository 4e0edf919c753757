"""Where a run's time goes: the top frames of a ``py-spy`` profile, by inclusive wall time.

Record a run with every thread's waits included (``--idle``; ``pip install py-spy`` first), then read it:

    py-spy record --idle -r 50 -f raw -o profile.txt -- \\
        ondevice-moe finetune recipes/flow-digits.yaml --set 'methods=[{name: fed-ft, label: fedavg}]' \\
        --set federation.rounds=30 --output runs/profiled
    python benchmarks/profile_top.py profile.txt --rate 50 [--top 25] [--match ondevice_moe/ flwr/]

Prints a markdown table: each frame whose file matches one of ``--match`` (default: the toolkit's
and Flower's code), the seconds of samples with that frame on the stack (a frame counted once per
sample however deep it recurs), most first. Threads add up: a frame that two threads wait in
counts both waits.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Sequence
from pathlib import Path


def top_frames(lines: Sequence[str], rate: float, match: Sequence[str], top: int) -> list[tuple[str, float]]:
    """``(frame, seconds)`` of the ``top`` frames matching ``match``, from py-spy's raw (collapsed) lines."""
    seconds: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        for frame in set(stack.split(";")[1:]):  # the first entry names the process
            if any(part in frame for part in match):
                seconds[frame] += int(count) / rate
    return seconds.most_common(top)


def main(argv: Sequence[str] | None = None) -> list[tuple[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="py-spy record -f raw output")
    parser.add_argument("--rate", type=float, default=100.0, help="the samples per second py-spy took (-r)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", nargs="+", default=["ondevice_moe/", "flwr/"])
    args = parser.parse_args(argv)
    frames = top_frames(args.profile.read_text(encoding="utf-8").splitlines(), args.rate, args.match, args.top)
    print("| frame | seconds |\n|---|---|")
    for frame, spent in frames:
        print(f"| `{frame}` | {spent:.2f} |")
    return frames


if __name__ == "__main__":
    main()
