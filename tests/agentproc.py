"""Run ``gpu-agent`` as a real subprocess in a temporary root, the way users and kubelets see it."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the thing we wait for may not answer yet
            last_exc = exc
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc!r})")


class AgentProcess:
    """``gpu-agent run`` in ``root``. Flags in ``args`` win over the defaults given here (the
    last occurrence of a flag counts); ``launcher`` goes before the interpreter (e.g. a command
    that drops privileges), and with ``make_dirs=False`` the agent finds no directories made
    for it."""

    def __init__(
        self,
        root: Path,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        launcher: list[str] | None = None,
        make_dirs: bool = True,
    ) -> None:
        self.root = root
        # the kubelet's sockets live under the kubelet root: keep them under the 107-byte Unix socket
        # limit, which a pytest tmp_path plus plugins/<driver>/dra.sock passes
        self._short_root: Path | None = None
        if len(str(root / "kubelet" / "plugins" / "gpu-node-agent.nvidia.com" / "dra.sock")) > 107:
            self._short_root = Path(tempfile.mkdtemp(prefix="ga-", dir="/tmp"))
        self.kubelet_root = (self._short_root or root) / "kubelet"
        self.cdi_root = root / "cdi"
        self.state_dir = root / "state"
        if make_dirs:
            for d in (self.kubelet_root / "device-plugins", self.cdi_root, self.state_dir):
                d.mkdir(parents=True, exist_ok=True)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")}
        full_env.update(env or {})
        self.args = [
            *(launcher or []),
            sys.executable,
            "-m",
            "agent",
            "run",
            "--kubelet-root",
            str(self.kubelet_root),
            "--cdi-root",
            str(self.cdi_root),
            "--state-dir",
            str(self.state_dir),
            "--debug-addr",
            "127.0.0.1:0",
            "--node-name",
            "test-node",
            *args,
        ]
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, text=True
        )
        self.lines: list[str] = []
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.port = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            try:
                self._events.put(json.loads(line))
            except ValueError:
                continue

    def wait_port(self, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self._events.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if event.get("event") == "debug endpoint listening":
                self.port = int(str(event["addr"]).rsplit(":", 1)[1])
                return self.port
        raise AssertionError(f"agent never listened; output:\n{self.output()}")

    def output(self) -> str:
        return "\n".join(self.lines)

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                body = resp.read()
                status = resp.status
        except urllib.error.HTTPError as err:
            body, status = err.read(), err.code
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode()

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def state(self) -> dict[str, Any]:
        status, body = self.get("/debug/state")
        assert status == 200, body
        return dict(body)

    def wait_ready(self, timeout: float = 15.0) -> None:
        self.wait_port(timeout)
        wait_for(lambda: self.get("/readyz")[0] == 200, timeout, "/readyz to answer 200")

    def pause(self, timeout: float = 10.0) -> None:
        """SIGSTOP, and wait until the kernel reports the process stopped."""
        self.proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: self._state() == "T", timeout, "the agent to stop")

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def _state(self) -> str:
        # /proc/<pid>/stat: "pid (comm) S ..."; comm may hold spaces, the state follows the last ")"
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]

    def terminate(self, timeout: float = 15.0) -> tuple[int, float]:
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        return code, time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self._reader.join(timeout=5)
        if self._short_root is not None:
            shutil.rmtree(self._short_root, ignore_errors=True)


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30.0, launcher: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_AGENT_")}
    full_env.update(env or {})
    command = [*(launcher or []), sys.executable, "-m", "agent", *args]
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=timeout)
