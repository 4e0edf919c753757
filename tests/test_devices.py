"""Real devices, served in-process: each node has its own ``--node-config`` (partition-id,
data-path, state-dir) and receives the recipe through the run config, as under ``flwr run``
on Flower's deployment engine; the server is the real strategy. Devices restart, vanish and
impersonate each other here in seconds; tests/test_deployment.py does it with real processes."""

from __future__ import annotations

import io
import json
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import Context, Error, Message, RecordDict
from safetensors.torch import load_file
from test_strategy import TINY, InProcessGrid

from ondevice_moe import runner
from ondevice_moe.data.sources import device_source_kind, documents
from ondevice_moe.errors import UserError
from ondevice_moe.federation import client_app, server_app
from ondevice_moe.federation.device import check_received
from ondevice_moe.federation.device_runtime import CLIENT_APP, _check_app
from ondevice_moe.federation.job import ALL_METHODS, Job, device_job
from ondevice_moe.federation.node import REFUSED, node_facts
from ondevice_moe.federation.strategy import device_error
from ondevice_moe.federation.submit import connection, write_app
from ondevice_moe.names import folder_name
from ondevice_moe.recipe import load_recipe, validate_recipe
from ondevice_moe.report import MetricsLog, summarize
from ondevice_moe.run_folder import RunFolder
from ondevice_moe.run_model import open_user_model

USERS = ("code", "docs", "tests")


def private_folders(root: Path) -> list[Path]:
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    folders = []
    for device, user in enumerate(USERS):
        folder = root / f"private-{user}"
        folder.mkdir(parents=True)
        for module in stdlib[device * 8:(device + 1) * 8]:
            (folder / f"{module.stem}.txt").write_text(module.read_text(encoding="utf-8", errors="replace"))
        folders.append(folder)
    return folders


def device_recipe(method: object = "fedavg", sections: dict | None = None, **federation: object):
    raw = yaml.safe_load(TINY.read_text()) | (sections or {})
    raw["name"] = "on-devices"
    raw["data"]["users"] = [{"name": user, "source": "device"} for user in USERS]
    raw["data"].update(train_tokens=2000, valid_tokens=500, test_tokens=500)
    raw["federation"] = {"rounds": 2, "local_iterations": 1, "cpus_per_client": 2, **federation}
    raw["methods"] = [method]
    return validate_recipe(raw)


class DeviceGrid(InProcessGrid):
    """Nodes run the real ClientApp in this process, each with its own node config; a node can be
    killed (it vanishes and answers nothing), restarted (a new node id, a fresh Flower context) or
    doubled (a second node with the same partition-id)."""

    def __init__(self, recipe, folders: list[Path], root: Path) -> None:
        super().__init__(0)
        self.run_config = {"recipe-json": json.dumps(recipe.model_dump(mode="json")), "method": 0,
                           "run-dir": str(root / "server")}
        self.folders, self.root = folders, root
        self.contexts: dict[int, Context] = {}
        self.next_id = 1000
        self.pushed: list[Message] = []
        self.train_replies = 0
        self.after_round_1: list = []  # what happens once every device answered round 1's training
        for device in range(len(folders)):
            self.add(device)

    def add(self, device: int, name: str | None = None) -> int:
        self.next_id += 7
        folder = self.root / (name or f"device{device}")
        config = {"partition-id": device, "data-path": str(self.folders[device]), "state-dir": str(folder / "state")}
        self.contexts[self.next_id] = Context(run_id=1, node_id=self.next_id, state=RecordDict(),
                                              run_config=self.run_config, node_config=config)
        return self.next_id

    def node_of(self, device: int) -> int:
        return max(node for node, context in self.contexts.items() if context.node_config["partition-id"] == device)

    def get_node_ids(self):
        if self.train_replies >= len(self.folders) and self.after_round_1:
            while self.after_round_1:
                self.after_round_1.pop(0)()
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            context = self.contexts.get(message.metadata.dst_node_id)
            if context is None:
                continue  # a killed node answers nothing
            try:
                replies.append(client_app.app(message, context))
            except Exception as error:
                replies.append(Message(Error(0, f"<class '{type(error).__name__}'>:<'{error}'>"), reply_to=message))
            self.train_replies += message.metadata.message_type == "train"
        return replies

    def push_messages(self, messages):
        self.pushed.extend(messages)
        return [str(index) for index, _ in enumerate(messages)]



