"""A fleet's failures, in-process and in seconds: a server that crashes and continues its run, slots
that belong to SuperNode keys, devices that join late or go offline, a recipe that names a place on a
device, a device's error that must not name its paths, the log channel that carries a run to the
submitter, and the supervisor that keeps a SuperNode running. tests/test_fleet_hosts.py does the same
with real processes on separate network namespaces."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from flwr.app import Context, Error, Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=E0611
from test_devices import USERS, DeviceGrid, device_recipe, private_folders

from ondevice_moe.errors import UserError
from ondevice_moe.federation import device_snapshots, server_app
from ondevice_moe.federation.device_paths import device_paths, refuse_device_paths
from ondevice_moe.federation.job import Job, device_job
from ondevice_moe.federation.log_channel import Channel, ChannelReader
from ondevice_moe.federation.redaction import ELSEWHERE, path_free
from ondevice_moe.federation.round_state import load_round, state_dir
from ondevice_moe.federation.server_runs import RunBusy, RunIdentity, server_lock, server_run_dir
from ondevice_moe.federation.slots import SlotKeeper, fingerprint, node_fingerprints, parse_bindings
from ondevice_moe.federation.submit import _write_files, run_name
from ondevice_moe.federation.supervisor import Supervisor, pause_after, why_it_exited
from ondevice_moe.report import MetricsLog
from ondevice_moe.run_folder import RunFolder


class Crash(RuntimeError):
    """The server's machine going down mid-run."""


def federate(recipe, grid: DeviceGrid, server: Path, identity: RunIdentity | None = None,
             windowed: bool = False) -> list[dict]:
    """One Flower run of a submitted job on ``grid``'s devices (as the ServerApp runs it), into ``server``."""
    job = Job(recipe, 0, server, submitted=True)
    RunFolder(recipe, job.run_dir).prepare()
    log = MetricsLog(job.run_dir / "metrics.jsonl")
    keeper = SlotKeeper(identity) if identity is not None else None
    if keeper is not None:
        keeper.see(grid)
    server_app.run_federation(server_app.windowed(grid, job, True) if windowed else grid, job, log, keeper=keeper,
                              run_key=identity.key if identity else "run-a")
    return log.read()


def final_figures(records: list[dict]) -> dict[str, float]:
    last = max(r["round"] for r in records if r["kind"] == "eval")
    return {r["user"]: r["test_ppl_in"] for r in records if r["kind"] == "eval" and r["round"] == last}


def crash_after(grid: DeviceGrid, trained: int, evaluated: int) -> None:
    """The server crashes the first time it looks for nodes once the devices answered ``trained`` training
    and ``evaluated`` evaluation messages."""
    answered = {"train": 0, "evaluate": 0}
    send, nodes = grid.send_and_receive, grid.get_node_ids

    def send_and_receive(messages, *, timeout=None):
        messages = list(messages)
        for message in messages:
            answered[message.metadata.message_type] = answered.get(message.metadata.message_type, 0) + 1
        return send(messages, timeout=timeout)

    def get_node_ids():
        if answered["train"] >= trained and answered["evaluate"] >= evaluated:
            grid.get_node_ids, grid.send_and_receive = nodes, send
            raise Crash("the server's machine went down")
        return nodes()

    grid.send_and_receive, grid.get_node_ids = send_and_receive, get_node_ids


def record_sent(grid: DeviceGrid) -> list[Message]:
    """The messages the server sends through ``grid`` from now on, as they go."""
    sent: list[Message] = []
    send = grid.send_and_receive

    def send_and_receive(messages, *, timeout=None):
        messages = list(messages)
        sent.extend(messages)
        return send(messages, timeout=timeout)

    grid.send_and_receive = send_and_receive
    return sent


