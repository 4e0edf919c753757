"""``ondevice-moe device``: one long-lived process per device that runs every message of the
toolkit's ClientApp, so the toolkit is imported and the base model loaded once per device.

Flower 1.41 runs each message a SuperNode receives in a fresh ``flwr-clientapp`` process
(``--isolation subprocess``, the default), which imports torch and transformers and loads the
base model again every time (11–13 s here). With ``--isolation process`` the SuperNode instead
hands its tasks to whatever executor asks for them on its Runtime API; this module is such an
executor. It asks the SuperNode for ClientApp tasks (``AcquireTask``), and runs each in this
process as ``flwr-clientapp`` would (``flwr.supernode.runtime.run_clientapp``: pull the message
and context, call the app, push the reply and the context back), caching the base model, the
user's data and the built job between messages.

It runs the ClientApp installed here (``ondevice_moe.federation.client_app:app``) and nothing
else: a run whose Flower app (FAB) names another ClientApp is refused, so the server cannot make
the device execute code of its choosing.

A device comes and goes: its SuperNode restarts (``ondevice-moe device --superlink``, which keeps
one running, :mod:`ondevice_moe.federation.supervisor`), or the device is paused past the server's
reply timeout and finds its task's token expired when it wakes. Neither ends this process: a
SuperNode that does not answer is asked again after :data:`RETRY_SECONDS`, and a task that cannot
be finished is given up (said in the device's log) while the next one is taken.

Each task runs in a thread of its own, and one at a time holds the device (:data:`DEVICE`): a task
whose message can never arrive does not hold up the next. That happens when a server dies while it
sends: the SuperNode keeps the task of the message it could not finish receiving, and Flower's pull
of its contents waits for up to two hours, while the server's next Flower run waits for this device.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable
from logging import ERROR, INFO, WARNING
from pathlib import Path

from ondevice_moe.errors import UserError
from ondevice_moe.federation.prompt_pulls import prompt_device

CLIENT_APP = "ondevice_moe.federation.client_app:app"
POLL_SECONDS = 0.2
RETRY_SECONDS = 2.0
DEVICE = threading.Lock()  # one ClientApp at a time: the device's model, data and cores


def serve(runtime_api: str, root_certificates: Path | None = None,
          keep_going: Callable[[], bool] = lambda: True) -> None:
    """Run the device's ClientApp tasks from the SuperNode at ``runtime_api`` (its ``--port``) until
    ``keep_going`` says stop (never, from the command line: stop it with a signal)."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
    from flwr.supercore import log
    from flwr.supercore.constant import TaskType

    certificates = _certificates(runtime_api, root_certificates)
    executor = _runtime_client(runtime_api, certificates, token=None)
    prompt_device()
    log(INFO, "ondevice-moe device: taking ClientApp tasks from the SuperNode at %s", runtime_api)
    while keep_going():
        try:
            response = executor.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        except Exception as error:  # the SuperNode is restarting, or not up yet
            log(WARNING, "the SuperNode at %s does not answer (%s); asking again in %.0f s", runtime_api,
                type(error).__name__, RETRY_SECONDS)
            time.sleep(RETRY_SECONDS)
            continue
        if response.HasField("task") and response.token:
            threading.Thread(target=_run_or_give_up, args=(runtime_api, response.token, certificates),
                             name=f"task-{response.task.task_id}", daemon=True).start()
        else:
            time.sleep(POLL_SECONDS)


def _run_or_give_up(runtime_api: str, token: str, certificates: bytes | None) -> None:
    from flwr.supercore import log

    try:
        run_task(runtime_api, token, certificates)
    except Exception as error:  # e.g. its token expired while the device was paused: the next task goes on
        log(WARNING, "gave up a task: %s: %s", type(error).__name__, error)


def run_task(runtime_api: str, token: str, certificates: bytes | None) -> None:
    """One ClientApp task in this process, as ``flwr-clientapp`` runs it in a process of its own."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore import log
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    from ondevice_moe.federation.client_app import app

    client = _runtime_client(runtime_api, certificates, token)
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "the ClientApp task failed"
    try:
        message, context, _, fab = pull_task_input(client)
        _check_app(fab.content)
        with DEVICE:
            reply = app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as error:  # reported to the server as Flower reports a ClientApp's exception
        log(ERROR, "the ClientApp raised %s: %s", type(error).__name__, error)
        details = f"{type(error)}:<'{error}'>"
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client, context, status, details)
        finally:
            heartbeat.stop()
            client.close()


def _check_app(fab: bytes) -> None:
    """Refuse a run whose Flower app names a ClientApp other than the toolkit's."""
    from flwr.common.config import get_fab_config

    components = get_fab_config(fab).get("tool", {}).get("flwr", {}).get("app", {}).get("components", {})
    named = components.get("clientapp")
    if named != CLIENT_APP:
        raise UserError(f"the server's app names the ClientApp {named!r}; this device runs only {CLIENT_APP!r}",
                        "submit with `ondevice-moe finetune --federation`, or run the SuperNode with its default "
                        "--isolation subprocess to run other Flower apps")


def _runtime_client(runtime_api: str, certificates: bytes | None, token: str | None):
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors = [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp" if token else "SuperExec")]
    if token:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    return RuntimeHttpClient.from_server_address(server_address=runtime_api, insecure=certificates is None,
                                                 root_certificates=certificates, interceptors=interceptors,
                                                 retry_invoker=make_simple_http_retry_invoker())


def _certificates(runtime_api: str, root_certificates: Path | None) -> bytes | None:
    """The CA that signed the SuperNode's Runtime API certificate; without one, the link is plain
    HTTP, which is only sound on this machine's loopback (a warning says so otherwise)."""
    from flwr.supercore import log

    if root_certificates is not None:
        try:
            return root_certificates.read_bytes()
        except OSError as error:
            raise UserError(f"cannot read {root_certificates} ({error.strerror})",
                            "give the CA certificate of the SuperNode's --ssl-certfile") from None
    host = runtime_api.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        log(WARNING, "the SuperNode's Runtime API at %s is reached without TLS off this machine; give "
                     "--root-certificates", runtime_api)
    return None
