"""The run's progress and files, carried to the submitting machine by Flower's own log stream.

The submitting machine shares nothing with the server but the network, and open-source Flower
1.41 offers no way to fetch a run's files (``flwr pull`` needs Flower Enterprise's artifact
provider: "No artifact provider is currently supported"). What it does carry is the ServerApp's
output, to anyone who may see the run (``flwr log RUN_ID --stream``), kept in the SuperLink's
database. So the ServerApp writes one line per event there:

    @ondevice-moe hello <nonce>
    @ondevice-moe <nonce> <kind> <JSON>

``kind`` is ``method`` (a method starts), ``round`` (a round ended: the progress line), ``file``
(one part of a run-folder file, base64), ``outcome`` (``finished``, ``failed``, ``busy`` or
``stopped``, and why). The nonce is drawn by the ServerApp and written before any device is
contacted; devices never see the server's log, so no text a device sends (an error message, a
name) can pass for one of these lines. The submitter (:class:`ChannelReader`) takes the first
``hello`` and ignores every other line; files are checked against their SHA-256 and written only
under fixed names (:data:`PULLED`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

PREFIX = "@ondevice-moe"
CHUNK_BYTES = 48 * 1024  # raw bytes per `file` line (64 KiB of base64)
MAX_FILE_BYTES = 64 * 2**20  # a file larger than this stays on the server
# The run-folder files the submitter receives: the report and what it is made of, never a model.
PULLED = re.compile(r"(recipe\.yaml|metrics\.jsonl|summary\.json|report\.md|plots/[A-Za-z0-9][A-Za-z0-9._+-]*\.png)")
OUTCOMES = ("finished", "failed", "busy", "stopped")


class Channel:
    """The ServerApp's side: lines on its standard output, which Flower uploads as the run's log."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.nonce = secrets.token_hex(12)
        self.closed = False  # an outcome was sent: nothing follows it
        self._write(f"{PREFIX} hello {self.nonce}")

    def send(self, kind: str, payload: dict[str, Any]) -> None:
        self._write(f"{PREFIX} {self.nonce} {kind} {json.dumps(payload, sort_keys=True)}")

    def files(self, run_dir: Path) -> None:
        """Send the run folder's :data:`PULLED` files, each in parts of :data:`CHUNK_BYTES`."""
        for path in pulled_files(run_dir):
            data = path.read_bytes()
            if len(data) > MAX_FILE_BYTES:
                continue
            name = path.relative_to(run_dir).as_posix()
            digest = hashlib.sha256(data).hexdigest()
            parts = max(1, -(-len(data) // CHUNK_BYTES))
            for part in range(parts):
                chunk = data[part * CHUNK_BYTES:(part + 1) * CHUNK_BYTES]
                self.send("file", {"name": name, "part": part, "parts": parts, "sha256": digest,
                                   "data": base64.b64encode(chunk).decode("ascii")})

    def outcome(self, status: str, message: str = "", **facts: Any) -> None:
        self.send("outcome", {"status": status, "message": message, **facts})
        self.closed = True
        self.out.flush()
        time.sleep(1.0)  # Flower uploads the log every 0.2 s; give the last lines time to leave

    def _write(self, line: str) -> None:
        self.out.write(line + "\n")  # one write, so the line travels whole
        self.out.flush()


def pulled_files(run_dir: Path) -> list[Path]:
    """The files of ``run_dir`` that travel to the submitter, plain files only (a link is skipped)."""
    found = []
    for path in sorted([*run_dir.glob("*"), *run_dir.glob("plots/*")]):
        name = path.relative_to(run_dir).as_posix()
        if PULLED.fullmatch(name) and path.is_file() and not path.is_symlink():
            found.append(path)
    return found


@dataclass
class ChannelReader:
    """The submitter's side: feed it the log's lines; it keeps the events and the files."""

    nonce: str | None = None
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    _parts: dict[str, dict[int, bytes]] = field(default_factory=dict)
    _expected: dict[str, tuple[int, str]] = field(default_factory=dict)

    def feed(self, line: str) -> tuple[str, dict[str, Any]] | None:
        """Read one line of the log; returns the event it carries (not the files' parts), if any."""
        line = line.rstrip("\r\n")
        if not line.startswith(PREFIX + " "):
            return None
        words = line.split(" ", 3)
        if self.nonce is None:
            if len(words) == 3 and words[1] == "hello":
                self.nonce = words[2]
            return None
        if len(words) != 4 or words[1] != self.nonce:
            return None
        try:
            payload = json.loads(words[3])
        except json.JSONDecodeError:
            return None
        if not isinstance(payload, dict):
            return None
        if words[2] == "file":
            self._file_part(payload)
            return None
        event = (words[2], payload)
        self.events.append(event)
        return event

    @property
    def outcome(self) -> dict[str, Any] | None:
        return next((payload for kind, payload in reversed(self.events) if kind == "outcome"
                     and payload.get("status") in OUTCOMES), None)

    def _file_part(self, payload: dict[str, Any]) -> None:
        try:
            name, part, parts, digest = payload["name"], int(payload["part"]), int(payload["parts"]), payload["sha256"]
            data = base64.b64decode(payload["data"], validate=True)
        except (KeyError, TypeError, ValueError):
            return
        if not (isinstance(name, str) and PULLED.fullmatch(name)) or not 0 <= part < parts:
            return
        if self._expected.get(name, (parts, digest)) != (parts, digest):  # a new copy of the file: start again
            self._parts.pop(name, None)
        self._expected[name] = (parts, digest)
        self._parts.setdefault(name, {})[part] = data

    def files(self) -> dict[str, bytes]:
        """Every file that arrived whole and matches its SHA-256."""
        whole = {}
        for name, (parts, digest) in self._expected.items():
            received = self._parts.get(name, {})
            if len(received) != parts:
                continue
            data = b"".join(received[part] for part in range(parts))
            if len(data) <= MAX_FILE_BYTES and hashlib.sha256(data).hexdigest() == digest:
                whole[name] = data
        return whole