@pytest.mark.parametrize(("rides", "trained", "evaluated", "kept"), [
    (False, 1, 1, 1),  # after round 1 and its own evaluation
    (False, 2, 1, 1),  # after the devices trained round 2, before the server aggregated it
    (True, 1, 0, 1),  # after round 1, its evaluation to ride on round 2's messages
    (True, 2, 0, 2),  # after round 2, whose evaluation was to ride on round 3's
], ids=["after round 1", "after the devices trained round 2", "riding, after round 1", "riding, after round 2"])
def test_a_crashed_server_continues_its_run_and_ends_with_the_figures_of_an_uninterrupted_run(
        tmp_path, rides, trained, evaluated, kept):
    """The server keeps its slots after each round and each device its state of each round it trained, so a
    new Flower run sends the cut round again; a device that had trained it already goes back a round. A
    kept round whose evaluation was to ride on the cut round's messages rides on them when they go again."""
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe({"name": "comigs", "variant": "1G1S"}, rounds=3, evaluation_rides=rides)
    whole = final_figures(federate(recipe, DeviceGrid(recipe, folders, tmp_path / "a"), tmp_path / "a" / "server"))

    grid = DeviceGrid(recipe, folders, tmp_path / "b")
    crash_after(grid, len(USERS) * trained, len(USERS) * evaluated)
    with pytest.raises(Crash):
        federate(recipe, grid, tmp_path / "b" / "server")
    job = Job(recipe, 0, tmp_path / "b" / "server", submitted=True)
    assert load_round(job, {})[0] == kept  # the last completed round
    assert device_snapshots.rounds_kept(device_job(grid.contexts[grid.node_of(0)], 0)) == list(range(1, trained + 1))
    again = DeviceGrid(recipe, folders, tmp_path / "b")  # a new Flower run: fresh contexts, the same disks
    sent = record_sent(again)
    records = federate(recipe, again, tmp_path / "b" / "server")
    assert final_figures(records) == whole  # to the last digit
    assert [r["round"] for r in records if r["kind"] == "resume"] == [kept]
    configs = [m.content.config_records["config"] for m in sent if m.metadata.message_type == "train"]
    carried = {int(c["server-round"]): int(c["evaluate-round"]) for c in configs if "evaluate-round" in c}
    assert carried == ({r + 1: r for r in range(kept, 3)} if rides else {})
    assert sorted(r["round"] for r in records if r["kind"] == "comm") == [1, 2, 3]  # the cut round once, not twice
    assert sorted((r["round"], r["user"]) for r in records if r["kind"] == "eval") == sorted(
        (server_round, user) for server_round in (1, 2, 3) for user in USERS)  # every evaluation once
    train = {(r["user"], r["round"]): r for r in records if r["kind"] == "train"}
    assert train[("code", kept + 1)]["resumed_round"] == kept  # it came back from its own disk


