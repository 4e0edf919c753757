"""The client benchmarks run end to end (one step, tiny models), so they cannot break silently."""

import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ondevice_moe.errors import UserError

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY_RUN = ["--steps", "1", "--batch", "2", "--context", "8", "--device", "cpu"]
# The recipes in recipes/ give each device one core; on 2 cores one Ray worker does a one-round run sooner
# (a second only imports torch and transformers again).
ONE_WORKER = "federation.cpus_per_client=2"


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import comigs_client
    import hermes_client
    import quantization

    return {"comigs": comigs_client, "hermes": hermes_client, "quantization": quantization}


def _assert_side_by_side(figures: dict, peer: str, ours: str, *more: str) -> None:
    assert set(figures["memory_mib"]) == {peer, ours, *more} <= set(figures["step_s"])
    for name in (peer, ours):
        assert figures["step_s"][name] > 0
        assert figures["memory_mib"][name]["peak_mib"] > 0
    for ratio in ("step_time_ratio", "peak_memory_ratio"):
        assert math.isfinite(figures[ratio]) and figures[ratio] > 0


def test_comigs_benchmark_runs_one_step_on_tiny_llama_eager_compiled_and_profiled(benchmarks, capsys):
    figures = benchmarks["comigs"].main(["--model", "tiny-llama", "--compile", "--profile", *TINY_RUN])
    _assert_side_by_side(figures, "peft-lora", "comigs-1G1S")
    params = figures["adapter_params"]
    assert params["peft-lora"] == params["comigs-1G1S"] > 0  # same active adapter parameters
    uploads = figures["upload_bytes_per_round"]
    assert 0 < uploads["comigs-1G1S"] < uploads["fedavg"]
    compiled = {"peft-lora compiled", "comigs-1G1S compiled"}
    assert set(figures["step_s"]) == {"peft-lora", "comigs-1G1S", *compiled} and set(figures["compile_s"]) == compiled
    assert all(figures["compile_s"][name] > figures["step_s"][name] > 0 for name in compiled)  # the first step compiles
    for ratio in ("compiled_step_time_ratio", "compiled_vs_eager_peer_ratio", "compile_speedup"):
        assert math.isfinite(figures[ratio]) and figures[ratio] > 0
    printed = capsys.readouterr().out
    assert "step time (s)" in printed and "first step, compiling (s)" in printed
    profiles = figures["profile_ms"]
    assert set(profiles) == {"peft-lora", "comigs-1G1S"}
    for profile in profiles.values():  # both sides' matrix products, timed
        assert profile["aten::mm"] > 0 and all(ms > 0 for ms in profile.values())
    assert "one step, self time (ms)" in printed
    totals = printed.split("all operators")[1].split()[:3]  # peer, ours, our excess
    assert float(totals[2]) == pytest.approx(float(totals[1]) - float(totals[0]), abs=0.11)


def test_hermes_benchmark_runs_one_step_on_tiny_gpt2_unfused_and_fused(benchmarks):
    figures = benchmarks["hermes"].main(["--model", "tiny-gpt2", "--dtype", "bfloat16", "--fused", *TINY_RUN])
    _assert_side_by_side(figures, "peft-lora", "hermes", "hermes fused")
    params = figures["adapter_params"]
    assert params["hermes"] > params["peft-lora"] > 0  # LoRA + adapter + prefix against LoRA alone
    assert figures["step_s"]["hermes fused"] > 0 and figures["memory_mib"]["hermes fused"]["peak_mib"] > 0
    assert figures["fused_step_time_ratio"] == pytest.approx(figures["step_s"]["hermes fused"]
                                                            / figures["step_s"]["peft-lora"])


def test_quantization_benchmark_runs_one_step_per_base(benchmarks, saved_tiny_models):
    kinds = ["fp32", "int8", "nf4-bf16-ckpt"]  # each side's memory child costs a torch start-up
    figures = benchmarks["quantization"].main(["--model", str(saved_tiny_models["tiny-llama"]), "--kinds", *kinds[1:],
                                               *TINY_RUN])
    assert list(figures["step_s"]) == list(figures["tensor_peak_mib"]) == kinds
    weights = figures["weights_ratio"]
    assert weights["fp32"] == 1
    assert weights["nf4-bf16-ckpt"] < weights["int8"] < 1, "bitsandbytes packs the linear layers"
    assert all(figures["step_s"][kind] > 0 and figures["peak_rss_mib"][kind] > 0 for kind in kinds)
    tensors = figures["tensor_peak_mib"]
    assert all(tensors[kind] > figures["weights_mib"][kind] for kind in kinds), "the step adds to the weights"
    assert "| peak RSS (MiB) |" in benchmarks["quantization"].table(figures)
    on_cuda = {key: value for key, value in figures.items() if not key.startswith("peak_rss")}
    cuda_table = benchmarks["quantization"].table(on_cuda)  # CUDA's figures hold no resident set
    assert "RSS" not in cuda_table and cuda_table.splitlines()[0].count("|") == 5


