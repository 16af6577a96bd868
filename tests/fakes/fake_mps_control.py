"""A stand-in for ``nvidia-cuda-mps-control``, installed as that program in a temporary driver root.

Tests copy this file to ``<driver root>/usr/bin/nvidia-cuda-mps-control`` (with this Python as
its interpreter). It behaves like the real program in what the MPS supervisor relies on
(NVIDIA's MPS documentation, "Tools and Interface Reference"):

* ``-d`` starts a control daemon in the background and returns; the daemon listens on a Unix
  socket ``control`` in ``$CUDA_MPS_PIPE_DIRECTORY``, writes ``nvidia-cuda-mps-control.pid``
  there and ``control.log`` in ``$CUDA_MPS_LOG_DIRECTORY``;
* without arguments it is the client: one command from stdin to the daemon, the answer on
  stdout, exit status 0 when the daemon took it; 1 when there is no daemon or it refused;
* the daemon knows ``get_default_active_thread_percentage``, ``set_default_active_thread_percentage
  N``, ``set_default_device_pinned_mem_limit DEV NM`` and ``quit``.

Everything it is told lands in ``<driver root>/fake-mps.log`` (one JSON object per line: role,
pid, command, the three environment variables). ``<driver root>/fake-mps.json`` makes it rude:
``{"start": "fail"}`` (``-d`` fails), ``{"commands": "hang"}`` (the daemon stops answering while
set), ``{"refuse": ["set_default_device_pinned_mem_limit"]}``, ``{"big_reply": true}``. A daemon
exits by itself after ``LIFETIME_S`` so that a broken test leaves nothing running for long.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # <root>/usr/bin/nvidia-cuda-mps-control
KNOBS = ROOT / "fake-mps.json"
RECORD = ROOT / "fake-mps.log"
LIFETIME_S = 60.0
ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def knobs() -> dict[str, Any]:
    try:
        loaded = json.loads(KNOBS.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def record(role: str, **entry: Any) -> None:
    line = {"role": role, "pid": os.getpid(), "env": {k: os.environ.get(k) for k in ENV}, **entry}
    with RECORD.open("a") as file:
        file.write(json.dumps(line) + "\n")


def pipe_dir() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))


def start() -> int:
    record("start", argv=sys.argv[1:])
    if knobs().get("start") == "fail":
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    control = pipe_dir() / "control"
    with contextlib.suppress(OSError):
        control.unlink()
    daemon = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while not control.exists() and daemon.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return 0 if control.exists() else 1


def serve() -> int:
    pipe, log = pipe_dir(), Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    pipe.mkdir(parents=True, exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    (pipe / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(pipe / "control"))
    server.listen(16)
    server.settimeout(0.2)
    record("daemon")
    with (log / "control.log").open("a") as control_log:
        control_log.write(f"[fake] control daemon {os.getpid()} started\n")
    state = {"percentage": "100"}
    born = time.monotonic()
    while time.monotonic() - born < LIFETIME_S:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        with conn:
            command = conn.recv(4096).decode(errors="replace").strip()
            record("command", command=command)
            while knobs().get("commands") == "hang" and time.monotonic() - born < LIFETIME_S:
                time.sleep(0.02)
            reply = answer(command, state)
            conn.sendall(reply.encode())
            if command == "quit":
                break
    for leftover in (pipe / "control", pipe / "nvidia-cuda-mps-control.pid"):
        with contextlib.suppress(OSError):
            leftover.unlink()
    return 0


def answer(command: str, state: dict[str, str]) -> str:
    name, _, argument = command.partition(" ")
    if name in knobs().get("refuse", []):
        return "ERR refused\n"
    if knobs().get("big_reply"):
        return "OK " + "x" * 1_000_000 + "\n"
    if name == "get_default_active_thread_percentage":
        return f"OK {state['percentage']}\n"
    if name == "set_default_active_thread_percentage" and argument.isdigit():
        state["percentage"] = argument
        return "OK\n"
    if name == "set_default_device_pinned_mem_limit" and len(argument.split()) == 2:
        return "OK\n"
    if name == "quit":
        return "OK\n"
    return "ERR unknown command\n"


def client() -> int:
    command = sys.stdin.readline().strip()
    record("client", command=command)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(pipe_dir() / "control"))
    except OSError:
        print("Cannot find MPS control daemon process")
        return 1
    with conn:
        conn.sendall(f"{command}\n".encode())
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    reply = b"".join(chunks).decode(errors="replace")
    status, _, text = reply.partition(" ")
    sys.stdout.write(text if text else "\n")
    return 0 if status.strip() == "OK" else 1


def main() -> int:
    args = sys.argv[1:]
    if args == ["-d"]:
        return start()
    if args == ["--serve"]:
        return serve()
    if args:
        print(f"unknown option {args[0]}", file=sys.stderr)
        return 1
    return client()


if __name__ == "__main__":
    sys.exit(main())
