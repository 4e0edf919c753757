"""Opening one user's trained model from a finished run."""


import pytest
import torch

from ondevice_moe.errors import UserError
from ondevice_moe.run_model import open_user_model


@pytest.fixture
def tiny_run(tiny_llama_run):
    return tiny_llama_run


def test_a_users_model_carries_its_devices_checkpoint(tiny_run):
    from safetensors.torch import load_file

    opened = open_user_model(tiny_run, "comigs-1G1S", "news")
    assert opened.device == 1 and not opened.model.training
    saved = load_file(str(tiny_run / "checkpoints" / "comigs-1G1S" / "device_1.safetensors"))
    state = opened.model.state_dict()
    assert saved and all(torch.equal(state[name], tensor) for name, tensor in saved.items())


@pytest.mark.parametrize(("method", "user", "expected"), [
    ("fedprox", "news", "use one of: fedavg, comigs-1G1S"),
    ("comigs-1G1S", "sports", "use one of: code, news, reviews"),
])
def test_unknown_method_or_user_names_the_choices(tiny_run, method, user, expected):
    with pytest.raises(UserError) as error:
        open_user_model(tiny_run, method, user)
    assert expected in error.value.fix
