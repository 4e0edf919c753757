"""The Ray instance a simulation runs on: its own, or the running cluster ``RAY_ADDRESS`` names.

By default Flower's simulation starts a Ray instance for the run and stops it at the end
(``RayBackend.init_ray`` and ``RayBackend.terminate`` in flwr 1.41). Where ``RAY_ADDRESS`` is set,
Ray's own variable for a running cluster (``ray start --head`` prints it), the run joins that
cluster instead. Flower skips its start when this process is already connected, and its
``ray.shutdown()`` at the end then only disconnects, so the cluster outlives the run. Runs that
follow one another skip Ray's start and stop: its GCS server, raylet, dashboard and runtime-env
agents and log monitor (``docs/federation.md`` gives the time saved). The cluster's own
resources size Flower's actor pool (``ray start --num-cpus``).

A joined cluster starts its workers with the environment and working directory of ``ray start``,
so the run hands its actors this process's environment, import path and working directory: they
read the same job file, caches, code and relative paths (the output folder, a recipe's data files)
as the run's own Ray instance's would.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from ondevice_moe.errors import UserError

ADDRESS_ENV = "RAY_ADDRESS"
DIRECTORY_ENV = "ONDEVICE_MOE_RUN_DIRECTORY"  # the run's working directory, for a joined cluster's actors
REACH_TIMEOUT_S = 5.0


def cluster_address() -> str | None:
    """The running cluster the simulation joins, or ``None`` when it starts its own Ray instance."""
    return os.environ.get(ADDRESS_ENV) or None


def actor_environment() -> dict[str, str]:
    """This process's environment for the cluster's workers, with its import path as Flower gives
    its own instance's workers (``sys.path`` first, then ``PYTHONPATH``) and its working directory."""
    environment = own_instance_environment()
    environment["PYTHONPATH"] = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    environment[DIRECTORY_ENV] = os.getcwd()
    return environment


def enter_run_directory() -> None:
    """In an actor of a joined cluster: work in the run's working directory (see
    :func:`actor_environment`); elsewhere nothing to do."""
    directory = os.environ.get(DIRECTORY_ENV)
    if directory:
        os.chdir(directory)


def own_instance_environment() -> dict[str, str]:
    """This process's environment for a child whose simulation must start its own Ray instance, as a
    user's run without ``RAY_ADDRESS`` does (a benchmark that times the run's start or counts the Ray
    processes below it)."""
    return {name: value for name, value in os.environ.items() if name != ADDRESS_ENV}


def check_cluster() -> None:
    """Where ``RAY_ADDRESS`` is set, fail at once unless a cluster listens there: Ray itself would
    retry the address without end."""
    address = cluster_address()
    if address is None or address == "auto":  # "auto": Ray's own search for a cluster on this machine
        return
    host, _, port = address.rpartition(":")
    fix = f"start one with `ray start --head` and set {ADDRESS_ENV} to the address it prints, or unset {ADDRESS_ENV}"
    if not host or not port.isdigit():
        raise UserError(f"{ADDRESS_ENV}={address!r} is not a host:port address of a running Ray cluster", fix)
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as error:
        raise UserError(f"no Ray cluster answers at {ADDRESS_ENV}={address} ({error})", fix) from None


@contextmanager
def simulation_ray() -> Iterator[None]:
    """Inside: the Ray instance Flower's simulation will use. Joins ``RAY_ADDRESS``'s cluster when
    it is set (and leaves it on the way out); otherwise leaves the start to Flower."""
    address = cluster_address()
    if address is None:
        yield
        return
    import ray

    check_cluster()
    ray.init(address=address, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": actor_environment()})
    try:
        yield
    finally:
        ray.shutdown()
