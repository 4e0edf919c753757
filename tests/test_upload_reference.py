"""The server checks each device's upload against a reference of names, shapes and dtypes that it
builds from the base model's structure alone (the meta device): every method's reference must be
exactly what a device with the loaded base may send, and building it must read no weight and
need no accelerator, whatever the recipe's device and quantization."""

from pathlib import Path

import pytest
import torch
from method_cases import CLASSIFICATION, LANGUAGE_MODELLING, case_name, method_recipe

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device as dev
from ondevice_moe.federation.job import Job
from ondevice_moe.models import registry
from ondevice_moe.recipe import validate_recipe

WHOLE_MODEL_OR_CLUSTERS = ["fed-ft", "centralized", {"name": "fedsoft", "clusters": 2, "lora_rank": 4},
                           {"name": "fedem", "clusters": 2, "lora_rank": 4}, "flow", "ditto", "apfl"]
PRIVATE_ONLY = {"local", "local-moe", "local-adaptor"}
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def loaded_reference(monkeypatch):
    """The reference as the server built it before: from a device model on the loaded base
    (``benchmarks/server_reference.py``, the peer of its comparison)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import server_reference

    return server_reference.loaded_reference


def _job(folder: Path, method, classification: bool, **model) -> Job:
    raw = method_recipe(folder, "none", method, classification)
    raw["model"].update(model)
    return Job(validate_recipe(raw), 0, Path("."))


def _signature(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()}


def _matches_a_loaded_device(folder: Path, method, classification: bool, loaded_reference) -> None:
    job = _job(folder, method, classification)
    for device in range(len(job.method.layouts)):
        reference = dev.upload_reference(job, device)
        assert reference or case_name(method) in PRIVATE_ONLY, f"{case_name(method)}: nothing to upload"
        assert all(tensor.device.type == "meta" for tensor in reference.values())
        assert _signature(reference) == _signature(loaded_reference(job, device)), case_name(method)


@pytest.mark.parametrize("method", LANGUAGE_MODELLING + WHOLE_MODEL_OR_CLUSTERS, ids=case_name)
def test_a_causal_lms_reference_is_what_a_device_with_the_loaded_base_uploads(saved_tiny_models, method,
                                                                               loaded_reference):
    _matches_a_loaded_device(saved_tiny_models["tiny-llama"], method, False, loaded_reference)


@pytest.mark.parametrize("method", [*CLASSIFICATION, "fed-ft"], ids=case_name)
def test_a_classifiers_reference_holds_its_head_as_a_device_trains_it(saved_tiny_models, method, loaded_reference):
    _matches_a_loaded_device(saved_tiny_models["tiny-bert"], method, True, loaded_reference)


def test_a_bfloat16_base_gives_the_reference_its_dtypes(saved_tiny_models, loaded_reference):
    # The experts train in float32 on any base; the task head is the base's own module, in its dtype.
    job = _job(saved_tiny_models["tiny-bert"], "fed-lora", classification=True, dtype="bfloat16")
    reference = dev.upload_reference(job, 0)
    assert {tensor.dtype for name, tensor in reference.items() if "classifier" in name} == {torch.bfloat16}
    assert {tensor.dtype for name, tensor in reference.items() if "lora_" in name} == {torch.float32}
    assert _signature(reference) == _signature(loaded_reference(job, 0))


def test_the_server_builds_the_reference_without_loading_weights_or_a_gpu(saved_tiny_models, monkeypatch):
    # A CPU-only server for devices that run an NF4 base on CUDA: before, the ServerApp loaded that
    # base (bitsandbytes, on the recipe's device) in round 1 just to learn the upload's shapes.
    folder = saved_tiny_models["tiny-llama"]
    method = {"name": "comigs", "variant": "1G1S"}
    on_cpu = dev.upload_reference(_job(folder, method, classification=False), 0)
    dev.base_structure.cache_clear()

    def no_weights(*args, **kwargs):
        raise AssertionError("the server loaded the base model's weights")

    monkeypatch.setattr(registry, "load_base_model", no_weights)
    monkeypatch.setattr(dev.base, "load_base_model", no_weights)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    job = _job(folder, method, classification=False, device="cuda", quantization="nf4")
    assert _signature(dev.upload_reference(job, 0)) == _signature(on_cpu)


def test_a_model_folder_without_a_config_is_one_clear_message(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not a model")
    with pytest.raises(UserError, match=r"cannot read the config of model .*config\.json"):
        registry.load_base_structure(str(tmp_path))


def test_the_reference_asks_for_the_models_roles_once_however_many_tensors_travel(saved_tiny_models, monkeypatch):
    """Every parameter's role is one pass over the model; asked once per travelling tensor (as it was
    before ``a80cdf1``) it made the server's first-round check quadratic: 20 s on SmolLM2's 420 LoRA tensors."""
    from ondevice_moe.methods.base import Method

    job = _job(saved_tiny_models["tiny-llama"], "fedavg", classification=False)
    calls, roles = [], Method.roles
    monkeypatch.setattr(Method, "roles", lambda self, model: calls.append(1) or roles(self, model))
    reference = dev.upload_reference(job, 0)
    assert len(reference) > 2 and len(calls) == 1
