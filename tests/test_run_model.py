"""Opening one user's trained model from a finished run."""

from pathlib import Path

import pytest
import torch

from ondevice_moe.errors import UserError
from ondevice_moe.recipe import load_recipe
from ondevice_moe.run_model import open_user_model
from ondevice_moe.runner import run_recipe

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    recipe = load_recipe(TINY, ["federation.rounds=1", "federation.local_iterations=1",
                                "methods=[{name: comigs, variant: 1G1S}]"])
    return run_recipe(recipe, tmp_path_factory.mktemp("run") / "tiny").run_dir


def test_a_users_model_carries_its_devices_checkpoint(tiny_run):
    from safetensors.torch import load_file

    opened = open_user_model(tiny_run, "comigs-1G1S", "news")
    assert opened.device == 1 and not opened.model.training
    saved = load_file(str(tiny_run / "checkpoints" / "comigs-1G1S" / "device_1.safetensors"))
    state = opened.model.state_dict()
    assert saved and all(torch.equal(state[name], tensor) for name, tensor in saved.items())


@pytest.mark.parametrize(("method", "user", "expected"), [
    ("fedprox", "news", "use one of: comigs-1G1S"),
    ("comigs-1G1S", "sports", "use one of: code, news, reviews"),
])
def test_unknown_method_or_user_names_the_choices(tiny_run, method, user, expected):
    with pytest.raises(UserError) as error:
        open_user_model(tiny_run, method, user)
    assert expected in error.value.fix