def test_a_slot_belongs_to_the_key_that_first_claimed_it_across_restarts_and_a_bound_key_wins(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe(rounds=1, min_clients=2, join_wait_s=0)
    keys = {device: _key(device) for device in range(4)}
    grid = KeyedGrid(recipe, folders, tmp_path, keys)
    for server in ("server", "bound"):
        (tmp_path / server).mkdir()
    identity = RunIdentity.open(tmp_path / "server", {})
    federate(recipe, grid, tmp_path / "server", identity)
    assert identity.claims == {device: fingerprint(keys[device][1]) for device in range(3)}
    # A later Flower run of the same run: a registered node with another key claims device 1 first.
    grid = KeyedGrid(recipe, folders, tmp_path / "again", keys)
    impostor = 1  # the lowest node id: asked first
    honest = grid.contexts[grid.node_of(1)]
    grid.contexts[impostor] = Context(run_id=1, node_id=impostor, state=RecordDict(), run_config=honest.run_config,
                                      node_config={**honest.node_config, "state-dir": str(tmp_path / "impostor")})
    grid.keys[impostor] = keys[3]
    records = federate(recipe, grid, tmp_path / "server2", RunIdentity.open(tmp_path / "server", {}))
    refused = [r["reason"] for r in records if r["kind"] == "refused"]
    assert len(refused) == 1 and f"node {impostor}" in refused[0] and "held in this run by key" in refused[0]
    assert {r["user"] for r in records if r["kind"] == "eval"} == set(USERS)  # the real device 1 took part
    # Bound up front, a slot refuses every other key, even the first to ask.
    bound = RunIdentity.open(tmp_path / "bound", {1: fingerprint(keys[3][1])})
    grid = KeyedGrid(recipe, folders, tmp_path / "third", keys)
    records = federate(recipe, grid, tmp_path / "bound", bound)
    refused = [r["reason"] for r in records if r["kind"] == "refused"]
    assert refused and "bound to key" in refused[0]


def test_only_a_key_registered_before_its_node_came_online_holds_a_slot():
    """Without SuperNode authentication a SuperNode registers a key it just made as it connects: a
    restarted device has another, so such keys hold no slot (the liveness rule decides instead)."""
    public = _key(0)[1]
    operator = NodeInfo(node_id=1, public_key=public, registered_at="2026-12-05T10:00:00+00:00",
                        last_activated_at="2026-12-05T10:05:00+00:00")
    itself = NodeInfo(node_id=2, public_key=public, registered_at="2026-12-05T10:05:00.010000+00:00",
                      last_activated_at="2026-12-05T10:05:00.040000+00:00")
    assert node_fingerprints([operator, itself, NodeInfo(node_id=3)]) == {1: fingerprint(public), 2: None, 3: None}


def test_bindings_name_users_and_key_files(tmp_path):
    for device in (0, 1):
        (tmp_path / f"d{device}.pub").write_bytes(_key(device)[1])
    users = list(USERS)
    bound = parse_bindings([f"docs={tmp_path / 'd1.pub'}"], users)
    assert bound == {1: fingerprint(_key(1)[1])} and bound[1].startswith("SHA256:")
    for pairs, problem in (([f"nobody={tmp_path / 'd0.pub'}"], "does not have"), (["docs"], "not USER=FILE"),
                           ([f"docs={tmp_path / 'missing.pub'}"], "cannot read"),
                           ([f"code={tmp_path / 'd0.pub'}", f"docs={tmp_path / 'd0.pub'}"], "one key to two users")):
        with pytest.raises(UserError, match=problem):
            parse_bindings(pairs, users)


def test_ssh_keygen_prints_the_fingerprint_the_report_names(tmp_path):
    subprocess.run(["ssh-keygen", "-t", "ecdsa", "-b", "384", "-N", "", "-q", "-f", str(tmp_path / "k")], check=True)
    printed = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "k.pub")], capture_output=True, text=True,
                             check=True).stdout.split()[1]
    from cryptography.hazmat.primitives import serialization

    pem = serialization.load_ssh_public_key((tmp_path / "k.pub").read_bytes()).public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    assert fingerprint(pem) == fingerprint((tmp_path / "k.pub").read_bytes()) == printed


