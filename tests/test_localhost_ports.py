"""Ports for the localhost federation (ondevice_moe/federation/localhost.py): never from the
kernel's ephemeral range, where an outgoing connection could take one before its server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ondevice_moe.federation import localhost
from ondevice_moe.federation.localhost import free_port


def test_a_free_port_lies_below_the_ephemeral_range_and_can_be_bound():
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(localhost.LOWEST_PORT <= port < first_ephemeral for port in ports)
    assert len(ports) > 1  # drawn at random, so parallel workers rarely meet
    for port in ports:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(localhost, "LOWEST_PORT", port)
        monkeypatch.setattr(localhost, "_first_ephemeral_port", lambda: port + 1)  # the only candidate is taken
        assert free_port() != port


@pytest.mark.parametrize("content", [None, "", "not a range"])
def test_without_a_known_ephemeral_range_the_kernel_picks(monkeypatch, tmp_path, content):
    path = tmp_path / "ip_local_port_range"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(localhost, "EPHEMERAL_PORTS", path)
    port = free_port()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
