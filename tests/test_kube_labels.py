"""agent.kube: config loading and the node-label source, against the fake API server on 127.0.0.1
(real HTTP; TLS only in the optional test that needs openssl)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from agent.base.backoff import Backoff
from agent.base.errors import ConfigError
from agent.kube.access import in_cluster_access, kube_config_available, kubeconfig_access
from agent.kube.client import KubeClient
from agent.kube.errors import KubeConfigError, KubeError
from agent.kube.labels import NodeLabelSource, StaticLabelSource, label_source
from agent.kube.listwatch import WATCH_BACKOFF, WatchTiming
from tests.fake_apiserver import NODE, TIMEOUT, FakeApiServer, serving, write_kubeconfig
from tests.fake_sleep import FakeSleep
from tests.selfsigned import self_signed


@pytest.fixture
async def api() -> AsyncIterator[FakeApiServer]:
    async with serving() as fake:
        yield fake


def _lists(api: FakeApiServer) -> int:
    """Lists of nodes (not watches, not single GETs)."""
    return sum(1 for r in api.requests if r.path == "/api/v1/nodes" and r.query.get("watch") != "true")


def _fail_node_get(api: FakeApiServer, status: int) -> None:
    message = f'nodes "{NODE}" is forbidden or missing'
    api.fail(status, times=None, method="GET", path=f"/api/v1/nodes/{NODE}", message=message)


def _kubeconfig(tmp_path: Path, server: str, user: dict[str, Any], **cluster: Any) -> Path:
    return write_kubeconfig(tmp_path, server, user, **cluster)


@pytest.fixture
async def kube(api: FakeApiServer, tmp_path: Path) -> AsyncIterator[KubeClient]:
    async with KubeClient(kubeconfig_access(_kubeconfig(tmp_path, api.url, {"token": "t0"}))) as client:
        yield client


def _source(
    kube: KubeClient, *, sleep: FakeSleep | None = None, backoff: Backoff = WATCH_BACKOFF, **kwargs: Any
) -> NodeLabelSource:
    timing = WatchTiming(backoff=backoff, sleep=sleep or FakeSleep(), clock=lambda: 0.0)
    return NodeLabelSource(kube, node_name=NODE, timing=timing, **kwargs)


class Watching:
    """Runs ``source.watch`` as a task; label changes arrive on ``changes``."""

    def __init__(self, source: NodeLabelSource | StaticLabelSource) -> None:
        self.changes: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        self.task = asyncio.create_task(source.watch(self.changes.put_nowait))

    async def next(self) -> dict[str, str]:
        return await asyncio.wait_for(self.changes.get(), TIMEOUT)

    async def stop(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


# --- config loading ---------------------------------------------------------------------


def _service_account(tmp_path: Path, token: str = "sa-token") -> Path:
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(token + "\n")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    return sa


def test_in_cluster_access_from_service_account_dir(tmp_path: Path) -> None:
    sa = _service_account(tmp_path)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    access = in_cluster_access(env=env, sa_dir=sa)
    assert access.server == "https://10.96.0.1:443"
    assert access.token_file == sa / "token" and access.ca_file == sa / "ca.crt"
    v6 = in_cluster_access(env={**env, "KUBERNETES_SERVICE_HOST": "fd00::1"}, sa_dir=sa)
    assert v6.server == "https://[fd00::1]:443"

    assert kube_config_available("", env=env, sa_dir=sa)
    assert not kube_config_available("", env={}, sa_dir=sa)
    assert not kube_config_available("", env=env, sa_dir=tmp_path / "missing")
    assert kube_config_available("/some/kubeconfig", env={}, sa_dir=tmp_path / "missing")
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster_access(env={}, sa_dir=sa)
    with pytest.raises(KubeConfigError, match="no service-account token"):
        in_cluster_access(env=env, sa_dir=tmp_path / "missing")


async def test_in_cluster_token_is_reread_when_it_rotates(api: FakeApiServer, tmp_path: Path) -> None:
    sa = _service_account(tmp_path, "first")
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1"}
    async with KubeClient(in_cluster_access(env=env, sa_dir=sa, server=api.url)) as client:
        await client.get(f"/api/v1/nodes/{NODE}")
        await client.get(f"/api/v1/nodes/{NODE}")  # unchanged file: not re-read
        (sa / "token").write_text("second")
        await client.get(f"/api/v1/nodes/{NODE}")
    assert api.tokens == ["Bearer first", "Bearer first", "Bearer second"]


async def test_kubeconfig_with_token_file_and_token(api: FakeApiServer, tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    path = _kubeconfig(tmp_path, api.url + "/", {"tokenFile": "tok"})
    access = kubeconfig_access(path)
    assert access.server == api.url and access.token_file == tmp_path / "tok"
    async with KubeClient(access) as client:
        node = await client.get(f"/api/v1/nodes/{NODE}")
    assert node["metadata"]["labels"] == {"pool": "a100"}

    async with KubeClient.from_config(str(_kubeconfig(tmp_path, api.url, {"token": "abc"}))) as client:
        await client.get(f"/api/v1/nodes/{NODE}")
    assert api.tokens == ["Bearer from-file", "Bearer abc"]


def test_kubeconfig_insecure_skips_verification(tmp_path: Path) -> None:
    access = kubeconfig_access(
        _kubeconfig(tmp_path, "https://10.0.0.1:6443", {"token": "t"}, **{"insecure-skip-tls-verify": True})
    )
    assert access.insecure
    context = KubeClient(access)._ssl
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_NONE and not context.check_hostname


@pytest.mark.parametrize(
    ("user", "cluster", "message"),
    [
        ({"exec": {"command": "aws", "apiVersion": "client.authentication.k8s.io/v1alpha1"}}, {}, "not supported"),
        ({"exec": {"apiVersion": "client.authentication.k8s.io/v1"}}, {}, "exec has no command"),
        (
            {"exec": {"command": "x", "apiVersion": "client.authentication.k8s.io/v1", "interactiveMode": "Always"}},
            {},
            "no terminal",
        ),
        ({"exec": {"command": "x", "apiVersion": "client.authentication.k8s.io/v1", "env": [{"n": 1}]}}, {}, "env"),
        ({"auth-provider": {"name": "gcp"}}, {}, "auth-provider plugin"),
        ({"username": "admin", "password": "x"}, {}, "basic auth"),
        ({"client-certificate": "c.crt"}, {}, "without a key"),
        ({"token": "t"}, {"certificate-authority-data": "%%%"}, "not valid base64"),
    ],
)
def test_kubeconfig_unsupported_auth_is_one_clear_line(
    tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any], message: str
) -> None:
    path = _kubeconfig(tmp_path, "https://10.0.0.1:6443", user, **cluster)
    with pytest.raises(KubeConfigError, match=message) as err:
        kubeconfig_access(path)
    assert isinstance(err.value, ConfigError)
    assert str(err.value).startswith(f"kubeconfig {path}: ") and "\n" not in str(err.value)


def test_kubeconfig_structure_errors(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="cannot read"):
        kubeconfig_access(tmp_path / "missing")
    path = tmp_path / "kc"
    path.write_text("current-context: nope\ncontexts: []\n")
    with pytest.raises(KubeConfigError, match="no context named 'nope'"):
        kubeconfig_access(path)
    bad_ca = _kubeconfig(tmp_path, "https://10.0.0.1:6443", {"token": "t"}, **{"certificate-authority": "ca.pem"})
    with pytest.raises(KubeConfigError, match="TLS setup failed"):
        KubeClient.from_config(str(bad_ca))


@pytest.fixture
def server_cert(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    return self_signed(tmp_path)


async def test_tls_with_certificate_authority_data(tmp_path: Path, server_cert: tuple[Path, Path]) -> None:
    cert, key = server_cert
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ssl.load_cert_chain(cert, key)
    fake = await FakeApiServer().start(server_ssl)
    try:
        ca = base64.b64encode(cert.read_bytes()).decode()
        verified_config = _kubeconfig(tmp_path, fake.url, {"token": "t"}, **{"certificate-authority-data": ca})
        async with KubeClient.from_config(str(verified_config)) as verified:
            assert (await verified.get(f"/api/v1/nodes/{NODE}"))["metadata"]["name"] == NODE
        async with KubeClient.from_config(str(_kubeconfig(tmp_path, fake.url, {"token": "t"}))) as untrusted:
            with pytest.raises(KubeError, match="certificate") as err:
                await untrusted.get(f"/api/v1/nodes/{NODE}")
        assert not err.value.recoverable
    finally:
        await fake.stop()


# --- requests and errors ----------------------------------------------------------------


@pytest.mark.parametrize(("status", "recoverable"), [(403, False), (404, False), (500, True), (503, True)])
async def test_http_errors_name_url_and_status(
    api: FakeApiServer, tmp_path: Path, status: int, recoverable: bool
) -> None:
    _fail_node_get(api, status)
    async with KubeClient.from_config(str(_kubeconfig(tmp_path, api.url, {"token": "t"}))) as client:
        with pytest.raises(KubeError) as err:
            await client.get(f"/api/v1/nodes/{NODE}")
    message = str(err.value)
    assert message.startswith(f"GET {api.url}/api/v1/nodes/{NODE}: {status} ")
    assert "forbidden or missing" in message and "\n" not in message
    assert err.value.status == status and err.value.recoverable is recoverable


async def test_connection_refused_is_recoverable(tmp_path: Path) -> None:
    fake = await FakeApiServer().start()
    await fake.stop()  # the port is now closed
    async with KubeClient.from_config(str(_kubeconfig(tmp_path, fake.url, {"token": "t"}))) as client:
        with pytest.raises(KubeError, match=f"GET {fake.url}/api/v1/nodes/{NODE}: ") as err:
            await client.get(f"/api/v1/nodes/{NODE}")
    assert err.value.recoverable and err.value.status is None


# --- NodeLabelSource --------------------------------------------------------------------


async def test_fetch_merges_api_labels_under_static_ones(kube: KubeClient, api: FakeApiServer) -> None:
    api.set_labels({"pool": "a100", "zone": "z1"})
    source = _source(kube, static_labels={"pool": "pinned", "extra": "1"})
    assert await source.fetch() == {"pool": "pinned", "zone": "z1", "extra": "1"}
    assert source.last_error == ""


@pytest.mark.parametrize("status", [403, 404])
async def test_fetch_error_keeps_last_labels_and_logs_one_line(
    kube: KubeClient, api: FakeApiServer, tmp_path: Path, status: int
) -> None:
    source = _source(kube, static_labels={"extra": "1"})
    assert await source.fetch() == {"pool": "a100", "extra": "1"}
    _fail_node_get(api, status)
    with capture_logs() as logs:
        assert await source.fetch() == {"pool": "a100", "extra": "1"}
        assert await source.fetch() == {"pool": "a100", "extra": "1"}
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1
    assert f"/api/v1/nodes/{NODE}: {status} " in warnings[0]["error"]
    assert ("get/list/watch on nodes" in warnings[0]["event"]) is (status == 403)
    assert source.last_error == warnings[0]["error"]
    api.clear()
    api.set_labels({"pool": "h100"})
    with capture_logs() as logs:
        assert await source.fetch() == {"pool": "h100", "extra": "1"}
    assert [e["event"] for e in logs] == ["node labels available again"]


async def test_watch_delivers_changes_and_skips_non_changes(
    kube: KubeClient, api: FakeApiServer, tmp_path: Path
) -> None:
    source = _source(kube, static_labels={"extra": "1"})
    assert await source.fetch() == {"pool": "a100", "extra": "1"}
    watching = Watching(source)
    try:
        query = await api.next_watch()
        assert query["resourceVersion"] == str(api.rv) and query["allowWatchBookmarks"] == "true"
        api.set_labels({"pool": "a100"})  # same labels, e.g. a status heartbeat: no callback
        api.push({"type": "BOOKMARK", "object": {"kind": "Node", "metadata": {"resourceVersion": "555"}}})
        # a big object (a Node lists every image) still arrives as one event
        api.set_labels({"pool": "a100-dra"}, annotations={"big": "x" * 300_000})
        assert await watching.next() == {"pool": "a100-dra", "extra": "1"}
        api.set_labels({"pool": "a100-dra", "extra": "overridden"})  # static label wins: no change
        api.set_labels({})
        assert await watching.next() == {"extra": "1"}
        assert watching.changes.empty()
        assert source.labels == {"extra": "1"}
    finally:
        await watching.stop()


async def test_watch_without_fetch_reports_the_first_listing(
    kube: KubeClient, api: FakeApiServer, tmp_path: Path
) -> None:
    source = _source(kube)
    watching = Watching(source)
    try:
        assert await watching.next() == {"pool": "a100"}
        await api.next_watch()
        assert _lists(api) == 1
    finally:
        await watching.stop()


async def test_watch_reconnects_after_the_stream_drops(kube: KubeClient, api: FakeApiServer) -> None:
    sleep = FakeSleep()
    source = _source(kube, sleep=sleep)
    await source.fetch()
    watching = Watching(source)
    try:
        await api.next_watch()
        api.set_labels({"pool": "b"})
        assert await watching.next() == {"pool": "b"}
        seen = str(api.rv)
        api.close_watches()
        await sleep.release()  # one backoff before reconnecting
        query = await api.next_watch()
        assert query["resourceVersion"] == seen  # resumes where it stopped, no relist
        assert _lists(api) == 1
        api.set_labels({"pool": "c"})
        assert await watching.next() == {"pool": "c"}
        # a stream the server ends cleanly after events is reopened at once, without a sleep
        api.end_watches()
        await api.next_watch()
        assert len(sleep.delays) == 1
        # ... and one that ends at once with nothing in it backs off
        api.end_watches()
        await sleep.release()
        await api.next_watch()
        assert len(sleep.delays) == 2 and source.watches == 4  # streams opened
    finally:
        await watching.stop()


async def test_gone_relists_and_resumes_from_the_new_version(
    kube: KubeClient, api: FakeApiServer, tmp_path: Path
) -> None:
    sleep = FakeSleep()
    source = _source(kube, sleep=sleep)
    await source.fetch()
    watching = Watching(source)
    try:
        await api.next_watch()
        assert _lists(api) == 1
        api.nodes[NODE]["metadata"]["labels"] = {"pool": "moved-while-away"}  # changed while the watch was away
        seen = str(api.rv)
        api.expire_watches()
        # the list waits a backoff drawn with wide jitter: after an API server restart every node
        # hears 410 at once, and they must not all list in the same second
        await sleep.release()
        assert len(sleep.delays) == 1 and 0.5 <= sleep.delays[0] <= 1.5
        assert await watching.next() == {"pool": "moved-while-away"}  # from the relist
        query = await api.next_watch()
        assert _lists(api) == 2 and query["resourceVersion"] == str(api.rv)
        # the list asked for what the watch had seen ("not older than": the watch cache answers)
        relist = [r for r in api.requests if r.path == "/api/v1/nodes" and r.query.get("watch") != "true"][-1]
        assert relist.query["resourceVersion"] == seen
    finally:
        await watching.stop()


async def test_forbidden_list_logs_once_keeps_labels_and_recovers(
    kube: KubeClient, api: FakeApiServer, tmp_path: Path
) -> None:
    sleep = FakeSleep()
    # without jitter: with it, delays drawn from 0.5 to 1.5 times 1, 2 and 4 s are out of order 1 time in 16
    no_jitter = dataclasses.replace(WATCH_BACKOFF, jitter=0.0)
    source = _source(kube, sleep=sleep, backoff=no_jitter, static_labels={"extra": "1"})
    await source.fetch()
    api.fail(
        403,
        times=None,
        path="/api/v1/nodes",
        watch=False,
        message='nodes is forbidden: User "system:serviceaccount:x" cannot list',
    )
    with capture_logs() as logs:
        watching = Watching(source)
        try:
            await sleep.release()
            await sleep.release()
            third = await sleep.next()
            assert sleep.delays[0] < sleep.delays[1] < sleep.delays[2]  # exponential backoff
            assert source.labels == {"pool": "a100", "extra": "1"}
            api.clear()
            api.nodes[NODE]["metadata"]["labels"] = {"pool": "dra"}
            third.set_result(None)
            assert await watching.next() == {"pool": "dra", "extra": "1"}
            await api.next_watch()
            api.set_labels({"pool": "dra2"})
            assert await watching.next() == {"pool": "dra2", "extra": "1"}
        finally:
            await watching.stop()
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1
    assert warnings[0]["error"].startswith(f"GET {api.url}/api/v1/nodes?fieldSelector=")
    assert ": 403 Forbidden: nodes is forbidden" in warnings[0]["error"]
    assert "get/list/watch on nodes" in warnings[0]["event"]
    assert [e["event"] for e in logs if e["log_level"] == "info"].count("node labels available again") == 1
    assert source.last_error == ""


async def test_watch_error_event_backs_off_and_retries(kube: KubeClient, api: FakeApiServer) -> None:
    sleep = FakeSleep()
    source = _source(kube, sleep=sleep)
    await source.fetch()
    watching = Watching(source)
    try:
        await api.next_watch()
        api.push({"type": "ERROR", "object": {"kind": "Status", "code": 500, "reason": "InternalError"}})
        await sleep.release()
        assert "500 InternalError" in source.last_error
        await api.next_watch()
        assert _lists(api) == 1
        api.set_labels({"pool": "z"})
        assert await watching.next() == {"pool": "z"}
        assert source.last_error == ""
    finally:
        await watching.stop()


async def test_missing_node_in_list_is_an_error_not_a_crash(kube: KubeClient) -> None:
    sleep = FakeSleep()
    source = NodeLabelSource(kube, node_name="other-node", timing=WatchTiming(sleep=sleep), static_labels={"a": "b"})
    with capture_logs() as logs:
        watching = Watching(source)
        try:
            await sleep.release()
            await sleep.release()
        finally:
            await watching.stop()
    assert "node 'other-node' not found" in source.last_error
    assert len([e for e in logs if e["log_level"] == "warning"]) == 1
    assert watching.changes.empty() and source.labels == {"a": "b"}


# --- choosing a source ------------------------------------------------------------------


async def test_label_source_static_without_api_access(tmp_path: Path) -> None:
    source = label_source(kubeconfig="", node_name=NODE, static_labels={"pool": "x"}, env={}, sa_dir=tmp_path / "none")
    assert isinstance(source, StaticLabelSource)
    assert await source.fetch() == {"pool": "x"}
    watching = Watching(source)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not watching.task.done()
    await watching.stop()


async def test_label_source_from_kubeconfig_and_in_cluster(api: FakeApiServer, tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path, api.url, {"token": "t"})
    source = label_source(kubeconfig=str(path), node_name=NODE, static_labels={"pool": "pinned"}, env={})
    assert isinstance(source, NodeLabelSource)
    assert await source.fetch() == {"pool": "pinned"}
    await source.close()  # the source made its own client

    sa = _service_account(tmp_path)
    (sa / "ca.crt").unlink()  # the placeholder is no certificate; system roots serve here
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    in_cluster = label_source(kubeconfig="", node_name=NODE, static_labels={}, env=env, sa_dir=sa)
    assert isinstance(in_cluster, NodeLabelSource)

    bad = _kubeconfig(tmp_path, api.url, {"auth-provider": {"name": "gcp"}})
    with pytest.raises(KubeConfigError, match="auth-provider plugin"):
        label_source(kubeconfig=str(bad), node_name=NODE, static_labels={})


async def test_absurdly_nested_json_from_the_api_is_a_kube_error(tmp_path: Path) -> None:
    """Whatever the server sends, only KubeError comes out (never RecursionError)."""
    deep = b"[" * 100_000 + b"]" * 100_000

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=deep, content_type="application/json")

    app = web.Application()
    app.router.add_get("/api/v1/nodes/{name}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        access = kubeconfig_access(_kubeconfig(tmp_path, f"http://127.0.0.1:{port}", {"token": "t"}))
        async with KubeClient(access) as client:
            with pytest.raises(KubeError):
                await client.get(f"/api/v1/nodes/{NODE}")
    finally:
        await runner.cleanup()


async def test_a_null_label_value_is_dropped_not_turned_into_none(kube: KubeClient, api: FakeApiServer) -> None:
    """Issue 10 §3: a broken server's null (or number) is no label value; the string "None" never appears."""
    api.set_labels({"pool": None, "zone": "z1", "count": 3})  # type: ignore[dict-item]
    source = _source(kube)
    with capture_logs() as logs:
        assert await source.fetch() == {"zone": "z1"}
    dropped = [e for e in logs if e["event"].startswith("node label dropped")]
    assert [e["key"] for e in dropped] == ["pool", "count"] and all(e["log_level"] == "debug" for e in dropped)


async def test_label_source_on_the_shared_client(kube: KubeClient) -> None:
    source = label_source(client=kube, node_name=NODE, static_labels={"extra": "1"})
    assert isinstance(source, NodeLabelSource)
    assert await source.fetch() == {"pool": "a100", "extra": "1"}
    await source.close()  # not its client: still open
    assert (await kube.get(f"/api/v1/nodes/{NODE}"))["metadata"]["name"] == NODE
    assert isinstance(label_source(client=None, node_name=NODE, static_labels={}), StaticLabelSource)