def federate(recipe, grid: DeviceGrid, root: Path) -> list[dict]:
    job = Job(recipe, 0, root / "server", submitted=True)  # as `flwr run` gives the ServerApp
    RunFolder(recipe, job.run_dir).prepare()
    log = MetricsLog(job.run_dir / "metrics.jsonl")
    server_app.run_federation(grid, job, log)
    return log.read()


def test_each_device_reads_its_own_data_path_and_keeps_its_state_and_checkpoint_in_its_state_dir(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe({"name": "comigs", "variant": "1G1S"})
    records = federate(recipe, DeviceGrid(recipe, folders, tmp_path), tmp_path)
    evals = [r for r in records if r["kind"] == "eval"]
    assert {r["user"] for r in evals} == set(USERS)
    assert all("test_ppl_out" not in r and r["test_ppl_in"] > 1 for r in evals)  # nobody read another's data
    for device in range(len(USERS)):
        state = tmp_path / f"device{device}" / "state" / "on-devices"
        assert (state / "checkpoints" / "comigs-1G1S" / f"device_{device}.safetensors").is_file()
        assert (state / "device_state" / "comigs-1G1S" / "round-2.pb").is_file()  # its state after the last round
    server = tmp_path / "server" / "checkpoints" / "comigs-1G1S"
    assert [path.name for path in server.iterdir()] == ["server.safetensors"]  # no device's model, ...
    kept = load_file(str(server / "server.safetensors"))  # ... the shared experts it aggregated
    assert kept and all(name.startswith("global/") and ".private_" not in name for name in kept)
    summary = summarize(records, ["comigs-1G1S"], list(USERS))
    assert "mean_in" in summary["methods"]["comigs-1G1S"] and "mean_out" not in summary["methods"]["comigs-1G1S"]


def test_eval_and_export_open_a_devices_own_folder_and_explain_the_servers(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe({"name": "comigs", "variant": "1G1S"}, rounds=1)
    records = federate(recipe, DeviceGrid(recipe, folders, tmp_path), tmp_path)
    own = tmp_path / "device1" / "state" / "on-devices"
    rescored = runner.evaluate_run(own)["methods"]["comigs-1G1S"]["per_user"]  # the suite read from the run
    in_run = {r["user"]: r["test_ppl_in"] for r in records if r["kind"] == "eval"}
    assert list(rescored) == ["docs"] and rescored["docs"]["in"] == pytest.approx(in_run["docs"], rel=1e-5)
    assert open_user_model(own, "comigs-1G1S", "docs").device == 1
    with pytest.raises(UserError, match="device 1's folder: it holds user 'docs''s model only"):
        open_user_model(own, "comigs-1G1S", "code")
    with pytest.raises(UserError, match="server's folder of a run on real devices") as raised:
        runner.evaluate_run(tmp_path / "server", "lm")
    assert "state-dir" in raised.value.fix


@pytest.mark.parametrize("method", ["pcl", "fedsoft"])
def test_server_state_methods_run_on_devices_that_hold_only_their_own_data(tmp_path, method):
    """PCL (the server relays peers' models) and FedSoft (the server keeps cluster centres) on real devices:
    every device trains and is tested on its own data-path only; FedSoft's per-source centre table, which
    needs every user's text on device 0, is left out."""
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe(method, {"fedsoft": {"clusters": 2, "lora_rank": 4}})
    records = federate(recipe, DeviceGrid(recipe, folders, tmp_path), tmp_path)
    evals = [r for r in records if r["kind"] == "eval" and r["round"] == 2]
    assert sorted(r["user"] for r in evals) == sorted(USERS) and not [r for r in records if r["kind"] == "drop"]
    assert not any(key.startswith("centre_") for r in evals for key in r)


def test_a_restarted_device_rejoins_under_a_new_node_id_and_resumes_its_private_state(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe({"name": "comigs", "variant": "1G1S"}, rounds=3, eval_every=3)
    grid = DeviceGrid(recipe, folders, tmp_path)
    old = grid.node_of(2)
    grid.after_round_1.append(lambda: (grid.contexts.pop(old), grid.add(2)))  # SIGKILL, then a fresh SuperNode
    records = federate(recipe, grid, tmp_path)
    rejoin = [r for r in records if r["kind"] == "rejoin"]
    assert [(r["device"], r["old_node"]) for r in rejoin] == [(2, old)] and rejoin[0]["node"] == grid.node_of(2)
    train = {(r["user"], r["round"]): r for r in records if r["kind"] == "train"}
    assert train[("tests", 2)]["resumed_round"] == 1  # from its state-dir, not from fresh experts
    assert "resumed_round" not in train[("code", 2)]  # a device that kept running resumed nothing
    assert {r["user"] for r in records if r["kind"] == "eval"} == set(USERS)


def test_an_authenticated_device_restarting_with_its_node_id_resumes_its_private_state(tmp_path):
    """SuperNode authentication gives a restarted device its node id back: no rejoin, a fresh Flower
    context, and the private state comes back from its state-dir."""
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe({"name": "comigs", "variant": "1G1S"}, rounds=2, eval_every=2)
    grid = DeviceGrid(recipe, folders, tmp_path)
    node = grid.node_of(1)
    old = grid.contexts[node]
    grid.after_round_1.append(lambda: grid.contexts.update({node: Context(
        run_id=1, node_id=node, state=RecordDict(), run_config=old.run_config, node_config=old.node_config)}))
    records = federate(recipe, grid, tmp_path)
    assert not [r for r in records if r["kind"] in ("rejoin", "drop")]
    train = {(r["user"], r["round"]): r for r in records if r["kind"] == "train"}
    assert train[("docs", 2)]["resumed_round"] == 1 and "resumed_round" not in train[("code", 2)]


def test_a_second_node_claiming_an_answering_device_is_refused_and_told_why(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe(rounds=1)
    grid = DeviceGrid(recipe, folders, tmp_path)
    impostor = grid.add(1, "impostor")
    records = federate(recipe, grid, tmp_path)
    refused = [r for r in records if r["kind"] == "refused"]
    assert [r["node"] for r in refused] == [impostor] and "claims partition-id 1" in refused[0]["reason"]
    told = [m for m in grid.pushed if m.metadata.dst_node_id == impostor]
    assert told and "claims partition-id 1" in told[0].content["config"][REFUSED]
    assert not any(m.metadata.dst_node_id == impostor for m in grid.pushed[1:])


def test_a_lost_device_leaves_the_others_a_result_when_min_clients_is_met(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe(rounds=2, min_clients=2, reply_timeout_s=1, eval_every=2)
    grid = DeviceGrid(recipe, folders, tmp_path)
    lost = grid.node_of(2)
    grid.after_round_1.append(lambda: grid.contexts.pop(lost))
    records = federate(recipe, grid, tmp_path)
    assert {(r["round"], r["phase"]) for r in records if r["kind"] == "drop"} == {(2, "train"), (2, "evaluate")}
    summary = summarize(records, ["fedavg"], list(USERS))["methods"]["fedavg"]
    assert summary["not_evaluated"] == ["tests"] and sorted(summary["per_user"]) == ["code", "docs"]


def test_a_lost_device_fails_the_method_when_min_clients_is_not_met(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe(rounds=1, min_clients=3, reply_timeout_s=1)
    grid = DeviceGrid(recipe, folders, tmp_path)
    grid.contexts.pop(grid.node_of(2))
    with pytest.raises(Exception, match=r"only 2 of the 3 devices the recipe needs connected"):
        federate(recipe, grid, tmp_path)


def test_a_device_refuses_tensors_it_does_not_hold_or_that_are_misshaped_or_not_finite():
    own = {"a": torch.zeros(2, 3), "n": torch.zeros(2, dtype=torch.long)}
    check_received(own, {"a": torch.ones(2, 3)})
    for received, problem in (({"b": torch.ones(1)}, "does not hold"), ({"a": torch.ones(3, 2)}, "shape"),
                              ({"a": torch.full((2, 3), float("nan"))}, "non-finite"),
                              ({"n": torch.zeros(2)}, "torch.float32")):
        with pytest.raises(ValueError, match=problem):
            check_received(own, received)


def test_node_config_is_checked_and_names_the_fix(tmp_path):
    facts = node_facts({"partition-id": 2, "data-path": str(tmp_path), "state-dir": str(tmp_path / "s")})
    assert (facts.partition_id, facts.data_path, facts.folder("r")) == (2, tmp_path, tmp_path / "s" / "r")
    assert node_facts({"partition-id": 0}).state_dir.name == "partition-0"
    for config, problem in (({}, "no partition-id"), ({"partition-id": "x"}, "not a whole number"),
                            ({"partition-id": -1}, "from 0"), ({"partition-id": "1.5"}, "not a whole number")):
        with pytest.raises(UserError, match=problem) as raised:
            node_facts(config)
        assert "--node-config" in raised.value.fix


def test_a_partition_id_outside_the_recipe_is_refused_on_the_device(tmp_path):
    recipe = device_recipe()
    context = Context(run_id=1, node_id=1, state=RecordDict(), node_config={"partition-id": 5},
                      run_config={"recipe-json": json.dumps(recipe.model_dump(mode="json"))})
    with pytest.raises(UserError, match="partition-id is 5, but the recipe has 3 devices"):
        device_job(context)


def test_a_device_source_names_its_reader_and_is_refused_in_the_simulation(tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    lines = tmp_path / "mine.jsonl"
    lines.write_text('{"text": "hello"}\n')
    table = tmp_path / "mine.csv"
    table.write_text("id,body\n1,a row of mine\n")
    from datasets import Dataset

    Dataset.from_dict({"text": ["saved one", "saved two"]}).save_to_disk(str(tmp_path / "saved"))
    Dataset.from_dict({"body": ["a parquet row"]}).to_parquet(str(tmp_path / "mine.parquet"))
    kinds = [device_source_kind(p) for p in (texts, lines, table, tmp_path / "mine.parquet", tmp_path / "saved")]
    assert kinds == ["text-folder", "files", "files", "files", "saved-dataset"]
    assert list(documents("saved-dataset", {"path": str(tmp_path / "saved")})) == ["saved one", "saved two"]
    assert list(documents("files", {"path": str(table), "text_field": "body"})) == ["a row of mine"]
    assert list(documents("files", {"path": str(tmp_path / "mine.parquet"), "text_field": "body"})) == \
        ["a parquet row"]
    with pytest.raises(UserError, match="does not exist"):
        device_source_kind(tmp_path / "missing")
    with pytest.raises(UserError, match="runs on Flower SuperNodes") as raised:
        documents("device", {})
    assert "--federation" in raised.value.fix


def test_names_that_would_leave_their_folder_are_refused(tmp_path):
    raw = yaml.safe_load(TINY.read_text())
    for key, value, problem in (("name", "../../x", "recipe name '../../x' cannot name a folder"),
                                ("name", "/abs", "cannot name a folder"),
                                ("methods", [{"name": "pretrained", "label": "/tmp/v"}], "method label '/tmp/v'"),
                                ("methods", [{"name": "fedavg", "label": ".."}], "method label '..'")):
        with pytest.raises(UserError, match=problem):
            validate_recipe({**raw, key: value})
    assert folder_name("hermes-w/o-A") == "hermes-w_o-A"
    assert folder_name("mixture-lora:shared+lora:private") == "mixture-lora_shared+lora_private"


def test_a_devices_error_reaches_the_server_whole():
    assert device_error("<class 'ondevice_moe.errors.UserError'>:<'text-folder path /x does not exist\\n  fix: "
                        "check the path'>") == "text-folder path /x does not exist fix: check the path"
    assert device_error("<class 'ValueError'>:<'bad\\nthing'>") == "ValueError: bad thing"
    assert device_error("plain reason") == "plain reason"


def test_federation_connection_config_is_read_from_flower_home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    with pytest.raises(UserError, match="does not exist"):
        connection("lab")
    (tmp_path / "config.toml").write_text('[superlink.lab]\naddress = "127.0.0.1:9091"\ninsecure = true\n')
    assert connection("lab")["insecure"] is True
    with pytest.raises(UserError, match=r"names no SuperLink 'other' \(it has \['lab'\]\)"):
        connection("other")


def test_the_submitted_app_names_the_toolkits_apps_and_carries_the_recipe(tmp_path):
    recipe = load_recipe(TINY)
    app, run_config = write_app(tmp_path, recipe, "my-run", bound={1: "SHA256:abc"})
    import tomli

    project = tomli.loads((app / "pyproject.toml").read_text())
    assert project["tool"]["flwr"]["app"]["components"]["clientapp"] == CLIENT_APP
    config = tomli.loads(run_config.read_text())
    assert validate_recipe(json.loads(config["recipe-json"])) == recipe and config["method"] == ALL_METHODS
    assert config["run-name"] == "my-run" and json.loads(config["bind"]) == {"1": "SHA256:abc"}  # no local path
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as fab:
        fab.writestr("pyproject.toml", (app / "pyproject.toml").read_text())
    _check_app(archive.getvalue())  # the device runtime accepts its own app ...
    with zipfile.ZipFile(archive := io.BytesIO(), "w") as fab:
        fab.writestr("pyproject.toml", (app / "pyproject.toml").read_text().replace(CLIENT_APP, "evil.app:app"))
    with pytest.raises(UserError, match=r"evil\.app:app"):  # ... and no other
        _check_app(archive.getvalue())


def test_a_checkpoint_of_the_wrong_shape_is_one_message(tmp_path):
    from safetensors.torch import save_file

    folders = private_folders(tmp_path / "data")
    recipe = device_recipe(rounds=1)
    federate(recipe, DeviceGrid(recipe, folders, tmp_path), tmp_path)
    own = tmp_path / "device0" / "state" / "on-devices"
    checkpoint = own / "checkpoints" / "fedavg" / "device_0.safetensors"
    tensors = load_file(str(checkpoint))
    name = next(iter(tensors))
    save_file({**tensors, name: torch.zeros(3, 3)}, str(checkpoint))
    with pytest.raises(UserError, match=f"does not fit the recipe's model: {name} has shape \\[3, 3\\]"):
        runner.evaluate_run(own)


def test_a_device_drops_the_previous_methods_state_when_the_next_method_reaches_it():
    from flwr.app import ConfigRecord

    from ondevice_moe.federation.device_state import enter_method

    recipe = load_recipe(TINY)
    fedavg, comigs = Job(recipe, 1, Path(".")), Job(recipe, 2, Path("."))
    context = Context(run_id=1, node_id=3, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    context.state["device-state"] = ConfigRecord({"path": "resumed from its own disk"})
    enter_method(fedavg, context)  # a state with no method named (a device resuming) is kept
    assert context.state["device-state"]["path"] == "resumed from its own disk"
    enter_method(fedavg, context)
    assert "device-state" in context.state
    enter_method(comigs, context)
    assert list(context.state.keys()) == ["device-method"]
    assert context.state["device-method"]["name"] == comigs.method.name
