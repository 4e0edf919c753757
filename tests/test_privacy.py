"""Differential privacy (recipe ``privacy``) and Flower's SecAgg+ (``federation.secure_aggregation``)."""

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant
from safetensors.torch import load_file
from scipy.stats import norm

from ondevice_moe import runner
from ondevice_moe.errors import UserError
from ondevice_moe.federation.accountant import PrivacyLedger, epsilon
from ondevice_moe.federation.privacy import clip_update, noise_generator, privatize, update_norm
from ondevice_moe.recipe import PrivacySection, load_recipe

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
RECIPES = Path(__file__).parent / "recipes"


def _update(seed: int, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"a.lora_A": torch.randn(8, 64, generator=generator) * scale,
            "a.lora_B": torch.randn(64, 8, generator=generator) * scale,
            "head.bias": torch.randn(3, generator=generator) * scale}


# -- clipping and noise -------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_a_clipped_update_never_exceeds_the_bound(seed):
    clip_norm = 0.5
    # Norms from far inside the ball (~0.002) to far outside it (~230): one in four lies inside.
    update = _update(seed, scale=10.0 ** (seed % 4 - 3))
    clipped, norm = clip_update(update, clip_norm)
    assert norm == pytest.approx(update_norm(update))
    assert update_norm(clipped) <= clip_norm * (1 + 1e-12)
    if norm <= clip_norm:  # inside the bound: unchanged
        assert all(torch.equal(clipped[name], update[name].double()) for name in update)
    else:  # outside: scaled onto the sphere, same direction
        assert update_norm(clipped) == pytest.approx(clip_norm, rel=1e-12)
        ratio = clipped["a.lora_A"] / update["a.lora_A"].double()
        assert torch.allclose(ratio, ratio.flatten()[0].expand_as(ratio))


def test_a_zero_update_stays_zero():
    clipped, norm = clip_update({"w": torch.zeros(4)}, 1.0)
    assert norm == 0.0 and torch.equal(clipped["w"], torch.zeros(4, dtype=torch.float64))


def test_noise_std_is_the_multiplier_times_the_bound_per_device():
    """σ = z·C on every coordinate of one device's update (local DP; see ondevice_moe/federation/privacy.py)."""
    privacy = PrivacySection(clip_norm=0.2, noise_multiplier=1.5)
    start = {"w": torch.zeros(400_000), "v": torch.ones(7)}
    upload, figures = privatize(start, dict(start), privacy, noise_generator(0, device=1, server_round=3))
    noise = torch.cat([upload["w"], upload["v"] - 1]).double()
    assert figures == {"update_norm": 0.0, "clipped": 0}
    assert noise.std().item() == pytest.approx(0.3, rel=0.01)  # z·C = 1.5 · 0.2
    assert abs(noise.mean().item()) < 0.3 * 5 / noise.numel() ** 0.5


def test_noise_is_seeded_by_seed_device_and_round():
    privacy = PrivacySection(clip_norm=1.0, noise_multiplier=1.0)
    start, trained = _update(0, 0.1), _update(1, 0.1)

    def upload(seed, device, server_round):
        return privatize(start, trained, privacy, noise_generator(seed, device, server_round))[0]["a.lora_A"]

    assert torch.equal(upload(0, 1, 2), upload(0, 1, 2))
    assert not torch.equal(upload(0, 1, 2), upload(0, 2, 2))
    assert not torch.equal(upload(0, 1, 2), upload(0, 1, 3))
    assert not torch.equal(upload(0, 1, 2), upload(1, 1, 2))


def test_privatize_clips_the_update_not_the_values():
    """Far-from-zero values with a small update: only the update is bounded."""
    privacy = PrivacySection(clip_norm=0.01)
    start = {name: t + 5.0 for name, t in _update(0, 1.0).items()}
    start["ranks"] = torch.tensor([4, 2])
    trained = {name: t + _update(1, 1.0).get(name, 0) for name, t in start.items() if name != "ranks"}
    trained["ranks"] = torch.tensor([3, 1])
    upload, figures = privatize(start, trained, privacy, noise_generator(0, 0, 1))
    assert figures["clipped"] == 1 and figures["update_norm"] > 1
    assert torch.equal(upload["ranks"], trained["ranks"])  # integer state travels as it is
    assert all(upload[name].dtype == trained[name].dtype for name in trained)
    delta = {name: upload[name].double() - start[name].double() for name in start if name != "ranks"}
    assert update_norm(delta) == pytest.approx(0.01, rel=1e-3)  # up to float32 rounding of start + Δ


