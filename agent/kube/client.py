"""A minimal read-only Kubernetes API client on aiohttp: GET JSON and stream a watch.

Credentials come from a kubeconfig file or, in a pod, from the service account
(``KUBERNETES_SERVICE_HOST``/``_PORT`` plus the token and CA under
``/var/run/secrets/kubernetes.io/serviceaccount``). Supported kubeconfig auth: bearer
``token``/``tokenFile`` and client certificates (file or ``-data``), with
``certificate-authority(-data)`` or ``insecure-skip-tls-verify``. Exec plugins,
auth-provider plugins and basic auth are refused with a one-line KubeConfigError.

Each request opens its own short-lived session: the agent makes a handful of requests an
hour (a list, then one long watch per few minutes), so there is no connection pool to
own and nothing to close. Bearer tokens are read from their file on every request
because projected service-account tokens rotate.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import ssl
import tempfile
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from agent.kube.errors import KubeConfigError, KubeError, KubeGoneError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

#: ask for metadata only (labels live there), fall back to the full object
METADATA_ACCEPT = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"
METADATA_LIST_ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"

#: a watch line longer than this is refused (a full Node with many images is well under it)
MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ClusterAccess:
    """Where the API server is and how to authenticate; built by the two loaders below."""

    server: str
    #: for messages: "in-cluster" or "kubeconfig <path>"
    source: str
    token: str = ""
    #: re-read on every request (rotating service-account tokens)
    token_file: Path | None = None
    ca_file: Path | None = None
    #: PEM text
    ca_data: str = ""
    insecure: bool = False
    client_cert_file: Path | None = None
    client_key_file: Path | None = None
    #: PEM bytes, written to a private temp dir only while the SSL context loads them
    client_cert_data: bytes = b""
    client_key_data: bytes = b""


def _in_cluster_env(env: Mapping[str, str]) -> tuple[str, str] | None:
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    return (host, port) if host and port else None


def kube_config_available(
    kubeconfig: str, *, env: Mapping[str, str] | None = None, sa_dir: Path = SERVICE_ACCOUNT_DIR
) -> bool:
    """True when an explicit kubeconfig is set, or the pod has in-cluster env and a token."""
    if kubeconfig:
        return True
    env = os.environ if env is None else env
    return _in_cluster_env(env) is not None and (sa_dir / "token").is_file()


def in_cluster_access(
    *, env: Mapping[str, str] | None = None, sa_dir: Path = SERVICE_ACCOUNT_DIR, server: str = ""
) -> ClusterAccess:
    """Service-account access; ``server`` overrides the URL built from the env (tests)."""
    env = os.environ if env is None else env
    found = _in_cluster_env(env)
    if found is None:
        raise KubeConfigError(
            "in-cluster config: KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT are not set; pass --kubeconfig"
        )
    token_file = sa_dir / "token"
    if not token_file.is_file():
        raise KubeConfigError(f"in-cluster config: no service-account token at {token_file}")
    host, port = found
    if not server:
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    ca_file = sa_dir / "ca.crt"
    return ClusterAccess(
        server=server.rstrip("/"),
        source="in-cluster",
        token_file=token_file,
        ca_file=ca_file if ca_file.is_file() else None,
    )


def kubeconfig_access(path: str | Path) -> ClusterAccess:
    """Access from a kubeconfig file's current context."""
    path = Path(path)
    where = f"kubeconfig {path}"
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise KubeConfigError(f"{where}: cannot read: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise KubeConfigError(f"{where}: not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(doc, dict):
        raise KubeConfigError(f"{where}: expected a mapping at the top level")
    current = doc.get("current-context")
    if not current:
        raise KubeConfigError(f"{where}: no current-context")
    context = _named(doc, "contexts", "context", current, where)
    cluster = _named(doc, "clusters", "cluster", context.get("cluster"), where)
    user = _named(doc, "users", "user", context.get("user"), where) if context.get("user") else {}
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise KubeConfigError(f"{where}: cluster {context.get('cluster')!r} has no server")
    user_name = context.get("user")
    for key, what in (("exec", "an exec credential plugin"), ("auth-provider", "an auth-provider plugin")):
        if user.get(key):
            raise KubeConfigError(
                f"{where}: user {user_name!r} uses {what}, which gpu-node-agent does not support; "
                "use a token, tokenFile or client certificate"
            )
    if user.get("username") or user.get("password"):
        raise KubeConfigError(f"{where}: user {user_name!r} uses basic auth, which gpu-node-agent does not support")
    base = path.parent

    def file_of(key: str) -> Path | None:
        value = cluster.get(key) if key == "certificate-authority" else user.get(key)
        return (base / value) if isinstance(value, str) and value else None

    cert_data = _b64(user, "client-certificate-data", where)
    key_data = _b64(user, "client-key-data", where)
    cert_file, key_file = file_of("client-certificate"), file_of("client-key")
    if bool(cert_data or cert_file) != bool(key_data or key_file):
        raise KubeConfigError(f"{where}: user {user_name!r} has a client certificate without a key, or a key alone")
    return ClusterAccess(
        server=server.rstrip("/"),
        source=where,
        token=str(user.get("token") or ""),
        token_file=file_of("tokenFile"),
        ca_file=file_of("certificate-authority"),
        ca_data=_b64(cluster, "certificate-authority-data", where).decode(),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        client_cert_file=cert_file,
        client_key_file=key_file,
        client_cert_data=cert_data,
        client_key_data=key_data,
    )


def _named(doc: dict[str, Any], section: str, field: str, name: Any, where: str) -> dict[str, Any]:
    for entry in doc.get(section) or ():
        if isinstance(entry, dict) and entry.get("name") == name:
            body = entry.get(field) or {}
            if not isinstance(body, dict):
                raise KubeConfigError(f"{where}: {section}[{name!r}].{field} is not a mapping")
            return body
    raise KubeConfigError(f"{where}: no {field} named {name!r} in {section}")


def _b64(entry: Mapping[str, Any], key: str, where: str) -> bytes:
    value = entry.get(key)
    if not value:
        return b""
    try:
        return base64.b64decode(str(value), validate=True)
    except (ValueError, RecursionError) as exc:
        raise KubeConfigError(f"{where}: {key} is not valid base64") from exc


def ssl_context(access: ClusterAccess) -> ssl.SSLContext:
    """The TLS settings for ``access`` (CA, client certificate, or no verification)."""
    try:
        if access.insecure:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context = ssl.create_default_context(
                cafile=str(access.ca_file) if access.ca_file else None, cadata=access.ca_data or None
            )
        if access.client_cert_file and access.client_key_file:
            context.load_cert_chain(access.client_cert_file, access.client_key_file)
        elif access.client_cert_data:
            with tempfile.TemporaryDirectory(prefix="gpu-agent-kube-") as tmp:
                cert, key = Path(tmp) / "client.crt", Path(tmp) / "client.key"
                for file, data in ((cert, access.client_cert_data), (key, access.client_key_data)):
                    file.touch(mode=0o600)
                    file.write_bytes(data)
                context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise KubeConfigError(f"{access.source}: TLS setup failed: {exc}") from exc
    return context


class KubeClient:
    """GET JSON and watch streams against one API server. Read-only; nothing to close."""

    def __init__(self, access: ClusterAccess, *, connect_timeout_s: float = 10.0, request_timeout_s: float = 30.0):
        self.access = access
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._ssl: ssl.SSLContext | bool = ssl_context(access) if access.server.startswith("https:") else True

    @classmethod
    def from_config(
        cls, kubeconfig: str, *, env: Mapping[str, str] | None = None, sa_dir: Path = SERVICE_ACCOUNT_DIR
    ) -> KubeClient:
        """From ``kubeconfig`` when set, else in-cluster. Raises KubeConfigError."""
        if kubeconfig:
            return cls(kubeconfig_access(kubeconfig))
        return cls(in_cluster_access(env=env, sa_dir=sa_dir))

    @property
    def server(self) -> str:
        return self.access.server

    async def get_json(
        self, path: str, params: Mapping[str, str] | None = None, *, accept: str = "application/json"
    ) -> dict[str, Any]:
        """GET ``path`` and decode the JSON object. Raises KubeError naming the URL."""
        url = self.server + path
        timeout = aiohttp.ClientTimeout(total=self._request_timeout_s, sock_connect=self._connect_timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url, params=params, headers=self._headers(accept), ssl=self._ssl) as resp,
            ):
                await _raise_for_status(resp)
                body = await resp.json(content_type=None)
        except KubeError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, RecursionError) as exc:
            raise _connection_error("GET", url, exc) from exc
        if not isinstance(body, dict):
            raise KubeError(f"GET {url}: expected a JSON object, got {type(body).__name__}", recoverable=True)
        return body

    async def watch(
        self,
        path: str,
        params: Mapping[str, str] | None = None,
        *,
        timeout_s: float = 300.0,
        accept: str = "application/json",
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Yield watch events (``{"type", "object"}``) until the server ends the stream.

        The server is asked to end it after ``timeout_s``; the socket read timeout is a bit
        longer so that a silently dead connection is noticed. An ``ERROR`` event becomes a
        KubeError (KubeGoneError for 410). Use with ``contextlib.aclosing`` so that leaving
        the loop early closes the connection.
        """
        query = {**(params or {}), "watch": "true", "timeoutSeconds": str(max(1, int(timeout_s)))}
        url = self.server + path
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s, sock_read=timeout_s + 30)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.get(url, params=query, headers=self._headers(accept), ssl=self._ssl) as resp,
            ):
                await _raise_for_status(resp)
                buffer = b""
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    if len(buffer) > MAX_LINE_BYTES:
                        raise KubeError(f"watch {url}: event longer than {MAX_LINE_BYTES} bytes", recoverable=True)
                    for line in lines:
                        if line.strip():
                            yield _event(url, line)
                if buffer.strip():
                    yield _event(url, buffer)
        except KubeError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _connection_error("watch", url, exc) from exc

    def _headers(self, accept: str) -> dict[str, str]:
        headers = {"Accept": accept, "User-Agent": "gpu-node-agent"}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _token(self) -> str:
        if self.access.token_file is None:
            return self.access.token
        try:
            return self.access.token_file.read_text().strip()
        except OSError as exc:
            raise KubeError(
                f"{self.access.source}: cannot read token {self.access.token_file}: {exc.strerror or exc}",
                recoverable=True,
            ) from exc


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    if resp.status < 400:
        return
    message = ""
    with contextlib.suppress(aiohttp.ClientError, ValueError, TimeoutError):
        text = (await resp.content.read(4096)).decode(errors="replace")
        message = _status_message(text) or text
    line = f"GET {resp.url}: {resp.status} {resp.reason or ''}".rstrip()
    if message:
        line += ": " + " ".join(message.split())[:300]
    if resp.status == 410:
        raise KubeGoneError(line)
    raise KubeError(line, status=resp.status, recoverable=resp.status >= 500 or resp.status == 429)


def _status_message(text: str) -> str:
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return ""
    return str(body.get("message") or "") if isinstance(body, dict) else ""


def _event(url: str, line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise KubeError(f"watch {url}: undecodable event: {exc}", recoverable=True) from exc
    if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
        raise KubeError(f"watch {url}: malformed event {line[:80]!r}", recoverable=True)
    if event.get("type") == "ERROR":
        status = event["object"]
        code = status.get("code")
        line_text = f"watch {url}: {code} {status.get('reason', '')}: {status.get('message', '')}"
        if code == 410:
            raise KubeGoneError(line_text)
        raise KubeError(
            line_text,
            status=code if isinstance(code, int) else None,
            recoverable=not isinstance(code, int) or code >= 500 or code == 429,
        )
    return event


def _connection_error(verb: str, url: str, exc: BaseException) -> KubeError:
    detail = str(exc) or type(exc).__name__
    # a certificate the server will keep presenting is not fixed by retrying
    tls = isinstance(exc, aiohttp.ClientConnectorCertificateError | aiohttp.ClientSSLError)
    return KubeError(f"{verb} {url}: {type(exc).__name__}: {' '.join(detail.split())}", recoverable=not tls)
