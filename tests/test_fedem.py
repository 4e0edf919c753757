"""FedEM (Marfoq et al., 2021), FedSoft's second baseline: the E- and M-steps, the weighted
local loss, a device's round over every centre, and the server's average by example count.
The run on the synthetic 10:90 mixture is in ``test_fedsoft.py``."""

import math
from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import RecordDict

from ondevice_moe.errors import UserError
from ondevice_moe.example_loss import WeightedExamples, example_loss
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.likelihood import block_nll
from ondevice_moe.methods.fedsoft import procedure as centres_side
from ondevice_moe.methods.fedsoft.centres import centre_key, mixture_of, responsibilities, split_centres
from ondevice_moe.methods.fedsoft.prediction import CentreMixture
from ondevice_moe.methods.fedsoft.rule import CentreRule
from ondevice_moe.methods.registry import reporters
from ondevice_moe.models.small import small_model
from ondevice_moe.recipe import load_recipe, validate_recipe
from ondevice_moe.report import summarize, write_report
from ondevice_moe.server_rules.aggregation import Update
from ondevice_moe.training import DeviceTrainer, TrainingConfig

TINY_FEDSOFT = Path(__file__).parent / "recipes" / "tiny-fedsoft.yaml"


def _fedem_job(tmp_path: Path) -> Job:
    return Job(load_recipe(TINY_FEDSOFT, ["methods=[fedem]"]), 0, tmp_path)


# -- E- and M-steps --------------------------------------------------------------------------------------------


def test_the_e_step_weighs_each_example_by_prior_times_likelihood():
    losses = torch.tensor([[1.0, 2.0, 0.5], [3.0, 0.0, 0.5]])  # (S = 2 centres, n = 3 examples)
    prior = [0.25, 0.75]
    posteriors = responsibilities(losses, prior)
    for i in range(3):
        joint = [prior[s] * math.exp(-float(losses[s, i])) for s in range(2)]
        for s in range(2):
            assert float(posteriors[s, i]) == pytest.approx(joint[s] / sum(joint))
    assert mixture_of(posteriors) == pytest.approx([float(posteriors[s].mean()) for s in range(2)])
    assert sum(mixture_of(posteriors)) == pytest.approx(1.0)


def test_a_centre_with_no_prior_mass_keeps_none():
    posteriors = responsibilities(torch.tensor([[0.0, 0.0], [9.0, 9.0]]), [0.0, 1.0])
    assert torch.equal(posteriors[0], torch.zeros(2)) and mixture_of(posteriors) == [0.0, 1.0]


# -- the weighted local loss -----------------------------------------------------------------------------------


@pytest.mark.parametrize("regression", [False, True])
def test_per_example_losses_average_to_the_models_own_loss(regression):
    model = small_model("mlp", (4,), 1 if regression else 3, hidden=(5,), regression=regression)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(6, 4, generator=generator)
    labels = torch.randn(6, 1, generator=generator) if regression else torch.arange(6) % 3
    output = model(inputs=inputs, labels=labels)
    losses = example_loss(model, output.logits, labels)
    assert losses.shape == (6,)
    torch.testing.assert_close(losses.mean(), output.loss)


def test_a_language_models_example_loss_is_its_mean_next_token_loss(tiny_model, tokens):
    output = tiny_model(input_ids=tokens, labels=tokens)
    torch.testing.assert_close(example_loss(tiny_model, output.logits, tokens).mean(), output.loss)


class _Rows:
    def __init__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        self.inputs, self.labels = inputs, labels

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"inputs": self.inputs[rows], "labels": self.labels[rows]}


def test_a_weighted_step_follows_the_weighted_loss():
    """One SGD step on a batch with weights q moves the model by −lr · ∇ mean(q · loss)."""
    torch.manual_seed(0)
    method = validate_recipe(yaml.safe_load(TINY_FEDSOFT.read_text()) | {"methods": ["fedem"]}).method(0)
    model = small_model("mlp", (4,), 3, hidden=(5,))
    rows = _Rows(torch.randn(6, 4), torch.arange(6) % 3)
    weights = torch.tensor([1.0, 0.0, 0.5, 0.0, 2.0, 0.25])
    batch = WeightedExamples(rows, weights).batch(torch.arange(6))
    expected = {name: param.detach().clone() for name, param in model.named_parameters()}
    loss = (example_loss(model, model(inputs=rows.inputs).logits, rows.labels) * weights).mean()
    gradients = dict(zip(expected, torch.autograd.grad(loss, list(model.parameters())), strict=True))
    trainer = DeviceTrainer(model, method, TrainingConfig(lr=0.1, lr_schedule="constant", optimizer="sgd",
                                                          grad_clip=None))
    assert trainer.expert_step(batch) == pytest.approx(float(loss.detach()))
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name] - 0.1 * gradients[name])