def test_live_tensor_peak_counts_what_is_alive_at_once(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from tensor_peak import LiveTensorPeak

    mib = 2**20 // 4  # float32 elements in 1 MiB
    kept = []

    def step():
        big = torch.ones(4 * mib)  # 4 MiB, freed before the next two
        del big
        small = torch.zeros(2 * mib)
        kept.append(small[: mib])  # a view keeps its whole 2 MiB storage alive
        kept.append(torch.ones(mib) + 1)  # 1 MiB: the ones is freed, the sum kept

    with LiveTensorPeak() as meter:
        start = meter.peak_bytes
        step()
    assert (meter.peak_bytes - start) / 2**20 == pytest.approx(4, abs=0.01)
    alive = sum(size for ref, size in meter.live.values() if not ref.expired())
    assert (alive - start) / 2**20 == pytest.approx(3, abs=0.01)


def test_live_tensor_peak_ignores_the_symbolic_fake_tensors_torch_compile_leaves_behind(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from tensor_peak import LiveTensorPeak
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
    fake = FakeTensorMode(shape_env=ShapeEnv()).from_tensor(torch.ones(8, 4), symbolic_context=dynamic)
    assert not isinstance(fake.untyped_storage().nbytes(), int)  # what made the meter's sum symbolic
    with LiveTensorPeak() as meter:
        start = meter.peak_bytes
        made = torch.ones(2**20 // 4)
    assert isinstance(meter.peak_bytes, int)
    assert (meter.peak_bytes - start) / 2**20 == pytest.approx(1, abs=0.01)
    del made, fake


def test_the_deployment_benchmarks_evaluation_apart_mode_turns_riding_off_and_only_there(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import deployment_rounds

    args = deployment_rounds.options(["--rounds", "2"])
    apart = deployment_rounds.finetune_command(args, tmp_path, "fleet", deployment_rounds.APART)
    riding = deployment_rounds.finetune_command(args, tmp_path, "fleet", deployment_rounds.DEVICE)
    at = apart.index("federation.evaluation_rides=false")
    assert apart[at - 1] == "--set" and apart[:at - 1] + apart[at + 1:] == riding


def test_benchmarks_refuse_cuda_without_a_gpu(benchmarks, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for script in benchmarks.values():
        with pytest.raises(UserError, match="cuda"):
            script.main(["--model", "tiny-llama", "--device", "cuda", "--steps", "1"])


def test_transport_benchmark_runs_one_round_on_the_tiny_recipe(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import transport

    tiny = Path(__file__).parent / "recipes" / "tiny.yaml"
    figures = transport.main(["--recipe", str(tiny), "--rounds", "1", "--iterations", "1", "--kinds", "int8",
                              "--output", str(tmp_path)])
    uploads = figures["upload_ratio_vs_fedavg_fp32"]
    assert uploads["fedavg/fp32"] == 1
    assert 0.25 < uploads["comigs-1G1S/int8"] / uploads["comigs-1G1S/fp32"] < 0.26
    ppl = figures["test_ppl_ratio_vs_comigs_fp32"]
    assert set(ppl) == {"comigs-1G1S/fp32", "comigs-1G1S/int8"}
    assert all(ratio == 1 for ratio in ppl["comigs-1G1S/fp32"].values())
    assert all(0.9 < ratio < 1.1 for ratio in ppl["comigs-1G1S/int8"].values())
    assert "| comigs-1G1S/int8 |" in (tmp_path / "transport.md").read_text()


def test_a_simulation_benchmark_stops_on_a_bad_recipe_with_one_message_not_a_traceback(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import quantized_training

    tiny = Path(__file__).parent / "recipes" / "tiny.yaml"
    with pytest.raises(SystemExit) as stopped:
        quantized_training.main(["--recipe", str(tiny), "--output", str(tmp_path), "--methods", "nosuchmethod"])
    assert str(stopped.value).startswith("error: ") and "unknown method 'nosuchmethod'" in str(stopped.value)
    assert "\nfix: " in str(stopped.value)


def test_the_deployment_benchmark_stops_on_a_failed_run_with_its_error_not_a_traceback(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import deployment_rounds

    tiny = Path(__file__).parent / "recipes" / "tiny.yaml"
    with pytest.raises(SystemExit) as stopped:
        deployment_rounds.main(["--recipe", str(tiny), "--output", str(tmp_path), "--modes", "simulation",
                                "--methods", "nosuchmethod"])
    assert str(stopped.value).startswith("error: ") and "unknown method 'nosuchmethod'" in str(stopped.value)
    assert "(the simulation run; its folder: " in str(stopped.value)


def test_quantized_training_benchmark_compares_a_trained_nf4_base_with_the_float_one(monkeypatch, tmp_path,
                                                                                     saved_tiny_models):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import quantized_training

    tiny = Path(__file__).parent / "recipes" / "tiny.yaml"
    figures = quantized_training.main(["--recipe", str(tiny), "--rounds", "1", "--iterations", "1",
                                       "--set", f"model.name={saved_tiny_models['tiny-llama']}",
                                       "--output", str(tmp_path)])
    rows = figures["rows"]
    assert set(rows) == {"pretrained/none", "pretrained/nf4", "comigs-1G1S/none", "comigs-1G1S/nf4"}
    assert all(v["ratio"] == 1 and not v["beyond_noise"] for v in rows["comigs-1G1S/none"].values())
    nf4 = rows["pretrained/nf4"].values()
    assert all(math.isfinite(v["ratio"]) for v in nf4) and any(v["ratio"] != 1 for v in nf4), "NF4 changes the base"
    assert set(figures["wall_s"]) == {"none", "nf4"}
    assert "| comigs-1G1S/nf4 |" in (tmp_path / "quantized_training.md").read_text()


def test_round_overhead_benchmark_runs_one_round_on_the_tiny_recipe(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import round_overhead

    tiny = Path(__file__).parent / "recipes" / "tiny.yaml"
    figures = round_overhead.main(["--recipe", str(tiny), "--rounds", "1", "--iterations", "1",
                                   "--methods", "fedavg", "--output", str(tmp_path)])
    (row,) = figures["rounds"]["fedavg"]
    assert row["round"] == 1 and row["wall_s"] >= row["busiest_worker_s"] >= row["slowest_client_s"] > 0
    assert 0 <= figures["max_overhead"]["fedavg"] < 1
    assert "| fedavg | 1 |" in capsys.readouterr().out
    assert (tmp_path / "round_overhead.md").exists()


def test_scale_benchmark_compares_the_peak_memory_of_two_client_counts(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import scale

    tiny = Path(__file__).parent / "recipes" / "tiny.yaml"
    figures = scale.main(["--recipe", str(tiny), "--rounds", "1", "--iterations", "1", "--clients", "3", "6",
                          "--fraction", "0.34", "--device-state", "disk", "--set", "federation.cpus_per_client=2",
                          "--output", str(tmp_path)])
    small, large = figures["variants"]["3-clients-disk"], figures["variants"]["6-clients-disk"]
    assert (small["trained_devices"], large["trained_devices"]) == (1, 2)  # the same fraction of each
    assert small["processes"] > 2, "the Ray processes below the driver are measured too"
    assert all(0 < v["peak_pss_mib"] <= v["sum_vmhwm_mib"] for v in (small, large))
    for variant in (small, large):  # the peak, split by process role, adds up to the peak
        assert {"driver", "workers"} <= set(variant["peak_pss_by_role_mib"])
        assert sum(variant["peak_pss_by_role_mib"].values()) == pytest.approx(variant["peak_pss_mib"])
    ratio = figures["ratio"]["disk"]["peak_pss_mib"]
    assert ratio == pytest.approx(large["peak_pss_mib"] / small["peak_pss_mib"])
    assert "peak PSS ×" in (tmp_path / "scale.md").read_text()


def test_process_tree_holds_a_child_and_its_grandchild(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import scale

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                              "subprocess.run([sys.executable, '-c', 'import time; time.sleep(2)'])"])
    try:
        deadline = time.monotonic() + 10
        while len(found := scale.process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found[0] == child.pid and len(found) == 2
    finally:
        child.kill()
        child.wait()


def test_small_rounds_benchmark_times_both_sides_at_two_round_counts(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import small_rounds

    figures = small_rounds.main(["--rounds", "1", "2", "--set", "task.clients=4", "--set", ONE_WORKER,
                                  "--output", str(tmp_path)])
    for side in ("plain", "flower", "toolkit"):
        assert set(figures["wall_s"][side]) == {1, 2} and min(figures["wall_s"][side].values()) > 0
        fit = figures["lines"][side]
        assert fit["start_up_s"] + 2 * fit["per_round_s"] == pytest.approx(figures["wall_s"][side][2])
    assert figures["slope_ratio"] == pytest.approx(figures["lines"]["toolkit"]["per_round_s"]
                                                   / figures["lines"]["plain"]["per_round_s"])
    assert 0 < figures["rerun_s"] < figures["wall_s"]["toolkit"][1], "a finished run's rerun trains nothing"
    assert set(figures["mean_accuracy_after_r2"]) == {"plain", "toolkit"}
    assert "toolkit ÷ plain" in (tmp_path / "small_rounds.md").read_text()


def test_small_rounds_benchmark_refuses_a_recipe_the_plain_loop_cannot_mirror(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import small_rounds

    from ondevice_moe.recipe import load_recipe

    with pytest.raises(UserError, match="cannot mirror"):
        small_rounds.plain_arguments(load_recipe(Path(__file__).parent / "recipes" / "tiny.yaml"))
    with pytest.raises(UserError, match="cannot mirror"):
        small_rounds.plain_arguments(load_recipe(BENCHMARKS.parent / "recipes" / "flow-digits.yaml",
                                                 ["training.optimizer=adamw"]))


def test_profile_top_counts_a_frame_once_per_sample_and_keeps_only_matching_files(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import profile_top

    lines = ['process 1:"ondevice-moe";main (ondevice_moe/cli.py:1);step (ondevice_moe/training.py:9);'
             'step (ondevice_moe/training.py:9) 30',
             'process 1:"ondevice-moe";main (ondevice_moe/cli.py:1);wait (ray/worker.py:3) 10',
             "a line py-spy did not write"]
    frames = dict(profile_top.top_frames(lines, rate=10, match=["ondevice_moe/"], top=5))
    assert frames == {"main (ondevice_moe/cli.py:1)": 4.0, "step (ondevice_moe/training.py:9)": 3.0}


def test_server_reference_benchmark_builds_both_sides_and_checks_they_agree(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import server_reference

    recipe = str(Path(__file__).parent / "recipes" / "tiny.yaml")
    figures = server_reference.main(["--recipe", recipe, "--method", "1", "--repeats", "1"])
    assert figures["method"] == "fedavg" and figures["tensors"] > 0
    assert all(figures["seconds"][side] > 0 for side in server_reference.SIDES)
    assert math.isfinite(figures["time_ratio"]) and figures["memory_ratio"] >= 0
    assert "added peak memory (MiB)" in capsys.readouterr().out


def test_byzantine_benchmark_runs_an_attack_against_a_rule_for_one_round(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import byzantine

    cells = byzantine.main(["--rounds", "1", "--fractions", "0.1", "--attacks", "inflated-count", "--rules", "mean",
                            "--set", "federation.local_epochs=1", "--set", ONE_WORKER, "--output", str(tmp_path)])
    honest, lying = cells["no attack"]["mean"], cells["inflated-count 10 %"]["mean"]
    assert lying["capped"] == 2 and honest["capped"] == 0  # two liars, one round: both claims bounded
    assert lying["accuracy"] == honest["accuracy"]  # a bounded claim buys no weight: the same global
    assert "| inflated-count 10 % |" in (tmp_path / "byzantine.md").read_text()


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_generate_benchmark_times_ours_against_the_peft_export(tiny_llama_run, monkeypatch, capsys, fused):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import generate

    figures = generate.main(["--run", str(tiny_llama_run), "--tokens", "4", "--repeats", "1",
                             *(["--fused"] if fused else [])])
    assert figures["cache"] and figures["user"] == "code" and figures["fused"] == fused
    assert set(figures["tokens_per_s"]) == set(generate.SIDES) and min(figures["tokens_per_s"].values()) > 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert float(last.rstrip("}").split()[-1]) == figures["ratio_vs_peft"]