def test_a_method_starts_with_min_clients_and_a_late_device_joins_from_the_next_round(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe(rounds=3, min_clients=2, join_wait_s=0, eval_every=3)
    grid = DeviceGrid(recipe, folders, tmp_path)
    late = grid.contexts.pop(grid.node_of(2))
    nodes = grid.get_node_ids

    def get_node_ids():  # device 2's SuperNode connects once round 1 is under way
        if grid.train_replies >= 2:
            grid.contexts[late.node_id] = late
        return nodes()

    grid.get_node_ids = get_node_ids
    records = federate(recipe, grid, tmp_path / "server")
    assert [(r["device"], r["kind"]) for r in records if r["kind"] in ("join", "rejoin")] == [(2, "join")]
    trained = {(r["user"], r["round"]) for r in records if r["kind"] == "train"}
    assert ("tests", 1) not in trained and ("tests", 2) in trained
    drops = [r for r in records if r["kind"] == "drop"]
    assert [(r["round"], r["reason"]) for r in drops] == [(1, "not connected: no node holds partition-id 2")]
    assert {r["user"] for r in records if r["kind"] == "eval"} == set(USERS)


def test_a_device_that_went_offline_is_dropped_for_that_and_not_for_a_timeout(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe(rounds=1, min_clients=2, reply_timeout_s=600)
    grid = OfflineGrid(recipe, folders, tmp_path, offline=2)
    records = federate(recipe, grid, tmp_path / "server", windowed=True)
    reasons = {r["phase"]: r["reason"] for r in records if r["kind"] == "drop"}
    assert reasons == {"train": "went offline (Flower: its SuperNode stopped or missed its heartbeats)",
                       "evaluate": "went offline (Flower: its SuperNode stopped or missed its heartbeats)"}


def test_a_recipe_that_names_a_place_on_a_device_is_refused_before_anything_is_sent(tmp_path):
    recipe = device_recipe()
    assert device_paths(recipe) == []
    raw = recipe.model_dump(mode="json")
    raw["data"]["users"][1] = {"name": "docs", "sources": [{"source": "files", "path": "~/.ssh/id_rsa"}]}
    raw["model"]["name"] = "/home/someone/model"
    from ondevice_moe.recipe import validate_recipe

    with pytest.raises(UserError, match=r"names places on the devices' disks") as raised:
        refuse_device_paths(validate_recipe(raw))
    assert "id_rsa" in raised.value.problem and "model.name: /home/someone/model" in raised.value.problem
    assert "source: device" in raised.value.fix
    # ... and a device asked for it anyway refuses it (a server that skipped the check).
    grid = DeviceGrid(validate_recipe({**raw, "model": recipe.model.model_dump()}), private_folders(tmp_path / "d"),
                      tmp_path)
    job = device_job(grid.contexts[grid.node_of(1)], 0)
    from ondevice_moe.federation.device import user_data

    with pytest.raises(UserError, match="reads only its own --node-config data-path"):
        user_data(job, 1)


def test_a_device_reads_nothing_through_a_link_out_of_its_data_path(tmp_path):
    folders = private_folders(tmp_path / "data")
    (tmp_path / "secret.txt").write_text("not for the server")
    (folders[0] / "innocent.txt").symlink_to(tmp_path / "secret.txt")
    recipe = device_recipe()
    grid = DeviceGrid(recipe, folders, tmp_path)
    from ondevice_moe.federation.device import user_data

    with pytest.raises(UserError, match=r"innocent\.txt, a link that leads out of the data-path"):
        user_data(device_job(grid.contexts[grid.node_of(0)], 0), 0)


def test_a_devices_error_reaches_the_server_without_its_paths(tmp_path):
    folders = private_folders(tmp_path / "data")
    missing = tmp_path / "nowhere" / "my-private-notes"
    recipe = device_recipe(rounds=1, min_clients=2)
    grid = DeviceGrid(recipe, folders, tmp_path)
    grid.contexts[grid.node_of(2)].node_config["data-path"] = str(missing)
    records = federate(recipe, grid, tmp_path / "server")
    reasons = [r["reason"] for r in records if r["kind"] == "drop"]
    assert reasons and all("does not exist" in reason and "<data-path>" in reason for reason in reasons)
    assert "my-private-notes" not in (tmp_path / "server" / "metrics.jsonl").read_text()


def test_path_free_names_a_devices_own_folders_and_hides_any_other_path():
    from ondevice_moe.federation.node import node_facts

    node = node_facts({"partition-id": 0, "data-path": "/srv/alice data", "state-dir": "/var/lib/od"})
    text = ("cannot read /srv/alice data/notes/a.txt; state /var/lib/od/x/round-1.pb damaged; /etc/passwd too; "
            "~/.ssh/id_rsa; see https://flower.ai/docs and 3/4 of rows")
    cleaned = path_free(text, node)
    assert "alice" not in cleaned and "/var/lib" not in cleaned and "passwd" not in cleaned and ".ssh" not in cleaned
    assert cleaned.count("<data-path>") == 1 and cleaned.count("<state-dir>") == 1 and cleaned.count(ELSEWHERE) == 2
    assert "https://flower.ai/docs" in cleaned and "3/4 of rows" in cleaned


def test_the_log_channel_carries_events_and_files_and_nothing_a_device_could_forge(tmp_path):
    run = tmp_path / "run"
    (run / "plots").mkdir(parents=True)
    (run / "report.md").write_text("# the report\n")
    (run / "plots" / "rounds.png").write_bytes(os.urandom(140_000))  # three parts
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "server.safetensors").write_bytes(b"weights stay on the server")
    (run / "summary.json").symlink_to(tmp_path / "elsewhere")  # a link is never sent
    out = io.StringIO()
    forged = "@ondevice-moe hello 0000\n@ondevice-moe 0000 outcome {\"status\": \"finished\"}\n"
    channel = Channel(out)
    out.write(forged)  # a device's text in the server's log cannot carry the nonce
    channel.send("round", {"round": 1, "total": 2, "line": "round 1"})
    channel.files(run)
    out.write(f"@ondevice-moe {channel.nonce} file " + '{"name": "../../etc/x", "part": 0, "parts": 1, '
              '"sha256": "0", "data": ""}\n')
    channel.outcome("finished", "")
    reader = ChannelReader()
    events = [event for line in out.getvalue().splitlines(keepends=True) if (event := reader.feed(line))]
    assert [kind for kind, _ in events] == ["round", "outcome"] and reader.outcome["status"] == "finished"
    files = reader.files()
    assert sorted(files) == ["plots/rounds.png", "report.md"]
    assert files["plots/rounds.png"] == (run / "plots" / "rounds.png").read_bytes()
    broken = ChannelReader()  # a part lost on the way: the file does not arrive at all
    lines = [line for line in out.getvalue().splitlines(keepends=True) if '"part": 1, "parts": 3' not in line]
    for line in lines:
        broken.feed(line)
    assert sorted(broken.files()) == ["report.md"]


def test_the_submitter_writes_what_arrives_whole_and_never_through_a_link(tmp_path):
    (tmp_path / "target").write_text("kept")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report.md").symlink_to(tmp_path / "target")
    _write_files(tmp_path / "out", {"report.md": b"# pulled", "plots/a.png": b"png"})
    assert (tmp_path / "target").read_text() == "kept"
    assert not (tmp_path / "out" / "report.md").is_symlink() and (tmp_path / "out" / "report.md").read_text() == \
        "# pulled"
    assert (tmp_path / "out" / "plots" / "a.png").read_bytes() == b"png"
    assert run_name(tmp_path / "out") == "out"
    with pytest.raises(UserError, match="cannot name a folder"):
        run_name(tmp_path / "a b")


def test_one_serverapp_drives_a_run_folder_and_a_second_is_told_which(tmp_path, monkeypatch):
    monkeypatch.setenv("ONDEVICE_MOE_RUNS", str(tmp_path / "runs"))
    folder = server_run_dir("mine")
    assert folder == tmp_path / "runs" / "mine"
    with pytest.raises(UserError, match="cannot name a folder"):
        server_run_dir("../x")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from ondevice_moe.federation.server_runs import server_lock\n"
        f"with server_lock(Path({str(folder)!r}), 41):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunBusy) as busy, server_lock(folder, 42):
            pass
        assert busy.value.flower_run == 41
    finally:
        holder.kill()
        holder.wait()
    with server_lock(folder, 43):  # its holder died: the kernel let go of the lock
        assert json.loads((folder / ".server.lock").read_text())["flower_run"] == 43
    identity = RunIdentity.open(folder, {0: "SHA256:a"})
    assert RunIdentity.open(folder, {}).key == identity.key and RunIdentity.open(folder, {}).bound == {0: "SHA256:a"}


def test_the_supervisor_starts_an_exiting_supernode_again_with_growing_pauses(tmp_path, monkeypatch):
    assert [pause_after(n) for n in (1, 2, 3, 10)] == [2.0, 4.0, 8.0, 60.0]
    monkeypatch.setattr("ondevice_moe.federation.supervisor.FIRST_PAUSE_S", 0.05)
    assert "305" in why_it_exited(305) and "heartbeats" in why_it_exited(305)
    said = []
    refused = "print('ERROR :     Exit Code: 305'); raise SystemExit(1)"  # as flower-supernode says it
    supervisor = Supervisor([sys.executable, "-c", refused], lambda *a: said.append(a))
    supervisor.start()
    deadline = time.monotonic() + 20
    while supervisor.starts < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    supervisor.stop()
    assert supervisor.starts >= 3 and any("305" in str(args) for args in said)
    stopped = tmp_path / "stopped"
    lasting = Supervisor([sys.executable, "-c", (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(stopped)!r}, 'w').write('graceful'), sys.exit(0)))\n"
        "time.sleep(60)")], lambda *a: None)
    lasting.start()
    time.sleep(1.0)
    lasting.stop()
    assert stopped.read_text() == "graceful" and lasting.starts == 1  # SIGTERM, not SIGKILL; not started again


