"""Bearer credentials for API requests: a fixed token, a token file, or an exec plugin.

The client asks :meth:`Credentials.header` before each request and calls
:meth:`Credentials.expire` after a 401, then retries once if the header changed.

* A token file (projected service-account tokens rotate about hourly) is re-read when its
  inode, size or mtime changes: one ``stat`` per request, no read unless it changed.
* An exec plugin (``client.authentication.k8s.io`` ExecCredential, as kubectl runs them) is
  run without a terminal, with a time limit and a bound on its output, and its token is kept
  until ``expirationTimestamp`` (less a little skew) or a 401. Concurrent requests share one
  run. Plugins that answer with a client certificate are refused: switching TLS identity
  would mean a new connection pool, and every cloud plugin in use returns tokens.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from agent.kube.access import ClusterAccess, ExecConfig
from agent.kube.errors import KubeError

#: how long an exec plugin may run before it is killed
EXEC_TIMEOUT_S = 20.0
#: how much of a plugin's stdout is read; an ExecCredential is a few KiB
EXEC_MAX_OUTPUT = 1024 * 1024
#: a token is renewed this long before its expirationTimestamp
EXPIRY_SKEW_S = 10.0


class Credentials(Protocol):
    async def header(self) -> str:
        """The Authorization header value, or "" for none. Raises KubeError when unavailable."""
        ...

    def expire(self) -> None:
        """The server answered 401 with the current header: read or run it afresh next time."""
        ...


class NoCredentials:
    """Client certificates (or nothing): no Authorization header."""

    async def header(self) -> str:
        return ""

    def expire(self) -> None:
        return None


class StaticToken:
    def __init__(self, token: str) -> None:
        self._header = f"Bearer {token}"

    async def header(self) -> str:
        return self._header

    def expire(self) -> None:
        return None


class TokenFile:
    """A token file, re-read when it changes (and after a 401)."""

    def __init__(self, path: Path, *, source: str) -> None:
        self._path = path
        self._source = source
        self._key: tuple[int, int, int] | None = None
        self._header = ""

    async def header(self) -> str:
        try:
            st = self._path.stat()
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            if key != self._key:
                token = self._path.read_text(errors="replace").strip()
                self._key, self._header = key, f"Bearer {token}" if token else ""
        except OSError as exc:
            raise KubeError(
                f"{self._source}: cannot read token {self._path}: {exc.strerror or exc}", recoverable=True
            ) from exc
        return self._header

    def expire(self) -> None:
        self._key = None


class ExecPlugin:
    """Runs a kubeconfig's exec credential plugin and keeps its token until it expires."""

    def __init__(
        self,
        config: ExecConfig,
        *,
        access: ClusterAccess,
        timeout_s: float = EXEC_TIMEOUT_S,
        max_output: int = EXEC_MAX_OUTPUT,
        wall: Callable[[], float] = time.time,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self._config = config
        self._access = access
        self._timeout_s = timeout_s
        self._max_output = max_output
        self._wall = wall
        self._base_env = base_env
        self._lock = asyncio.Lock()
        self._header = ""
        #: wall-clock time after which the token is run for again (inf: until a 401)
        self._renew_at = 0.0
        #: completed plugin runs, for tests and /debug
        self.runs = 0

    async def header(self) -> str:
        if self._header and self._wall() < self._renew_at:
            return self._header
        async with self._lock:
            if self._header and self._wall() < self._renew_at:
                return self._header  # another request ran it while this one waited
            token, expires = await self._run()
            self._header = f"Bearer {token}"
            self._renew_at = float("inf") if expires is None else expires - EXPIRY_SKEW_S
            return self._header

    def expire(self) -> None:
        self._renew_at = 0.0

    @property
    def _what(self) -> str:
        return f"{self._access.source}: exec plugin {self._config.command!r}"

    async def _run(self) -> tuple[str, float | None]:
        env = dict(os.environ if self._base_env is None else self._base_env)
        env.update(self._config.env)
        env["KUBERNETES_EXEC_INFO"] = json.dumps(self._exec_info())
        try:
            proc = await asyncio.create_subprocess_exec(
                self._config.command,
                *self._config.args,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise KubeError(f"{self._what} cannot be started: {exc.strerror or exc}", recoverable=True) from exc
        try:
            assert proc.stdout is not None and proc.stderr is not None
            # asyncio.timeout, not wait_for, which on 3.11 can swallow a cancellation
            async with asyncio.timeout(self._timeout_s):
                out, err = await asyncio.gather(
                    _read_bounded(proc.stdout, self._max_output), _read_bounded(proc.stderr, 4096)
                )
                code = await proc.wait()
        except TimeoutError as exc:
            raise KubeError(f"{self._what} did not finish within {self._timeout_s:g}s", recoverable=True) from exc
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self.runs += 1
        if code != 0:
            detail = " ".join(err.decode(errors="replace").split())[:300]
            raise KubeError(f"{self._what} exited with {code}: {detail or 'no message'}", recoverable=True)
        if len(out) > self._max_output:
            raise KubeError(f"{self._what} printed more than {self._max_output} bytes", recoverable=True)
        return self._parse(out)

    def _exec_info(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"interactive": False}
        if self._config.provide_cluster_info:
            cluster: dict[str, Any] = {"server": self._access.server}
            if self._access.ca_data:
                cluster["certificate-authority-data"] = base64.b64encode(self._access.ca_data.encode()).decode()
            if self._access.insecure:
                cluster["insecure-skip-tls-verify"] = True
            spec["cluster"] = cluster
        return {"apiVersion": self._config.api_version, "kind": "ExecCredential", "spec": spec}

    def _parse(self, out: bytes) -> tuple[str, float | None]:
        try:
            doc = json.loads(out)
        except (ValueError, RecursionError) as exc:
            raise KubeError(f"{self._what} printed no JSON ExecCredential: {exc}", recoverable=True) from exc
        status = doc.get("status") if isinstance(doc, dict) else None
        if not isinstance(status, dict):
            raise KubeError(f"{self._what} printed an ExecCredential without status", recoverable=True)
        token = status.get("token")
        if not isinstance(token, str) or not token:
            if status.get("clientCertificateData"):
                raise KubeError(
                    f"{self._what} returned a client certificate; only token credentials are supported",
                    recoverable=False,
                )
            raise KubeError(f"{self._what} returned no token", recoverable=True)
        expiry = status.get("expirationTimestamp")
        if expiry in (None, ""):
            return token, None
        try:
            return token, datetime.fromisoformat(str(expiry)).timestamp()
        except ValueError as exc:
            raise KubeError(
                f"{self._what} returned expirationTimestamp {str(expiry)[:40]!r}, not RFC 3339", recoverable=True
            ) from exc


async def _read_bounded(stream: asyncio.StreamReader, limit: int) -> bytes:
    """Read until EOF, keeping at most ``limit + 1`` bytes (the rest is drained and dropped)."""
    data = bytearray()
    while chunk := await stream.read(65536):
        if len(data) <= limit:
            data += chunk[: limit + 1 - len(data)]
    return bytes(data)


def credentials_for(access: ClusterAccess) -> Credentials:
    if access.exec_plugin is not None:
        return ExecPlugin(access.exec_plugin, access=access)
    if access.token_file is not None:
        return TokenFile(access.token_file, source=access.source)
    if access.token:
        return StaticToken(access.token)
    return NoCredentials()