def test_privacy_keys_are_validated():
    assert not load_recipe(TINY).privacy.enabled
    with pytest.raises(UserError, match=r"privacy: noise_multiplier scales the noise to clip_norm"):
        load_recipe(TINY, ["privacy.noise_multiplier=1.0"])
    with pytest.raises(UserError, match=r"privacy\.clip_norm"):
        load_recipe(TINY, ["privacy.clip_norm=0"])


# -- the accountant -------------------------------------------------------------


def test_epsilon_is_dp_accountings_for_the_composed_gaussian_mechanism():
    """z = 1.1 over 50 rounds at δ = 1e-5: the library's RDP accountant called directly."""
    library = RdpAccountant()
    library.compose(dp_event.GaussianDpEvent(1.1), 50)
    assert epsilon(1.1, 50, 1e-5) == library.get_epsilon(1e-5)


@pytest.mark.parametrize(("noise_multiplier", "uploads", "delta"), [(1.1, 50, 1e-5), (0.5, 3, 1e-5), (4.0, 1, 1e-3)])
def test_epsilon_lies_between_the_exact_gaussian_and_mironovs_conversion(noise_multiplier, uploads, delta):
    """k Gaussian releases of multiplier z are one of multiplier z/√k, whose exact δ(ε) is Balle &
    Wang's (2018, Thm. 8): the reported ε must keep δ(ε) ≤ δ. From above, Mironov's (2017, Prop. 3)
    conversion min_α kα/(2z²) + log(1/δ)/(α − 1) of the same Rényi divergences bounds it."""
    reported = epsilon(noise_multiplier, uploads, delta)
    mu = math.sqrt(uploads) / noise_multiplier
    exact_delta = norm.cdf(-reported / mu + mu / 2) - math.exp(reported) * norm.cdf(-reported / mu - mu / 2)
    assert exact_delta <= delta
    orders = [1 + x / 100 for x in range(1, 20_000)]
    mironov = min(uploads * a / (2 * noise_multiplier**2) + math.log(1 / delta) / (a - 1) for a in orders)
    assert reported <= mironov


def test_epsilon_grows_with_rounds_and_falls_with_noise():
    by_rounds = [epsilon(1.0, rounds, 1e-5) for rounds in (1, 2, 5, 20, 100)]
    by_noise = [epsilon(z, 10, 1e-5) for z in (0.5, 1.0, 2.0, 8.0)]
    assert all(a < b for a, b in itertools.pairwise(by_rounds))
    assert all(a > b for a, b in itertools.pairwise(by_noise))
    assert epsilon(1.0, 10, 1e-3) < epsilon(1.0, 10, 1e-6)  # a looser δ buys a smaller ε


def test_no_upload_costs_nothing_and_clipping_alone_guarantees_nothing():
    assert epsilon(1.0, 0, 1e-5) == 0.0
    assert epsilon(0.0, 3, 1e-5) == math.inf


def test_the_ledger_charges_each_device_for_its_own_rounds():
    """Devices 0-3, two sampled a round: the device sampled most often sets ε."""
    ledger = PrivacyLedger(noise_multiplier=1.0, delta=1e-5)
    for sampled in ([0, 1], [1, 2], [1, 3]):
        ledger.record_round(sampled)
    assert ledger.uploads == {0: 1, 1: 3, 2: 1, 3: 1} and ledger.most_uploads == 3
    assert ledger.epsilon() == epsilon(1.0, 3, 1e-5)
    assert ledger.epsilon() < epsilon(1.0, 4, 1e-5)  # not charged for every round of the run


def test_delta_is_validated():
    assert load_recipe(TINY, ["privacy.clip_norm=1.0"]).privacy.delta == 1e-5
    for bad in ("0", "1"):
        with pytest.raises(UserError, match=r"privacy\.delta"):
            load_recipe(TINY, ["privacy.clip_norm=1.0", f"privacy.delta={bad}"])


