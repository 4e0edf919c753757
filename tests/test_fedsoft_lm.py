"""FedSoft's cluster adapters on a language model (FedSoft §3–4 with LoRA centres): centres that
start apart, per-block losses for the importance estimate, sources scored one at a time."""

import copy
from pathlib import Path

import pytest
import torch
from flwr.app import RecordDict
from peft import PeftModel

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.export import export_user
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.likelihood import block_nll
from ondevice_moe.methods.fedsoft import procedure as centres_side
from ondevice_moe.methods.fedsoft.centres import example_losses, mixture_of, responsibilities, split_centres
from ondevice_moe.recipe import load_recipe

TINY = Path(__file__).parent / "recipes" / "tiny-fedsoft-lm.yaml"


def _job(tmp_path: Path, overrides: list[str] | None = None) -> Job:
    return Job(load_recipe(TINY, overrides or []), 0, tmp_path / "run")


def test_lora_centres_start_apart_from_their_own_seeds_and_hold_what_a_client_uploads(tmp_path):
    job = _job(tmp_path)
    first, second = (centres_side.initial_centre(dev.JobDevice(job, 0), centre) for centre in (0, 1))
    assert set(first) == set(dev.upload_reference(job, 0)) and all(".adapters.shared." in n for n in first)
    b_names = [name for name in first if name.endswith("lora_B")]
    assert b_names and all(first[n].abs().sum() > 0 for n in b_names), "a zero B would start the centres equal"
    assert all(not torch.equal(first[n], second[n]) for n in b_names)
    assert all(torch.equal(first[n], centres_side.initial_centre(dev.JobDevice(job, 0), 0)[n]) for n in first), "seeded"


def test_a_block_is_an_example_whose_loss_is_its_mean_next_token_loss(tmp_path):
    job = _job(tmp_path)
    model = dev.build_model(job, 0)
    examples = centres_side.centre_examples(job.method.procedure, dev.JobDevice(job, 0))
    blocks = dev.device_split(job, 0, "train")
    losses = example_losses(model, examples, batch_size=5)
    assert losses.shape == (blocks.shape[0],)
    torch.testing.assert_close(losses, block_nll(model, blocks, 8) / (blocks.shape[1] - 1), rtol=1e-5, atol=1e-5)


def test_a_round_anchors_the_clients_lora_to_both_centres_and_sends_the_lora_with_its_importances(tmp_path):
    job = _job(tmp_path)
    state = RecordDict()
    trainer = dev.restore_trainer(job, 0, None, state)
    chosen = job.method.procedure.begin_round(dev.JobDevice(job, 0, state), trainer, None, 1)
    weights = [chosen["importance_0"], chosen["importance_1"]]
    floor = job.method.procedure.importance_floor  # u_s = max(n_s / n, σ): shares of the blocks, floored
    assert min(weights) >= floor and 1 <= sum(weights) <= 1 + 2 * floor
    tensors, records = dev.upload(job, trainer)
    assert tensors and all(".adapters.shared." in name for name in tensors)
    assert records["mixture"]["pi"] == weights



@pytest.mark.parametrize("method", ["fedsoft", "ifca"])
def test_held_out_importances_score_the_centres_on_the_users_validation_blocks(tmp_path, method):
    """``importance_split: valid``: u_ks (FedSoft) or the lowest-loss centre (IFCA) from the
    centres' losses on the user's validation blocks, not its training blocks; FedEM keeps scoring
    the blocks it trains on."""
    job = _job(tmp_path, [f"methods=[{method}]", "fedsoft.importance_split=valid", "data.valid_tokens=300"])
    valid, train = dev.device_split(job, 0, "valid"), dev.device_split(job, 0, "train")
    assert 1 < valid.shape[0] < train.shape[0]
    assert torch.equal(centres_side.centre_examples(job.method.procedure, dev.JobDevice(job, 0)).blocks, valid)
    trainer = dev.restore_trainer(job, 0, None, RecordDict())
    chosen = job.method.procedure.begin_round(dev.JobDevice(job, 0, RecordDict()), trainer, None, 1)
    model = dev.build_model(job, 0)
    losses = []
    for centre in (0, 1):
        model.load_state_dict(centres_side.initial_centre(dev.JobDevice(job, 0), centre), strict=False)
        losses.append(block_nll(model, valid, 8))
    wins = (torch.stack(losses).argmin(dim=0) == 0).sum().item()
    if method == "fedsoft":
        assert chosen["importance_0"] == pytest.approx(max(wins / valid.shape[0], 1e-4))
    else:
        assert chosen["centre"] == int(torch.stack(losses).sum(dim=1).argmin())
    fedem = _job(tmp_path, ["methods=[fedem]", "fedsoft.importance_split=valid", "data.valid_tokens=300"])
    scored = centres_side.centre_examples(fedem.method.procedure, dev.JobDevice(fedem, 0))
    assert torch.equal(scored.blocks, dev.device_split(fedem, 0, "train"))


