"""Generation keeps a key/value cache wherever it gives the model's own text: greedy decoding with the cache
equals decoding on the whole text at every step, for every built-in language-modelling method's device model
(its experts and routers moved off their initial values, so every expert speaks); a model whose router reads
the whole text (Flow's) decodes without one. The chat template shapes an instruction run's prompt."""

from pathlib import Path

import pytest
import torch
import yaml

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.generate import Sampling, generate_tokens, prompt_tokens, tunes_instructions, uses_cache
from ondevice_moe.methods import registry
from ondevice_moe.methods.spec import LANGUAGE
from ondevice_moe.models.tiny import byte_tokenizer
from ondevice_moe.recipe import validate_recipe
from ondevice_moe.run_folder import RunFolder

RECIPES = Path(__file__).parent / "recipes"
LANGUAGE_METHODS = sorted(name for name, spec in registry.BUILT_IN.items() if LANGUAGE in spec.tasks)
REQUIRED = {"flexlora": {"ranks": [4, 4, 2]}, "hetlora": {"ranks": [4, 4, 2]},  # options without a default
            "mixture": {"experts": [{"kind": "lora", "role": "shared"}, {"kind": "prefix", "role": "private"}],
                        "mixing": "block"}}
GREEDY = Sampling()


def _job(method: str, tmp_path: Path) -> Job:
    raw = yaml.safe_load((RECIPES / "tiny.yaml").read_text())
    raw["methods"] = [{"name": method, **REQUIRED.get(method, {})}]
    raw["fedsoft"] = {"clusters": 2, "lora_rank": 4}  # the cluster methods' centres (FedSoft, IFCA, FedEM)
    raw["floral"] = {"clusters": 2}
    recipe = validate_recipe(raw)
    return Job(recipe, 0, RunFolder(recipe, tmp_path).prepare())


def _speaking_model(job: Job) -> torch.nn.Module:
    """The last device's model with every trainable tensor moved (a zero-initialised LoRA B would hide its expert)."""
    model = dev.build_model(job, len(job.method.layouts) - 1).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad and parameter.is_floating_point():
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
    return model


def _greedy_scores(model: torch.nn.Module, prompt: torch.Tensor, use_cache: bool) -> torch.Tensor:
    """The logits of each of 12 greedy steps, shape ``(12, 1, vocabulary)``."""
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                             use_cache=use_cache, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return torch.stack(out.scores)


@pytest.mark.parametrize("method", LANGUAGE_METHODS)
def test_greedy_text_with_the_cache_is_the_text_without_it(method, tmp_path):
    model = _speaking_model(_job(method, tmp_path))
    prompt = byte_tokenizer()("def main():", add_special_tokens=False, return_tensors="pt")["input_ids"]
    whole = generate_tokens(model, prompt, 12, GREEDY, 0, use_cache=False)
    assert torch.equal(generate_tokens(model, prompt, 12, GREEDY, 0), whole), (method, uses_cache(model))
    if uses_cache(model):  # every step's logits, not only their argmax
        torch.testing.assert_close(_greedy_scores(model, prompt, True), _greedy_scores(model, prompt, False),
                                   atol=1e-4, rtol=1e-4)


def test_a_router_that_reads_the_whole_text_turns_the_cache_off(tmp_path):
    """Flow's ψ routes a token on the mean of the text's embeddings so far: with a cache it would read the
    new token only."""
    model = _speaking_model(_job("flow", tmp_path))
    assert not uses_cache(model) and uses_cache(_speaking_model(_job("comigs", tmp_path / "comigs")))
    router = next(module for module in model.modules() if getattr(module, "reads_whole_context", False))
    ids = byte_tokenizer()("def main():", add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        model(input_ids=ids)
        on_the_whole_text = router.last_q[0][:, -1].clone()
        past = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
        model(input_ids=ids[:, -1:], past_key_values=past, use_cache=True)
        from_the_cache = router.last_q[0][:, -1]
    assert not torch.allclose(on_the_whole_text, from_the_cache)


def test_an_instruction_runs_prompt_goes_through_the_chat_template_unless_raw():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    templated = tokenizer.decode(prompt_tokens(tokenizer, "hi", templated=True)[0])
    assert templated == "<user>hi\n<assistant>"
    assert tokenizer.decode(prompt_tokens(tokenizer, "hi", templated=False)[0]) == "hi"


def test_a_run_tunes_instructions_when_a_users_source_is_prompts_and_responses():
    raw = yaml.safe_load((RECIPES / "tiny.yaml").read_text())
    assert not tunes_instructions(validate_recipe(raw))
    raw["data"]["users"][0] = {"name": "code", "source": "python-docstrings"}
    assert tunes_instructions(validate_recipe(raw))


@pytest.mark.parametrize(("sampling", "problem"), [
    (Sampling(temperature=-1), "is negative"), (Sampling(top_k=-2), "--top-k -2"), (Sampling(top_p=0), "--top-p 0"),
])
def test_bad_sampling_settings_are_named(sampling, problem):
    with pytest.raises(UserError, match=problem):
        sampling.check()
