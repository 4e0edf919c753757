from pathlib import Path

import pytest

from ondevice_moe import BUNDLED_RECIPES
from ondevice_moe.errors import UserError
from ondevice_moe.federation.job import Job
from ondevice_moe.recipe import apply_override, load_recipe

RECIPES = sorted(BUNDLED_RECIPES.glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_bundled_recipes_validate_and_resolve(path):
    recipe = load_recipe(path)
    for index in range(len(recipe.methods)):
        method = Job(recipe, index, Path("runs")).method
        assert len(method.layouts) in (1, len(recipe.user_names))


def test_paper_recipes_use_appendix_b12_hyper_parameters():
    recipe = load_recipe(BUNDLED_RECIPES / "comigs-gpt2-slimpajama.yaml")
    assert (recipe.experts.lora_rank, recipe.experts.lora_alpha) == (8, 16)
    assert (recipe.training.router_period, recipe.training.router_steps) == (30, 10)
    assert (recipe.data.batch_size, recipe.data.context_length, recipe.federation.local_iterations) == (64, 128, 10)
    assert recipe.federation.rounds == 50 and recipe.training.balance_weight == 0.01


def test_overrides_reach_nested_keys_and_list_items():
    raw = {"data": {"users": [{"name": "a"}, {"name": "b"}]}, "methods": ["local"]}
    apply_override(raw, "data.users.1.name=c")
    apply_override(raw, "federation.rounds=7")
    apply_override(raw, "methods=[fedavg, {name: comigs, variant: 2G}]")
    assert raw["data"]["users"][1]["name"] == "c"
    assert raw["federation"]["rounds"] == 7
    assert raw["methods"][1] == {"name": "comigs", "variant": "2G"}
    with pytest.raises(UserError, match="not an index"):
        apply_override(raw, "data.users.5.name=x")


def test_per_user_budgets_override_the_defaults():
    recipe = load_recipe(BUNDLED_RECIPES / "comigs-gpt2-wikipedia.yaml")
    assert recipe.data.budgets(0)["train"] == 557_662
    assert recipe.data.budgets(3)["test"] == 172_547


@pytest.mark.parametrize("override", ["methods=[fedavg", "name='open", "federation={rounds: 2"])
def test_override_value_that_is_not_yaml_names_the_key(override):
    with pytest.raises(UserError, match=rf"override '{override.split('=')[0]}': the value .* is not valid YAML"):
        apply_override({}, override)
