"""Does a cluster centre win its devices by memory? Each centre's perplexity on every device's
training blocks against its test blocks (FedSoft §5's IFCA, FedSoft and FedEM on a language model).

Usage: python eval/centre_fit.py RUN [RUN ...] [--method METHOD ...]

A device chooses a centre by its loss on the device's training blocks (IFCA's assignment, FedSoft's
importances, FedEM's E-step: FedSoft Alg. 1 lines 5–10). Once a centre has been averaged from a
device's own model, it has seen that device's blocks: on a few dozen blocks it can win them by
having memorised them while doing worse on the device's unseen text. For every finished FedSoft, IFCA
or FedEM method of a language-modelling RUN (the centres from ``checkpoints/<method>/server.safetensors``)
this prints, per device, the centre it ended on (IFCA's last choice, or the largest of FedSoft's
importances or FedEM's π in its last round) and every centre's perplexity on the device's training
and test blocks; then, per centre, its devices and their mean perplexities. A device is *won by memory*
when its centre has the lowest training perplexity of the centres but not the lowest test perplexity.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from centred_runs import centred_jobs, final_centres, over_runs

from ondevice_moe.federation import device as dev
from ondevice_moe.likelihood import block_nll
from ondevice_moe.report import MetricsLog


@dataclass(frozen=True)
class DeviceFit:
    """One device: the centre it ended on and every centre's perplexity on its blocks."""

    user: str
    centre: int
    train_ppl: list[float]
    test_ppl: list[float]

    @property
    def wins_training(self) -> bool:
        return self.centre == _lowest(self.train_ppl)

    @property
    def won_by_memory(self) -> bool:
        return self.wins_training and self.centre != _lowest(self.test_ppl)


def _lowest(values: list[float]) -> int:
    return min(range(len(values)), key=values.__getitem__)


def centres_chosen(records: list[dict], method: str) -> dict[str, int]:
    """Each user's centre in its last training round: IFCA's ``centre``, or the largest of the
    ``importance_<s>`` weights (FedSoft's u_k, FedEM's π)."""
    chosen = {}
    for record in records:
        if record.get("kind") != "train" or record.get("method") != method or "user" not in record:
            continue
        if "centre" in record:
            chosen[record["user"]] = int(record["centre"])
            continue
        weights = {int(key.removeprefix("importance_")): value for key, value in record.items()
                   if key.startswith("importance_")}
        if weights:
            chosen[record["user"]] = max(weights, key=weights.__getitem__)
    return chosen


def centre_fits(run: Path, methods: list[str] | None) -> dict[str, list[DeviceFit]]:
    """Every device's fit to every centre, per centred method of ``run``."""
    records = MetricsLog(run / "metrics.jsonl").read()
    fits = {}
    for job in centred_jobs(run, methods):
        chosen = centres_chosen(records, job.method.name)
        model = dev.build_model(job, 0)
        length, batch = job.recipe.data.context_length, job.recipe.data.eval_batch_size
        users = job.recipe.user_names
        perplexity: dict[str, list[list[float]]] = {"train": [], "test": []}
        for centre in final_centres(job):
            model.load_state_dict(centre, strict=False)
            for split, rows in perplexity.items():
                rows.append([math.exp(float((block_nll(model, dev.device_split(job, k, split), batch)
                                             / (length - 1)).mean())) for k in range(len(users))])
        train, test = perplexity["train"], perplexity["test"]
        fits[job.method.name] = [DeviceFit(user, chosen[user], [row[k] for row in train], [row[k] for row in test])
                                 for k, user in enumerate(users) if user in chosen]
    return fits


def _device_table(run: Path, method: str, fits: list[DeviceFit]) -> str:
    lines = [f"## {run}: {method}", "", "| device | its centre | train ppl per centre | test ppl per centre "
             "| won by memory |", "|---|---|---|---|---|"]
    for fit in fits:
        train = ", ".join(f"c_{s} {value:.2f}" for s, value in enumerate(fit.train_ppl))
        test = ", ".join(f"c_{s} {value:.2f}" for s, value in enumerate(fit.test_ppl))
        lines.append(f"| {fit.user} | c_{fit.centre} | {train} | {test} | {'yes' if fit.won_by_memory else 'no'} |")
    return "\n".join(lines)


def _centre_table(fits: list[DeviceFit]) -> str:
    lines = ["| centre | its devices | their mean train ppl on it | their mean test ppl on it "
             "| their mean test ppl on the best other centre |", "|---|---|---|---|---|"]
    for centre in sorted({fit.centre for fit in fits}):
        own = [fit for fit in fits if fit.centre == centre]
        others = [min(v for s, v in enumerate(fit.test_ppl) if s != centre) for fit in own]
        lines.append(f"| c_{centre} | {len(own)} | {statistics.fmean(f.train_ppl[centre] for f in own):.2f} "
                     f"| {statistics.fmean(f.test_ppl[centre] for f in own):.2f} | {statistics.fmean(others):.2f} |")
    won = sum(fit.won_by_memory for fit in fits)
    lines += ["", f"Devices won by memory: {won} of {len(fits)} "
                  f"(their centre fits their training blocks best in {sum(f.wins_training for f in fits)})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    for run, fits in over_runs(argv, __doc__.split("\n\n")[0], centre_fits):
        for method, rows in fits.items():
            print(_device_table(run, method, rows), end="\n\n")
            print(_centre_table(rows), end="\n\n")


if __name__ == "__main__":
    main()