def test_a_devices_private_state_stays_on_its_disk_and_out_of_the_message_path(tmp_path):
    """A real device's Flower context, which passes through its SuperNode with every message, names its
    state's file: CoMiGS's private experts, routers and AdamW moments stay on the device's disk."""
    from flwr.common.serde import context_to_proto

    folders = private_folders(tmp_path / "data")
    recipe = device_recipe({"name": "comigs", "variant": "1G1S"}, rounds=1)
    grid = DeviceGrid(recipe, folders, tmp_path)
    federate(recipe, grid, tmp_path / "server")
    job = device_job(grid.contexts[grid.node_of(0)], 0)
    private = device_snapshots.state_folder(job) / "private-1.safetensors"
    for context in grid.contexts.values():  # the recipe travels in its run config; its state is a file's name
        assert context_to_proto(context).state.ByteSize() < 1024 < private.stat().st_size


def test_a_paced_supernode_waits_at_most_its_poll_and_runs_flowers_own_loop():
    from flwr.supernode import start_client_internal

    from ondevice_moe.federation.supernode_pace import PacedTime, pace
    from ondevice_moe.federation.supervisor import supernode_command

    slept = []
    clock = type("Clock", (), {"sleep": staticmethod(slept.append), "monotonic": staticmethod(lambda: 7)})
    paced = PacedTime(0.5, real=clock())
    paced.sleep(3)  # before asking the SuperLink again: the poll
    paced.sleep(0.5)  # on its own memory (a reply, a reply's bytes): milliseconds
    paced.sleep(0.01)
    assert slept == [0.5, 0.02, 0.01] and paced.monotonic() == 7
    original = start_client_internal.time
    try:
        pace(0.25)
        assert start_client_internal.time.poll_s == 0.25  # Flower's loop now sleeps through it
    finally:
        start_client_internal.time = original
    command = supernode_command("10.0.0.1:9093", "partition-id=0", 9094, None, None, 0.5)
    assert command[1:4] == ["-m", "ondevice_moe.federation.supernode_pace", "0.5"] and "--insecure" in command


