"""Where the API server is and how to authenticate: kubeconfig and in-cluster loaders.

Credentials come from a kubeconfig file or, in a pod, from the service account
(``KUBERNETES_SERVICE_HOST``/``_PORT`` plus the token and CA under
``/var/run/secrets/kubernetes.io/serviceaccount``). Supported kubeconfig auth: bearer
``token``/``tokenFile``, client certificates (file or ``-data``) and exec credential plugins
(``client.authentication.k8s.io/v1`` and ``v1beta1``, tokens only; see ``agent/kube/auth.py``),
with ``certificate-authority(-data)`` or ``insecure-skip-tls-verify``. Auth-provider plugins and
basic auth are refused with a one-line KubeConfigError.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent.kube.errors import KubeConfigError

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

#: the ExecCredential versions a kubeconfig's exec plugin may speak (v1alpha1 left in 1.24)
EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")


@dataclass(frozen=True, slots=True)
class ExecConfig:
    """A kubeconfig user's ``exec`` credential plugin."""

    command: str
    args: tuple[str, ...] = ()
    #: extra environment variables for the plugin (on top of the agent's own)
    env: tuple[tuple[str, str], ...] = ()
    api_version: str = EXEC_API_VERSIONS[0]
    #: pass the cluster (server, CA) to the plugin in KUBERNETES_EXEC_INFO
    provide_cluster_info: bool = False


@dataclass(frozen=True, slots=True)
class ClusterAccess:
    """Where the API server is and how to authenticate; built by the two loaders below."""

    server: str
    #: for messages: "in-cluster" or "kubeconfig <path>"
    source: str
    token: str = ""
    #: re-read when it changes (rotating service-account tokens)
    token_file: Path | None = None
    #: an exec credential plugin that prints the token
    exec_plugin: ExecConfig | None = None
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
    if user.get("auth-provider"):
        raise KubeConfigError(
            f"{where}: user {user_name!r} uses an auth-provider plugin, which gpu-node-agent does not support; "
            "use an exec plugin, a token, tokenFile or client certificate"
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
        exec_plugin=_exec_config(user.get("exec"), base, f"{where}: user {user_name!r}"),
        ca_file=file_of("certificate-authority"),
        ca_data=_b64(cluster, "certificate-authority-data", where).decode(),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        client_cert_file=cert_file,
        client_key_file=key_file,
        client_cert_data=cert_data,
        client_key_data=key_data,
    )


def _exec_config(raw: Any, base: Path, where: str) -> ExecConfig | None:
    """The user's ``exec`` section, checked; None when there is none."""
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise KubeConfigError(f"{where}: exec is not a mapping")
    command = raw.get("command")
    if not isinstance(command, str) or not command:
        raise KubeConfigError(f"{where}: exec has no command")
    api_version = raw.get("apiVersion")
    if api_version not in EXEC_API_VERSIONS:
        raise KubeConfigError(
            f"{where}: exec apiVersion {str(api_version)[:80]!r} is not supported; "
            f"use one of {', '.join(EXEC_API_VERSIONS)}"
        )
    if raw.get("interactiveMode") == "Always":
        raise KubeConfigError(f"{where}: exec plugin needs interactiveMode Always, and the agent has no terminal")
    args = raw.get("args") or []
    env = raw.get("env") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise KubeConfigError(f"{where}: exec args must be a list of strings")
    if not isinstance(env, list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("value"), str) for e in env
    ):
        raise KubeConfigError(f"{where}: exec env must be a list of {{name, value}} strings")
    # like kubectl: a relative path with a slash is relative to the kubeconfig, a bare name is looked up in PATH
    if "/" in command and not Path(command).is_absolute():
        command = str(base / command)
    return ExecConfig(
        command=command,
        args=tuple(args),
        env=tuple((e["name"], e["value"]) for e in env),
        api_version=api_version,
        provide_cluster_info=bool(raw.get("provideClusterInfo")),
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
