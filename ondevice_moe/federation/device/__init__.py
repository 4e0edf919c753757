"""What lives on a device: the base model (loaded once per process), the
user's data, and the trainer rebuilt each round from shared tensors sent by
the server plus private state kept by :mod:`~ondevice_moe.federation.device_state`.
"""

from __future__ import annotations

from ondevice_moe.federation.device.base import (
    base_model,
    base_structure,
    job_base_model,
    job_base_structure,
    small_model_options,
)
from ondevice_moe.federation.device.checkpoints import (
    checkpoint_path,
    load_checkpoint,
    load_server_model,
    record_device_finished,
    save_checkpoint,
    save_server_checkpoint,
    server_checkpoint_path,
    server_models_of,
)
from ondevice_moe.federation.device.data import (
    confine,
    device_examples,
    device_split,
    domain_users,
    eval_blocks,
    eval_examples,
    federated_task,
    router_blocks,
    scored_examples,
    source_test_blocks,
    source_test_examples,
    training_sizes,
    user_data,
    users_of_device,
)
from ondevice_moe.federation.device.model import (
    build_model,
    check_received,
    restore_model,
    restore_trainer,
    shape_mismatch,
)
from ondevice_moe.federation.device.rounds import JobDevice, device_seed, run_local_procedure, train_steps
from ondevice_moe.federation.device.upload import save_private_state, shared_state, travelling, upload, upload_reference

__all__ = [
    "JobDevice", "base_model", "base_structure", "build_model", "check_received", "checkpoint_path", "confine",
    "device_examples", "device_seed", "device_split", "domain_users", "eval_blocks", "eval_examples",
    "federated_task", "job_base_model", "job_base_structure", "load_checkpoint", "load_server_model",
    "record_device_finished", "restore_model", "restore_trainer", "router_blocks", "run_local_procedure",
    "save_checkpoint", "save_private_state", "save_server_checkpoint", "scored_examples", "server_checkpoint_path",
    "server_models_of", "shape_mismatch", "shared_state", "small_model_options", "source_test_blocks",
    "source_test_examples", "train_steps", "training_sizes", "travelling", "upload", "upload_reference",
    "user_data", "users_of_device",
]