# -- the device's round ----------------------------------------------------------------------------------------


def test_a_device_sets_pi_by_em_trains_every_centre_and_sends_all_of_them(tmp_path):
    job = _fedem_job(tmp_path)
    state = RecordDict()
    trainer = dev.restore_trainer(job, 0, None, state)
    centres = centres_side.received_centres(dev.JobDevice(job, 0), None)
    chosen = job.method.procedure.begin_round(dev.JobDevice(job, 0, state), trainer, None, 1)
    pi = [chosen["importance_0"], chosen["importance_1"]]
    assert sum(pi) == pytest.approx(1.0) and pi != pytest.approx([0.5, 0.5])
    assert list(state["importance"]["u"]) == pi, "π is the device's, kept for its next E-step"
    examples = centres_side.centre_examples(job.method.procedure, dev.JobDevice(job, 0))
    assert trainer.round_state[centres_side.ANCHORS].posteriors.shape == (2, len(examples))
    assert trainer.round_state[centres_side.ANCHORS].penalty(trainer.trainable) is None, "FedEM has no proximal term"
    start = trainer.iteration
    metrics, _ = dev.run_local_procedure(job, 0, trainer, seed=0)
    steps = metrics["step_losses"]  # each step: the mean of the centres' losses at it
    assert len(steps) == trainer.iteration - start > 0
    assert metrics["train_loss"] == pytest.approx(sum(steps) / len(steps))
    tensors, records = dev.upload(job, trainer)
    assert set(tensors) == set(dev.upload_reference(job, 0)) == {centre_key(s, "net.1.weight") for s in range(2)}
    trained = split_centres(tensors)
    for centre in range(2):
        assert not torch.equal(trained[centre]["net.1.weight"], centres[centre]["net.1.weight"]), "trained"
    assert records["mixture"]["pi"] == pi
    evaluated = dev.restore_model(job, 0, None, state)
    centres_side.local_model_of(job.method.procedure, dev.JobDevice(job, 0, state), evaluated, trained)
    best = max(range(2), key=pi.__getitem__)
    torch.testing.assert_close(evaluated.state_dict()["net.1.weight"], trained[best]["net.1.weight"])


def test_the_server_averages_each_centre_by_example_count_whatever_the_mixtures():
    rule = CentreRule(clusters=2, every_centre=True)

    def update(device: int, values: tuple[float, float], examples: int, pi: tuple[float, float]) -> Update:
        tensors = {centre_key(s, "w"): torch.tensor([values[s]]) for s in range(2)}
        return Update(device, tensors, examples, {"mixture": {"pi": list(pi)}})

    slots = rule.aggregate(rule.initial_slots(), [update(0, (1.0, 10.0), 30, (0.9, 0.1)),
                                                  update(1, (3.0, 20.0), 10, (0.2, 0.8))])
    assert float(slots["cluster_0"]["w"]) == pytest.approx((30 * 1.0 + 10 * 3.0) / 40)
    assert float(slots["cluster_1"]["w"]) == pytest.approx((30 * 10.0 + 10 * 20.0) / 40)
    assert set(rule.reference(slots, 0)) == {centre_key(0, "w"), centre_key(1, "w")}


def test_fedem_with_privacy_is_refused_with_the_fix():
    raw = yaml.safe_load(TINY_FEDSOFT.read_text())
    raw.update(methods=["fedem"], privacy={"clip_norm": 1.0, "noise_multiplier": 0.5})
    with pytest.raises(UserError, match="drop them or the recipe's privacy: section"):
        validate_recipe(raw)


