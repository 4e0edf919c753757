"""eval/new_users.py: a new single-domain user picks a centre on half its blocks, scored on the rest."""

import math

import pytest
import torch
from eval_scripts import load_eval_script
from safetensors.torch import load_file, save_file

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.likelihood import block_nll
from ondevice_moe.methods.fedsoft import procedure as centres_side

new_users = load_eval_script("new_users")



def test_the_pick_is_made_on_the_first_half_and_judged_on_the_second():
    # centre 1 is better on the first two blocks, centre 0 on the last two: a wrong pick
    losses = torch.tensor([[3.0, 3.0, 2.0, 2.2],
                           [2.0, 2.0, 2.5, 2.5]])
    pick = new_users.pick_centre(losses, "code")
    assert pick.picked == 1 and not pick.right
    assert pick.ppl == pytest.approx([math.exp(2.1), math.exp(2.5)])
    assert pick.margin_pct == pytest.approx(100 * (2.1 - 2.5))  # the runner-up (centre 0) is better: negative
    assert pick.margin_se == pytest.approx(100 * torch.tensor([-0.5, -0.3]).std().item() / math.sqrt(2))
    flipped = new_users.pick_centre(losses.flip(0), "code")
    assert flipped.picked == 0 and not flipped.right


def test_a_pick_needs_two_centres_and_two_blocks():
    with pytest.raises(UserError, match="test_tokens"):
        new_users.pick_centre(torch.ones(2, 1), "news")
    with pytest.raises(UserError, match="two centres"):
        new_users.pick_centre(torch.ones(1, 4), "news")


def test_a_finished_run_is_scored_from_its_saved_centres(ifca_run, capsys):
    run = ifca_run
    picks = new_users.new_user_picks(run, None)["ifca"]
    job = next(j for j in runner.finished_jobs(run)[1] if j.method.name == "ifca")
    model = dev.build_model(job, 0)
    sources = dev.source_test_blocks(job)
    assert [pick.source for pick in picks] == [name for name, _ in sources]
    for pick, (_, blocks) in zip(picks, sources, strict=True):
        half = blocks[blocks.shape[0] // 2:]
        for centre in (0, 1):
            dev.load_server_model(job, centre, model)
            nll = block_nll(model, half, 8) / (blocks.shape[1] - 1)
            assert pick.ppl[centre] == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)
    new_users.main([str(run)])
    printed = capsys.readouterr().out
    assert "| ifca | python-code | c_" in printed and "| ifca | 1 | " in printed

    # A centre nobody chose is offered at its starting value, as the clients see it.
    server = dev.server_checkpoint_path(job)
    save_file({k: v for k, v in load_file(str(server)).items() if not k.startswith("cluster_1/")}, str(server))
    [code, _] = new_users.new_user_picks(run, ["ifca"])["ifca"]
    model.load_state_dict(centres_side.initial_centre(dev.JobDevice(job, 0), 1), strict=False)
    half = sources[0][1][sources[0][1].shape[0] // 2:]
    unformed = block_nll(model, half, 8) / (half.shape[1] - 1)
    assert code.ppl[1] == pytest.approx(math.exp(float(unformed.mean())), rel=1e-5)

    with pytest.raises(SystemExit, match="no finished FedSoft"):
        new_users.main([str(run), "--method", "fedsoft"])