# -- secure aggregation: recipe checks ----------------------------------------


@pytest.mark.parametrize(("recipe", "named"), [
    ("tiny-classification.yaml", "hermes: Hermes's inverse-frequency weights"),
    ("tiny-fedsoft.yaml", "fedsoft: FedSoft and IFCA select devices per centre"),
    ("tiny-floral.yaml", "FLoRAL weighs each adaptor by each client's π_c"),
])
def test_secaggplus_refuses_methods_that_are_not_one_weighted_sum(recipe, named):
    with pytest.raises(UserError, match=r"secure_aggregation: secaggplus only sums one weighted vector") as error:
        load_recipe(RECIPES / recipe, ["federation.secure_aggregation=secaggplus"])
    assert named in str(error.value)


@pytest.mark.parametrize(("method", "named"), [("pcl", "PCL relays each device's own model"),
                                               ("{name: hetlora, ranks: [4, 2, 2]}",
                                                "HetLoRARule combines devices of different LoRA ranks"),
                                               ("centralized", "one device trains on every user's data"),
                                               ("{name: hermes, ablation: w/o-A}",
                                                "Hermes without aggregation balance averages each expert"),
                                               ("{name: mixture, experts: [{kind: lora, role: shared}], "
                                                "router: token-topk, upload: selected}",
                                                "devices upload only the experts they used")])
def test_secaggplus_refuses_relays_ranks_partial_uploads_and_one_device(method, named):
    with pytest.raises(UserError, match=named):
        load_recipe(TINY, [f"methods=[{method}]", "federation.secure_aggregation=secaggplus"])


@pytest.mark.parametrize(("override", "message"), [
    ("federation.transport=int8", "transport int8 does not apply"),
    ("federation.faults=[{device: 0, kind: nan}]", r"faults \['nan'\] corrupt or forge one device's upload"),
    ("federation.secaggplus.reconstruction_threshold=3", "must be less than `num_shares`"),
])
def test_secaggplus_settings_are_validated(override, message):
    with pytest.raises(UserError, match=message):
        load_recipe(TINY, ["federation.secure_aggregation=secaggplus", override])


def test_secaggplus_accepts_fedavg_and_comigs():
    recipe = load_recipe(TINY, ["federation.secure_aggregation=secaggplus"])
    assert recipe.federation.secaggplus.quantization_range == 2**22


# -- simulations --------------------------------------------------------------


def _run(tmp_path: Path, secure: str) -> Path:
    """One round of CoMiGS-1G1S on three devices with DP on; device 2 crashes while training."""
    recipe = load_recipe(TINY, ["methods=[{name: comigs, variant: 1G1S}]", "federation.rounds=1",
                                "federation.local_iterations=1", f"federation.secure_aggregation={secure}",
                                "privacy.clip_norm=0.05", "privacy.noise_multiplier=0.5",
                                "federation.faults=[{device: 2, kind: crash}]"])
    return runner.run_recipe(recipe, tmp_path / secure).run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp_path = tmp_path_factory.mktemp("privacy")
    return {secure: _run(tmp_path, secure) for secure in ("none", "secaggplus")}


def _records(run_dir: Path, kind: str) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


def test_a_simulation_with_privacy_logs_its_parameters(runs):
    run_dir = runs["none"]
    [privacy] = _records(run_dir, "privacy")
    trained = _records(run_dir, "train")
    assert privacy["clip_norm"] == 0.05 and privacy["noise_multiplier"] == 0.5
    assert privacy["noise_std"] == pytest.approx(0.025)
    assert privacy["devices"] == 2 and set(privacy["update_norms"]) == {"code", "news"}  # device 2 crashed
    assert privacy["clipped"] == sum(r["update_norm"] > 0.05 for r in trained)
    assert all(r["update_norm"] > 0 for r in trained)
    report = (run_dir / "report.md").read_text()
    assert "## Differential privacy" in report and "| comigs-1G1S | 1 | 0.05 | 0.5 | 0.025 |" in report