def test_fedem_on_a_hugging_face_model_trains_cluster_adapters_not_whole_copies():
    raw = yaml.safe_load((Path(__file__).parent / "recipes" / "tiny-fedsoft-lm.yaml").read_text())
    raw["methods"] = ["fedem"]
    assert validate_recipe(raw).method(0).layouts[0].attention_lora == "shared"
    raw["fedsoft"].pop("lora_rank")
    with pytest.raises(UserError, match=r"fedsoft\.lora_rank"):
        validate_recipe(raw)


# -- FedEM's own prediction: the π-mixture of the centres --------------------------------------------------------


def _two_centres(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [{name: tensor + torch.randn(tensor.shape, generator=generator) for name, tensor in
             model.state_dict().items() if tensor.is_floating_point()} for _ in range(2)]


def _outputs(model: torch.nn.Module, centres: list[dict[str, torch.Tensor]], **inputs) -> list[torch.Tensor]:
    rows = []
    for centre in centres:
        model.load_state_dict(centre, strict=False)
        rows.append(model(**inputs).logits.detach().float())
    return rows


def test_a_classifiers_mixture_predicts_the_pi_weighted_class_distribution():
    model = small_model("mlp", (4,), 3, hidden=(5,))
    centres, inputs = _two_centres(model), torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    first, second = _outputs(model, centres, inputs=inputs)
    mixed = CentreMixture(model, centres, [0.3, 0.7])(inputs=inputs).logits
    expected = 0.3 * first.softmax(-1) + 0.7 * second.softmax(-1)
    torch.testing.assert_close(mixed.softmax(-1), expected)
    torch.testing.assert_close(mixed.exp().sum(-1), torch.ones(6))  # log-probabilities: nothing to renormalise
    only_second = CentreMixture(model, centres, [0.0, 1.0])(inputs=inputs).logits
    assert torch.equal(only_second.argmax(-1), second.argmax(-1))


def test_a_regressors_mixture_predicts_the_pi_weighted_mean():
    model = small_model("mlp", (4,), 1, hidden=(5,), regression=True)
    centres, inputs = _two_centres(model), torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    first, second = _outputs(model, centres, inputs=inputs)
    torch.testing.assert_close(CentreMixture(model, centres, [0.25, 0.75])(inputs=inputs).logits,
                               0.25 * first + 0.75 * second)


def test_a_language_models_mixture_scores_each_token_by_the_mixed_probability(tiny_model, tokens):
    centres = _two_centres(tiny_model)
    first, second = _outputs(tiny_model, centres, input_ids=tokens)
    mixed = 0.4 * first.softmax(-1) + 0.6 * second.softmax(-1)
    expected = -mixed[:, :-1].gather(-1, tokens[:, 1:].unsqueeze(-1)).log().sum(dim=(1, 2))
    nll = block_nll(CentreMixture(tiny_model, centres, [0.4, 0.6]), tokens, batch_size=1)
    torch.testing.assert_close(nll, expected, rtol=1e-4, atol=1e-4)


def test_a_mixture_needs_one_weight_per_centre():
    model = small_model("mlp", (4,), 3, hidden=(5,))
    with pytest.raises(ValueError, match="2 centres but 3"):
        CentreMixture(model, _two_centres(model), [0.2, 0.3, 0.5])


def test_the_summary_and_report_list_fedems_mixture_prediction_as_a_method_of_its_own(tmp_path):
    records = [{"kind": "eval", "method": "fedem", "round": 3, "user": user, "score": score, "score_train": 99.0,
                "score_mixture": mixture, "user_index": index}
               for index, (user, score, mixture) in enumerate([("a", 10.0, 8.0), ("b", 20.0, 12.0)])]
    families = reporters()
    methods = summarize(records, ["fedem"], ["a", "b"], metric="mse", reporters=families)["methods"]
    assert methods["fedem"]["mean_score"] == 15.0 and methods["fedem-mixture"]["mean_score"] == 10.0
    assert methods["fedem-mixture"]["per_user"] == {"a": {"score": 8.0}, "b": {"score": 12.0}}
    assert "mean_score_train" in methods["fedem"] and "mean_score_train" not in methods["fedem-mixture"]
    summary = summarize(records, ["fedem"], ["a", "b"], metric="mse", reporters=families)
    report = write_report(tmp_path, "fedem", summary, [], reporters=families).read_text(encoding="utf-8")
    assert "`fedem-mixture`: fedem's own prediction" in report and "| fedem-mixture | 8.00 | 12.00 |" in report
