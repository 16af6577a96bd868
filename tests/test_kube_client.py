"""The API client against the fake API server: verbs, typed errors, bounds, credentials, discovery, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.core.config.schema import Config
from agent.kube.access import ClusterAccess, ExecConfig, kubeconfig_access
from agent.kube.auth import ExecPlugin
from agent.kube.client import KubeClient, Limits, resource_of
from agent.kube.discovery import ResourceApi
from agent.kube.errors import KubeConflictError, KubeError, KubeGoneError, KubeNotFoundError
from agent.kube.metrics import KubeMetrics
from agent.kube.session import open_kube
from tests.fake_apiserver import NODE, FakeApiServer, serving, write_kubeconfig

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with serving() as fake:
        yield fake


@contextlib.asynccontextmanager
async def _client(api: FakeApiServer, tmp_path: Path, **kwargs: Any) -> AsyncIterator[KubeClient]:
    async with KubeClient(kubeconfig_access(write_kubeconfig(tmp_path, api.url)), **kwargs) as client:
        yield client


def _slice(name: str = "", **spec: Any) -> dict[str, Any]:
    meta = {"name": name} if name else {"generateName": f"{NODE}-x-"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": "gpu.example.com",
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
            **spec,
        },
    }


# --- verbs and typed errors ----------------------------------------------------------------


async def test_create_replace_delete_and_conflict(api: FakeApiServer, tmp_path: Path) -> None:
    async with _client(api, tmp_path) as client:
        created = await client.create(SLICES, _slice())
        name = created["metadata"]["name"]
        assert name.startswith(f"{NODE}-x-") and created["metadata"]["resourceVersion"]
        stale = dict(created)
        created["spec"]["devices"] = [{"name": "gpu-1"}]
        updated = await client.replace(f"{SLICES}/{name}", created)
        assert updated["metadata"]["resourceVersion"] != stale["metadata"]["resourceVersion"]
        with pytest.raises(KubeConflictError) as conflict:
            await client.replace(f"{SLICES}/{name}", stale)  # the resourceVersion it carries is old now
        assert conflict.value.status == 409 and conflict.value.recoverable
        assert "the object has been modified; please apply your changes to the latest version" in str(conflict.value)
        assert str(conflict.value).startswith(f"PUT {api.url}{SLICES}/{name}: 409 Conflict: Operation cannot be")

        await client.delete(f"{SLICES}/{name}", {"preconditions": {"uid": updated["metadata"]["uid"]}})
        with pytest.raises(KubeNotFoundError) as missing:
            await client.get(f"{SLICES}/{name}")
        assert missing.value.object_missing  # the object is gone, the path is served
        with pytest.raises(KubeNotFoundError) as unserved:
            await client.get("/apis/resource.k8s.io/v1alpha9/resourceslices")
        assert not unserved.value.object_missing  # the version is not served at all


async def test_invalid_object_is_one_line_with_the_servers_reason(api: FakeApiServer, tmp_path: Path) -> None:
    async with _client(api, tmp_path) as client:
        with pytest.raises(KubeError) as err:
            await client.create(SLICES, _slice(devices=[{"name": f"gpu-{i}"} for i in range(200)]))
    message = str(err.value)
    assert err.value.status == 422 and not err.value.recoverable and "\n" not in message
    assert "spec.devices: Too many: 200: must have at most 128 items" in message


async def test_server_messages_are_cut_short(api: FakeApiServer, tmp_path: Path) -> None:
    api.fail(500, message="x" * 100_000)
    async with _client(api, tmp_path) as client:
        with pytest.raises(KubeError) as err:
            await client.get(f"/api/v1/nodes/{NODE}")
    assert len(str(err.value)) < 600 and err.value.recoverable


async def test_watch_gone_and_error_events(api: FakeApiServer, tmp_path: Path) -> None:
    async with _client(api, tmp_path) as client:
        api.compact()
        with pytest.raises(KubeGoneError):
            async for _ in client.watch("/api/v1/nodes", {"resourceVersion": "1"}):
                pass


# --- bounds --------------------------------------------------------------------------------


async def test_an_endless_body_is_not_read_into_memory(api: FakeApiServer, tmp_path: Path) -> None:
    api.oversize(1536 * 1024 * 1024)  # 1.5 GB
    async with _client(api, tmp_path, limits=Limits(object_bytes=1024 * 1024)) as client:
        with pytest.raises(KubeError, match="over the limit of 1048576 bytes") as err:
            await client.get(f"/api/v1/nodes/{NODE}")
    assert err.value.status is None and err.value.recoverable
    # the client stopped reading: the server got rid of little more than the limit plus socket buffers
    assert api.bytes_sent_oversize < 64 * 1024 * 1024


async def test_a_declared_length_over_the_limit_is_refused_unread(api: FakeApiServer, tmp_path: Path) -> None:
    async with _client(api, tmp_path, limits=Limits(object_bytes=64)) as client:
        with pytest.raises(KubeError, match=r"response of \d+ bytes is over the limit of 64 bytes"):
            await client.get(f"/api/v1/nodes/{NODE}")


async def test_a_slow_server_and_rate_limits(api: FakeApiServer, tmp_path: Path) -> None:
    api.delay_s = 0.5
    async with _client(api, tmp_path) as client:
        with pytest.raises(KubeError, match=r"no answer within 0.1s"):
            await client.get(f"/api/v1/nodes/{NODE}", timeout_s=0.1)
        api.delay_s = 0
        api.fail(429, message="Too many requests, please try again later.")
        with pytest.raises(KubeError, match="429 Too Many Requests: Too many requests") as err:
            await client.get(f"/api/v1/nodes/{NODE}")
        assert err.value.recoverable and err.value.status == 429


async def test_a_server_that_never_answers_times_out(api: FakeApiServer, tmp_path: Path) -> None:
    api.hang(times=None)
    async with _client(api, tmp_path, limits=Limits(request_timeout_s=0.3)) as client:
        with pytest.raises(KubeError, match=r"no answer within 0.3s") as err:
            await client.get(f"/api/v1/nodes/{NODE}")
        with pytest.raises(KubeError, match=r"no answer within 0.2s"):
            await client.get(f"/api/v1/nodes/{NODE}", timeout_s=0.2)  # a caller with a deadline asks for less
    assert err.value.recoverable and err.value.status is None


async def test_watch_lines_and_idle_time_are_bounded(api: FakeApiServer, tmp_path: Path) -> None:
    limits = Limits(watch_line_bytes=10_000, watch_idle_s=0.3)
    async with _client(api, tmp_path, limits=limits) as client:
        stream = client.watch("/api/v1/nodes", {"resourceVersion": str(api.rv)})
        async with contextlib.aclosing(stream) as events:
            await asyncio.sleep(0)
            task = asyncio.ensure_future(anext(events))
            await api.next_watch()
            api.set_labels({"pool": "a"}, annotations={"big": "x" * 20_000})
            with pytest.raises(KubeError, match="event longer than 10000 bytes"):
                await task
        # a watch on which nothing arrives is dropped after the idle limit, not held forever
        stream = client.watch("/api/v1/nodes", {"resourceVersion": str(api.rv)})
        with pytest.raises(KubeError, match="timed out"):
            async with contextlib.aclosing(stream) as events:
                async for _ in events:
                    pass


# --- credentials ---------------------------------------------------------------------------


def _plugin(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "plugin.py"
    script.write_text(
        "import json, os, sys, pathlib\n"
        f"counter = pathlib.Path({str(tmp_path / 'runs')!r})\n"
        "n = int(counter.read_text()) + 1 if counter.exists() else 1\n"
        "counter.write_text(str(n))\n"
        f"pathlib.Path({str(tmp_path / 'info')!r}).write_text(os.environ.get('KUBERNETES_EXEC_INFO', ''))\n" + body
    )
    return script


def _exec_user(script: Path, **extra: Any) -> dict[str, Any]:
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(script)],
            "interactiveMode": "Never",
            **extra,
        }
    }


async def test_exec_plugin_token_is_cached_until_it_expires_and_renewed_after_401(
    api: FakeApiServer, tmp_path: Path
) -> None:
    script = _plugin(
        tmp_path,
        "exp = '2999-01-01T00:00:00Z' if n < 3 else '2000-01-01T00:00:00Z'\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1', 'kind': 'ExecCredential',"
        " 'status': {'token': f'tok-{n}', 'expirationTimestamp': exp}}))\n",
    )
    config = write_kubeconfig(tmp_path, api.url, _exec_user(script, provideClusterInfo=True))
    async with KubeClient.from_config(str(config)) as client:
        await client.get(f"/api/v1/nodes/{NODE}")
        await client.get(f"/api/v1/nodes/{NODE}")
        assert api.tokens == ["Bearer tok-1", "Bearer tok-1"]  # one run serves until expiry
        api.fail(401, times=1)
        await client.get(f"/api/v1/nodes/{NODE}")  # rejected once, run again, sent again
        assert api.tokens[2:] == ["Bearer tok-1", "Bearer tok-2"]
        api.fail(401, times=1)
        await client.get(f"/api/v1/nodes/{NODE}")  # tok-3 expired already: every request runs it
        await client.get(f"/api/v1/nodes/{NODE}")
        assert api.tokens[4:] == ["Bearer tok-2", "Bearer tok-3", "Bearer tok-4"]
    info = json.loads((tmp_path / "info").read_text())
    assert info["kind"] == "ExecCredential" and info["spec"]["interactive"] is False
    assert info["spec"]["cluster"]["server"] == api.url


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("sys.stderr.write('token expired, run aws sso login'); sys.exit(3)", "exited with 3: token expired"),
        ("print('not json')", "printed no JSON ExecCredential"),
        ("print(json.dumps({'status': {'clientCertificateData': 'x'}}))", "only token credentials"),
        ("import time; time.sleep(30)", "did not finish within 0.5s"),
        ("sys.stdout.write('x' * 3_000_000)", "printed more than"),
    ],
)
async def test_exec_plugin_failures_are_one_line(tmp_path: Path, body: str, message: str) -> None:
    script = _plugin(tmp_path, body + "\n")
    access = ClusterAccess(server="http://127.0.0.1:1", source="kubeconfig k")
    plugin = ExecPlugin(ExecConfig(command=sys.executable, args=(str(script),)), access=access, timeout_s=0.5)
    with pytest.raises(KubeError, match=message) as err:
        await plugin.header()
    assert str(err.value).startswith("kubeconfig k: exec plugin") and "\n" not in str(err.value)


async def test_exec_plugin_that_cannot_start(tmp_path: Path) -> None:
    access = ClusterAccess(server="http://127.0.0.1:1", source="kubeconfig k")
    plugin = ExecPlugin(ExecConfig(command=str(tmp_path / "missing")), access=access)
    with pytest.raises(KubeError, match="cannot be started"):
        await plugin.header()


async def test_token_file_rotation_is_noticed_without_rereading_every_request(
    api: FakeApiServer, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("one")
    async with KubeClient.from_config(str(write_kubeconfig(tmp_path, api.url, {"tokenFile": str(token)}))) as client:
        await client.get(f"/api/v1/nodes/{NODE}")
        replacement = tmp_path / "token.new"
        replacement.write_text("two")
        replacement.replace(token)  # as kubelet's projected volumes rotate: a new file swapped in
        await client.get(f"/api/v1/nodes/{NODE}")
    assert api.tokens == ["Bearer one", "Bearer two"]


# --- discovery -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("served", "chosen"),
    [(("v1", "v1beta2", "v1beta1"), "v1"), (("v1beta1", "v1beta2"), "v1beta2"), (("v1beta1", "v1alpha3"), "v1beta1")],
)
async def test_discovery_prefers_v1_then_v1beta2_then_v1beta1(
    tmp_path: Path, served: tuple[str, ...], chosen: str
) -> None:
    async with serving(versions=served) as api, _client(api, tmp_path) as client:
        resources = ResourceApi(client)
        assert await resources.version() == chosen
        assert await resources.version() == chosen
        assert resources.discoveries == 1


async def test_discovery_errors_and_rediscovery(tmp_path: Path) -> None:
    async with serving(versions=()) as api, _client(api, tmp_path) as client:
        resources = ResourceApi(client)
        with pytest.raises(KubeError, match=r"does not serve resource.k8s.io: DRA needs Kubernetes 1.32"):
            await resources.version()
        api.versions = ("v1alpha3",)
        with pytest.raises(KubeError, match=r"serves resource.k8s.io versions \['v1alpha3'\] but none of v1"):
            await resources.version()
        api.versions = ("v1",)
        assert await resources.version() == "v1"
        api.versions = ("v1beta1",)  # the API server was downgraded
        resources.forget("v1beta2")  # a version not in use: nothing happens
        assert resources.current == "v1"
        resources.forget("v1")
        assert await resources.version() == "v1beta1"


# --- pool, session, metrics ----------------------------------------------------------------


async def test_one_connection_pool_serves_concurrent_requests(api: FakeApiServer, tmp_path: Path) -> None:
    async with _client(api, tmp_path) as client:
        await asyncio.gather(*(client.get(f"/api/v1/nodes/{NODE}") for _ in range(20)))
        pool = client._session
        await client.get(f"/api/v1/nodes/{NODE}")
        assert client._session is pool
    with pytest.raises(KubeError, match="closed"):
        await client.get(f"/api/v1/nodes/{NODE}")


async def test_open_kube_without_access_is_none_and_with_it_a_closed_client_after(
    api: FakeApiServer, tmp_path: Path
) -> None:
    async with open_kube(Config(), env={}, sa_dir=tmp_path / "none") as none:
        assert none is None
    registry = CollectorRegistry()
    config = Config(kubeconfig=str(write_kubeconfig(tmp_path, api.url)))
    async with open_kube(config, registry=registry) as client:
        assert client is not None
        await client.get(f"/api/v1/nodes/{NODE}")
    with pytest.raises(KubeError, match="closed"):
        await client.get(f"/api/v1/nodes/{NODE}")
    assert (
        registry.get_sample_value(
            "gpu_agent_kube_request_duration_seconds_count", {"verb": "get", "resource": "nodes", "result": "ok"}
        )
        == 1
    )


async def test_metrics_count_latency_and_errors_by_verb_resource_and_code(api: FakeApiServer, tmp_path: Path) -> None:
    registry = CollectorRegistry()
    async with _client(api, tmp_path, metrics=KubeMetrics(registry)) as client:
        await client.list(SLICES)
        with contextlib.suppress(KubeError):
            await client.get(f"{SLICES}/nope")
        api.hang()
        with contextlib.suppress(KubeError):
            await client.get(f"/api/v1/nodes/{NODE}", timeout_s=0.2)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("gpu_agent_kube_request_duration_seconds_count", verb="list", resource="resourceslices", result="ok")
    assert value("gpu_agent_kube_request_errors_total", verb="get", resource="resourceslices", code="404") == 1
    assert value("gpu_agent_kube_request_errors_total", verb="get", resource="nodes", code="timeout") == 1


@pytest.mark.parametrize(
    ("path", "resource"),
    [
        ("/api/v1/nodes/n", "nodes"),
        ("/api/v1/namespaces/default/events", "events"),
        ("/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c", "resourceclaims"),
        ("/apis/resource.k8s.io/v1beta1/resourceslices", "resourceslices"),
        ("/apis/resource.k8s.io", "discovery"),
    ],
)
def test_resource_of(path: str, resource: str) -> None:
    assert resource_of(path) == resource