def test_a_simulation_with_privacy_reports_its_epsilon(runs):
    """Three devices, all sampled, one round at z = 0.5: each has uploaded once (device 2 is charged
    although it crashed before uploading: the server cannot know it did not)."""
    spent = epsilon(0.5, 1, 1e-5)
    [privacy] = _records(runs["none"], "privacy")
    assert (privacy["sampling_rate"], privacy["uploads"], privacy["delta"]) == (1.0, 1, 1e-5)
    assert privacy["epsilon"] == pytest.approx(spent)
    summary = json.loads((runs["none"] / "summary.json").read_text())["methods"]["comigs-1G1S"]
    assert summary["privacy_spent"] == {"epsilon": pytest.approx(spent), "delta": 1e-5, "uploads": 1}
    assert f"- **comigs-1G1S:** (ε, δ) = ({spent:.3g}, 1e-05)" in (runs["none"] / "report.md").read_text()
    assert _records(runs["secaggplus"], "privacy")[0]["epsilon"] == privacy["epsilon"]


def test_secaggplus_aggregate_equals_plain_aggregation_within_a_quantization_step(runs):
    """Same seeded training and noise, one device dropping out after the key exchange: the
    SecAgg+ mean matches FedAvg's within one step 2·clipping_range/quantization_range."""
    step = 2 * 8.0 / 2**22
    plain = load_file(runs["none"] / "checkpoints" / "comigs-1G1S" / "device_0.safetensors")
    secure = load_file(runs["secaggplus"] / "checkpoints" / "comigs-1G1S" / "device_0.safetensors")
    shared = [name for name in plain if ".shared" in name]
    assert shared
    gaps = [(plain[name] - secure[name]).abs().max().item() for name in shared]
    assert 0 < max(gaps) <= step + 1e-7  # it really was quantized, and no further off than a step
    [comm] = _records(runs["secaggplus"], "comm")
    assert comm["devices"] == 2 and comm["dropped"] == 1
    [drop] = _records(runs["secaggplus"], "drop")
    assert drop["device"] == 2 and "SecAgg+" in drop["reason"]
    assert _records(runs["secaggplus"], "privacy")[0]["update_norms"] == \
        _records(runs["none"], "privacy")[0]["update_norms"]
    steps = {r["user"]: r["step_losses"] for r in _records(runs["secaggplus"], "train")}
    assert steps == {r["user"]: r["step_losses"] for r in _records(runs["none"], "train")}, \
        "a device's list-valued metrics cross SecAgg+'s scalar-only FitRes intact"


def test_a_real_devices_noise_is_seeded_by_its_own_secret_and_a_simulations_by_the_recipe(tmp_path):
    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from ondevice_moe.federation.client_app import noise_seed
    from ondevice_moe.federation.job import Job, device_job
    from ondevice_moe.recipe import load_recipe

    recipe = load_recipe(Path(__file__).parent / "recipes" / "tiny.yaml", ["seed=7"])
    run_config = {"recipe-json": json.dumps(recipe.model_dump(mode="json")), "method": 1}

    def device(partition: int) -> tuple[Job, Context]:
        context = Context(run_id=1, node_id=partition, state=RecordDict(), run_config=run_config,
                          node_config={"partition-id": partition, "state-dir": str(tmp_path / f"d{partition}")})
        return device_job(context, 1), context

    from flwr.supercore.task_identity import TaskIdentity

    if TaskIdentity._run_id is None:  # set by Flower's engines in a real ServerApp process
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0

    def message(key: str) -> Message:
        return Message(RecordDict({"config": ConfigRecord({"run-key": key})}), dst_node_id=1, message_type="train")

    simulated = Job(recipe, 1, tmp_path)
    context = device(0)[1]
    assert noise_seed(simulated, context, message("a")) == 7 and len(context.state) == 0, \
        "a rerun of a simulation repeats its noise"
    (job, context), (other, other_context) = device(0), device(1)
    secret = noise_seed(job, context, message("a"))
    assert secret != 7 and noise_seed(*device(0), message("a")) == secret, "drawn once per run, kept on the device"
    assert noise_seed(other, other_context, message("a")) != secret, "each device its own"
    assert noise_seed(job, context, message("b")) != secret, "each run its own"
