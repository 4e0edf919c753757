"""The methods that run on a Hugging Face language model or classifier, each as a recipe entry, and a
one-method recipe around a saved model folder (``conftest.saved_tiny_models``): shared by the tests that
walk every such method."""

from pathlib import Path

LANGUAGE_MODELLING = [
    "local", "fedavg", "fedavg-two-lora", "local-moe", "fedavg-moe", "pfedmoe", "fdlora", "ffa-lora", "fedsa-lora",
    "pcl",
    {"name": "hetlora", "ranks": [4, 2]}, {"name": "flexlora", "ranks": [4, 2]},
    "fed-lora", "fed-adapter", "fed-prefix", "fed-unipelt", "hermes", {"name": "comigs", "variant": "1G1S"},
    {"name": "floral", "clusters": 2, "train_base": False}, {"name": "local-adaptor", "train_base": False},
    {"name": "mixture", "experts": [{"kind": "adapter", "role": "shared"}, {"kind": "prefix", "role": "private"}],
     "router": "token-topk", "mixing": "block"},
]
CLASSIFICATION = ["hermes", "fed-lora", "fed-adapter", "fed-prefix", "fed-unipelt",
                  {"name": "local-adaptor", "train_base": False},
                  {"name": "floral", "clusters": 2, "train_base": False}]


def method_recipe(folder: Path, quantization: str, method, classification: bool) -> dict:
    users = [{"name": "code", "source": "python-code"}, {"name": "news", "source": "bbc-news"}]
    raw = {
        "name": "quantized", "seed": 0,
        "model": {"name": str(folder), "quantization": quantization},
        "federation": {"rounds": 1, "local_iterations": 2, "cpus_per_client": 2},
        "training": {"router_period": 1, "router_steps": 1},
        "methods": [method],
    }
    if classification:
        raw["task"] = {"name": "rotten-tomatoes", "clients": 2, "max_train_examples": 32, "max_test_examples": 8,
                       "max_length": 16, "batch_size": 4, "eval_batch_size": 8}
    else:
        raw["data"] = {"context_length": 16, "batch_size": 2, "eval_batch_size": 4, "train_tokens": 400,
                       "valid_tokens": 200, "test_tokens": 200, "users": users}
    return raw


def case_name(method) -> str:
    return method if isinstance(method, str) else method["name"]