def test_prompt_pulls_ask_again_after_milliseconds_where_flower_waits_a_second_then_two():
    """An object not stored yet is asked for again after 20 ms, then 40: three tries take well under
    Flower's first two waits (0.8-1.2 s, then 1.6-2.4 s)."""
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

    from ondevice_moe.federation.prompt_pulls import FIRST_RETRY_S, prompt

    module = types.ModuleType("a_flower_module")
    module.pull_objects = inflatable_utils.pull_objects
    prompt(module)
    prompt(module)  # a second call changes nothing
    assert module.pull_objects.func is inflatable_utils.pull_objects
    assert module.pull_objects.keywords == {"initial_backoff": FIRST_RETRY_S}
    tries = []

    def pull(object_id: str) -> bytes:
        tries.append(object_id)
        if len(tries) < 3:
            raise ObjectUnavailableError(object_id)
        return b"content"

    started = time.monotonic()
    assert module.pull_objects(["an-object"], pull_object_fn=pull) == {"an-object": b"content"}
    assert len(tries) == 3 and time.monotonic() - started < 1.5
    with pytest.raises(RuntimeError, match="does not know"):
        prompt(types.ModuleType("pulls_nothing"))


def test_the_server_supernode_and_device_pull_promptly():
    from flwr.superlink.grid import http_grid
    from flwr.supernode import start_client_internal
    from flwr.supernode.runtime import run_clientapp

    from ondevice_moe.federation.prompt_pulls import FIRST_RETRY_S, prompt_device, prompt_server, prompt_supernode

    originals = (http_grid.pull_objects, start_client_internal.pull_objects,
                 run_clientapp.pull_and_inflate_object_from_tree)
    try:
        prompt_server(), prompt_supernode(), prompt_device()
        for pull in (http_grid.pull_objects, start_client_internal.pull_objects,
                     run_clientapp.pull_and_inflate_object_from_tree):
            assert pull.keywords == {"initial_backoff": FIRST_RETRY_S}
    finally:
        (http_grid.pull_objects, start_client_internal.pull_objects,
         run_clientapp.pull_and_inflate_object_from_tree) = originals


