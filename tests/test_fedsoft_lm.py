"""FedSoft's cluster adapters on a language model (FedSoft §3–4 with LoRA centres): centres that
start apart, per-block losses for the importance estimate, sources scored one at a time."""

from pathlib import Path

import torch
from flwr.app import RecordDict

from ondevice_moe import runner
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.methods.fedsoft.centres import example_losses
from ondevice_moe.recipe import load_recipe
from ondevice_moe.training import block_nll

TINY = Path(__file__).parent / "recipes" / "tiny-fedsoft-lm.yaml"


def _job(tmp_path: Path, overrides: list[str] | None = None) -> Job:
    return Job(load_recipe(TINY, overrides or []), 0, tmp_path / "run")


def test_lora_centres_start_apart_from_their_own_seeds_and_hold_what_a_client_uploads(tmp_path):
    job = _job(tmp_path)
    first, second = dev.initial_centre(job, 0), dev.initial_centre(job, 1)
    assert set(first) == set(dev.upload_reference(job, 0)) and all(".adapters.shared." in n for n in first)
    b_names = [name for name in first if name.endswith("lora_B")]
    assert b_names and all(first[n].abs().sum() > 0 for n in b_names), "a zero B would start the centres equal"
    assert all(not torch.equal(first[n], second[n]) for n in b_names)
    assert all(torch.equal(first[n], dev.initial_centre(job, 0)[n]) for n in first), "seeded"


def test_a_block_is_an_example_whose_loss_is_its_mean_next_token_loss(tmp_path):
    job = _job(tmp_path)
    model = dev.build_model(job, 0)
    examples = dev.centre_examples(job, 0)
    blocks = dev.device_split(job, 0, "train")
    losses = example_losses(model, examples, batch_size=5)
    assert losses.shape == (blocks.shape[0],)
    torch.testing.assert_close(losses, block_nll(model, blocks, 8) / (blocks.shape[1] - 1), rtol=1e-5, atol=1e-5)


def test_a_round_anchors_the_clients_lora_to_both_centres_and_sends_the_lora_with_its_importances(tmp_path):
    job = _job(tmp_path)
    state = RecordDict()
    trainer = dev.restore_trainer(job, 0, None, state)
    chosen = dev.anchor_to_centres(job, 0, trainer, None, state, server_round=1)
    weights = [chosen["importance_0"], chosen["importance_1"]]
    floor = job.method.procedure.centres.importance_floor  # u_s = max(n_s / n, σ): shares of the blocks, floored
    assert min(weights) >= floor and 1 <= sum(weights) <= 1 + 2 * floor
    tensors, records = dev.upload(job, trainer)
    assert tensors and all(".adapters.shared." in name for name in tensors)
    assert records["mixture"]["pi"] == weights


def test_each_source_of_the_mixtures_is_scored_alone_and_every_centre_on_each(tmp_path):
    result = runner.run_recipe(load_recipe(TINY, ["methods=[fedsoft]"]), tmp_path / "run")
    sources = dev.source_test_blocks(_job(tmp_path))
    assert [name for name, _ in sources] == ["python-code", "bbc-news"]
    centres = result.summary["methods"]["fedsoft"]["centres"]
    assert sorted(centres) == [f"centre_{c}_source_{s}" for c in (0, 1) for s in (0, 1)]
    assert all(1 < value < 1e4 for value in centres.values())
    report = (tmp_path / "run" / "report.md").read_text()
    assert "each centre (column) on each source's test set" in report
    rows = [line for line in report.splitlines() if line.startswith("| θ_")]
    for row in rows:  # perplexity: the best centre of a source is the lowest
        cells = [cell.strip() for cell in row.strip("|").split("|")[1:]]
        values = [float(cell.strip("*")) for cell in cells]
        assert cells[values.index(min(values))].startswith("**"), row
    assert len(rows) == 2
