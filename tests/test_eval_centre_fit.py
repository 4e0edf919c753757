"""eval/centre_fit.py: each centre's perplexity on every device's training and test blocks."""

import math

import pytest
from eval_scripts import load_eval_script

from ondevice_moe import runner
from ondevice_moe.federation import device as dev
from ondevice_moe.likelihood import block_nll

centre_fit = load_eval_script("centre_fit")



def test_a_devices_centre_is_its_last_choice_or_its_largest_weight():
    records = [
        {"kind": "train", "method": "ifca", "user": "a", "round": 1, "centre": 1},
        {"kind": "train", "method": "ifca", "user": "a", "round": 2, "centre": 0},
        {"kind": "eval", "method": "ifca", "user": "a", "round": 2, "centre": 1},
        {"kind": "train", "method": "fedsoft", "user": "a", "round": 1, "importance_0": 0.3, "importance_1": 0.7},
        {"kind": "train", "method": "fedsoft", "user": "b", "round": 1, "importance_0": 0.9, "importance_1": 0.1},
    ]
    assert centre_fit.centres_chosen(records, "ifca") == {"a": 0}
    assert centre_fit.centres_chosen(records, "fedsoft") == {"a": 1, "b": 0}


def test_won_by_memory_means_best_on_training_blocks_and_not_on_test_blocks():
    memorised = centre_fit.DeviceFit("a", 1, train_ppl=[20.0, 9.0], test_ppl=[30.0, 40.0])
    fair = centre_fit.DeviceFit("b", 1, train_ppl=[20.0, 9.0], test_ppl=[40.0, 30.0])
    behind = centre_fit.DeviceFit("c", 0, train_ppl=[20.0, 9.0], test_ppl=[30.0, 40.0])
    assert memorised.won_by_memory and not fair.won_by_memory
    assert not behind.wins_training and not behind.won_by_memory


def test_a_finished_run_is_scored_from_its_saved_centres(ifca_run, capsys):
    run = ifca_run
    [fits] = centre_fit.centre_fits(run, None).values()
    job = next(j for j in runner.finished_jobs(run)[1] if j.method.name == "ifca")
    assert [fit.user for fit in fits] == job.recipe.user_names
    model = dev.build_model(job, 0)
    length = job.recipe.data.context_length
    for centre in (0, 1):
        dev.load_server_model(job, centre, model)
        for device, fit in enumerate(fits):
            for split, measured in (("train", fit.train_ppl), ("test", fit.test_ppl)):
                nll = block_nll(model, dev.device_split(job, device, split), 8) / (length - 1)
                assert measured[centre] == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)
    centre_fit.main([str(run)])
    printed = capsys.readouterr().out
    assert f"| {fits[0].user} | c_{fits[0].centre} | c_0 " in printed
    assert f"Devices won by memory: {sum(f.won_by_memory for f in fits)} of {len(fits)}" in printed

    with pytest.raises(SystemExit, match="no finished FedSoft"):
        centre_fit.main([str(run), "--method", "fedsoft"])