def test_a_device_keeps_its_last_two_rounds_and_forgets_another_runs_state(tmp_path):
    folders = private_folders(tmp_path / "data")
    recipe = device_recipe(rounds=3)
    federate(recipe, DeviceGrid(recipe, folders, tmp_path), tmp_path / "server")
    grid = DeviceGrid(recipe, folders, tmp_path)
    job = device_job(grid.contexts[grid.node_of(0)], 0)
    assert device_snapshots.rounds_kept(job) == [2, 3]
    assert sorted(p.name for p in device_snapshots.state_folder(job).glob("private-*")) == \
        ["private-2.safetensors", "private-3.safetensors"]
    context = Context(run_id=9, node_id=1, state=RecordDict(), run_config={}, node_config={})
    assert device_snapshots.restore(job, context, "run-a", 2) == (2, True)
    device_snapshots.enter_run(job, "another-run")
    assert device_snapshots.rounds_kept(job) == []
    assert not state_dir(Job(recipe, 0, tmp_path / "server", submitted=True)).exists()  # a finished method's


# -- grids whose nodes prove keys, or go offline ----------------------------------------------------


def _key(index: int) -> tuple[object, bytes]:
    """A deterministic P-384 key pair's public half as Flower holds it (PEM)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.derive_private_key(1000 + index, ec.SECP384R1())
    return private, private.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo)


class KeyedGrid(DeviceGrid):
    """Nodes that authenticated with a key each (``keys``: device → key pair), registered by an operator a
    minute before they came online, as Flower lists them."""

    def __init__(self, recipe, folders, root, keys) -> None:
        super().__init__(recipe, folders, root)
        self.keys = {node: keys[context.node_config["partition-id"]] for node, context in self.contexts.items()}

    def get_nodes(self):
        return [NodeInfo(node_id=node, public_key=self.keys.get(node, (None, b""))[1],
                         registered_at="2026-12-05T10:00:00+00:00", last_activated_at="2026-12-05T10:01:00+00:00")
                for node in self.contexts]


class OfflineGrid(DeviceGrid):
    """Messages pushed and pulled as on the deployment engine; device ``offline``'s node missed its
    heartbeats, so the SuperLink answers its messages itself, with Flower's ``NODE_UNAVAILABLE`` error."""

    def __init__(self, recipe, folders, root, offline: int) -> None:
        super().__init__(recipe, folders, root)
        self.offline = self.node_of(offline)
        self.waiting: dict[str, Message] = {}

    def push_messages(self, messages):
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"m{len(self.waiting)}-{time.monotonic_ns()}"
            if message.metadata.dst_node_id == self.offline and message.metadata.message_type != "query":
                reply = Message(Error(5, "Error: Node Unavailable"), reply_to=message)
                reply.metadata.__dict__["_src_node_id"] = 0  # written by the SuperLink, not the node
            else:
                reply = self.send_and_receive([message])[0]
            self.waiting[message.metadata.message_id] = reply
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        return [self.waiting.pop(message_id) for message_id in list(message_ids) if message_id in self.waiting]