def test_each_source_is_scored_alone_by_every_centre_and_a_centre_exports_as_a_peft_adapter(tmp_path):
    result = runner.run_recipe(load_recipe(TINY, ["methods=[fedsoft]"]), tmp_path / "run")
    sources = dev.source_test_blocks(_job(tmp_path))
    assert [name for name, _ in sources] == ["python-code", "bbc-news"]
    centres = result.summary["methods"]["fedsoft"]["centres"]
    assert sorted(centres) == [f"centre_{c}_source_{s}" for c in (0, 1) for s in (0, 1)]
    assert all(1 < value < 1e4 for value in centres.values())
    for user in result.summary["users"]:  # its own model on its training blocks too (FedSoft §5's w̄)
        values = result.summary["methods"]["fedsoft"]["per_user"][user]
        assert 1 < values["train_in"] < 1e4 and values["train_in"] != values["in"]
    report = (tmp_path / "run" / "report.md").read_text()
    assert "each centre (column) on each source's test set" in report
    rows = [line for line in report.splitlines() if line.startswith("| θ_")]
    for row in rows:  # perplexity: the best centre of a source is the lowest
        cells = [cell.strip() for cell in row.strip("|").split("|")[1:]]
        values = [float(cell.strip("*")) for cell in cells]
        assert cells[values.index(min(values))].startswith("**"), row
    assert len(rows) == 2

    # The centres are the server's: kept after the last round, and exported as a plain PEFT adapter.
    job = next(j for j in runner.finished_jobs(tmp_path / "run")[1] if j.method.name == "fedsoft")
    result = export_user(tmp_path / "run", "fedsoft", "news-90", tmp_path / "centre-0", fmt="peft", centre=0)
    [folder] = result.peft_folders
    model = dev.build_model(job, 1)
    dev.load_server_model(job, 0, model)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        base = copy.deepcopy(dev.job_base_model(job).model)
        got = PeftModel.from_pretrained(base, folder).eval()(input_ids=ids).logits
        own = dev.build_model(job, 1)
        dev.load_checkpoint(job, 1, own)
        assert not torch.allclose(own.eval()(input_ids=ids).logits, expected, atol=1e-4), "a centre, not the user's"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="never formed"):
        dev.load_server_model(job, 5, model)


def test_a_fedem_round_trains_both_lora_centres_on_weighted_blocks_and_sends_both(tmp_path):
    job = _job(tmp_path, ["methods=[fedem]"])
    state = RecordDict()
    trainer = dev.restore_trainer(job, 0, None, state)
    received = centres_side.received_centres(dev.JobDevice(job, 0), None)
    chosen = job.method.procedure.begin_round(dev.JobDevice(job, 0, state), trainer, None, 1)
    assert sum(chosen.values()) == pytest.approx(1.0)
    assert trainer.round_state[centres_side.ANCHORS].posteriors.shape == (2, dev.device_split(job, 0, "train").shape[0])
    metrics, blocks = dev.run_local_procedure(job, 0, trainer, seed=0)
    assert metrics["train_loss"] > 0 and blocks == trainer.round_state[centres_side.ANCHORS].posteriors.shape[1]
    tensors, records = dev.upload(job, trainer)
    reference = dev.upload_reference(job, 0)
    assert set(tensors) == set(reference) and all(".adapters.shared." in name for name in tensors)
    assert all(tensors[name].shape == reference[name].shape for name in tensors)
    for centre, trained in split_centres(tensors).items():
        moved = [name for name in trained if not torch.equal(trained[name], received[centre][name])]
        assert moved, f"centre {centre} was not trained"
    assert records["mixture"]["pi"] == [chosen["importance_0"], chosen["importance_1"]]


@pytest.mark.parametrize("block_loss", ["sum", "mean"])
def test_fedems_e_step_scores_a_block_by_its_summed_token_loss_or_the_codes_mean(tmp_path, block_loss):
    """The paper's E-step weighs a block by its likelihood, exp(−Σ token losses); the authors'
    code by exp(−mean token loss). The device's π is the mean of whichever posteriors."""
    job = _job(tmp_path, ["methods=[fedem]", f"fedsoft.fedem_block_loss={block_loss}"])
    trainer = dev.restore_trainer(job, 0, None, RecordDict())
    chosen = job.method.procedure.begin_round(dev.JobDevice(job, 0, RecordDict()), trainer, None, 1)
    blocks = dev.device_split(job, 0, "train")
    model = dev.build_model(job, 0)
    summed = []
    for centre in (0, 1):
        model.load_state_dict(centres_side.initial_centre(dev.JobDevice(job, 0), centre), strict=False)
        summed.append(block_nll(model, blocks, 8))
    scores = torch.stack(summed) / (1 if block_loss == "sum" else blocks.shape[1] - 1)
    expected = responsibilities(scores, [0.5, 0.5])
    tempered = responsibilities(torch.stack(summed) / (blocks.shape[1] - 1), [0.5, 0.5])
    assert (responsibilities(torch.stack(summed), [0.5, 0.5]) - tempered).abs().max() > 1e-3, "the two differ"
    torch.testing.assert_close(trainer.round_state[centres_side.ANCHORS].posteriors, expected, rtol=1e-4, atol=1e-4)
    assert [chosen["importance_0"], chosen["importance_1"]] == pytest.approx(mixture_of(expected), abs=1e-4)
