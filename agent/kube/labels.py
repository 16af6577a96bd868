"""This node's labels, learned from the API server and followed as they change.

Ownership rules may match nodes by label (``ownership.nodes[].match.labels``) and one
ConfigMap serves every node, so each agent reads its own Node object. A platform team that
relabels a node pool (say, to move it to DRA) sees the agents follow within seconds.

``label_source`` picks the implementation: :class:`NodeLabelSource` on the process's shared
API client when there is one, else :class:`StaticLabelSource` (labels from the config only).
Labels set in the config (``node_labels``) win over the API's. A label whose value is not a
string (a null from a broken server) is dropped with a debug line, never turned into "None".

The DaemonSet's service account needs read access to Node objects (a ClusterRole;
``config/daemonset.yaml`` carries it)::

    rules:
      - apiGroups: [""]
        resources: [nodes]
        verbs: [get, list, watch]

``get`` serves :meth:`NodeLabelSource.fetch`; ``list`` and ``watch`` serve
:meth:`NodeLabelSource.watch`, which lists the one node (``fieldSelector=metadata.name=``)
and watches it from the list's resourceVersion, relisting when the server answers
410 Gone. API errors never escape: the last known labels stay in force, one log line per
failure streak says why, and retries back off exponentially up to a cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import structlog

from agent.base.backoff import Backoff
from agent.kube.access import SERVICE_ACCOUNT_DIR, kube_config_available
from agent.kube.client import METADATA_ACCEPT, METADATA_LIST_ACCEPT, KubeClient
from agent.kube.errors import KubeError, KubeGoneError

log = structlog.get_logger("agent.kube")

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]
OnChange = Callable[[dict[str, str]], None]


class StaticLabelSource:
    """The null source: labels from the config; there is nothing to watch."""

    def __init__(self, static_labels: Mapping[str, str]) -> None:
        self._labels = dict(static_labels)
        #: labels are known (here: at once, there is nothing to learn)
        self.synced = asyncio.Event()
        self.synced.set()
        self.last_error = ""

    async def fetch(self) -> dict[str, str]:
        return dict(self._labels)

    async def watch(self, on_change: OnChange) -> None:
        """Wait until cancelled (a root task must not return); never calls ``on_change``."""
        await asyncio.Event().wait()


class NodeLabelSource:
    """Labels of one Node from the API server, merged under ``static_labels``.

    ``fetch`` and ``on_change`` report the same thing: the merged labels. ``on_change`` is
    called from ``watch`` only when they differ from what ``fetch`` or the previous
    ``on_change`` reported.
    """

    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        static_labels: Mapping[str, str] | None = None,
        backoff: Backoff | None = None,
        sleep: Sleep = asyncio.sleep,
        clock: Clock = time.monotonic,
        watch_timeout_s: float = 300.0,
        min_watch_s: float = 1.0,
        owns_client: bool = False,
    ) -> None:
        self._client = client
        #: a client this source made itself (see ``label_source``) is closed when ``watch`` ends
        self._owns_client = owns_client
        self.node_name = node_name
        self._static = dict(static_labels or {})
        self._backoff = backoff or Backoff()
        self._sleep = sleep
        self._clock = clock
        self._watch_timeout_s = watch_timeout_s
        #: a stream that ends cleanly sooner than this, with no events, counts as a failure
        self._min_watch_s = min_watch_s
        self._api_labels: dict[str, str] = {}
        #: set once the Node's labels have been read from the API server
        self.synced = asyncio.Event()
        #: where the watch resumes; "" means list first
        self._resource_version = ""
        #: the current failure streak's error ("" when the last request worked)
        self.last_error = ""
        #: completed watch streams and relists, for tests and /debug
        self.watches = 0
        self.relists = 0

    async def close(self) -> None:
        """Close the client if this source made it itself (``label_source(kubeconfig=...)``)."""
        if self._owns_client:
            await self._client.close()

    @property
    def labels(self) -> dict[str, str]:
        return {**self._api_labels, **self._static}

    async def fetch(self) -> dict[str, str]:
        """GET the Node and return its merged labels; on an API error, the last known ones.

        Never raises KubeError: at startup with the API server down the agent runs on the
        config's labels, and ``watch`` corrects them once the server answers.
        """
        try:
            node = await self._client.get(f"/api/v1/nodes/{quote(self.node_name)}", accept=METADATA_ACCEPT)
        except KubeError as exc:
            self._failed(exc)
            return self.labels
        self._recovered()
        self._api_labels = _labels_of(node)
        self.synced.set()
        return self.labels

    async def watch(self, on_change: OnChange) -> None:
        """List, then watch the Node until cancelled, calling ``on_change`` on every change."""
        try:
            await self._watch(on_change)
        finally:
            await self.close()

    async def _watch(self, on_change: OnChange) -> None:
        attempt = 0
        gone_in_a_row = 0
        while True:
            try:
                if not self._resource_version:
                    await self._list(on_change)
                started = self._clock()
                events = await self._follow(on_change)
            except KubeGoneError as exc:
                # the resourceVersion is older than the server's window: list again, at once the
                # first time; a server that keeps answering 410 gets the ordinary backoff
                gone_in_a_row += 1
                self._resource_version = ""
                log.info("node watch expired, listing again", node=self.node_name, reason=str(exc))
                if gone_in_a_row > 1:
                    attempt += 1
                    await self._sleep(self._backoff.delay(attempt))
                continue
            except KubeError as exc:
                self._failed(exc)
                attempt += 1
                await self._sleep(self._backoff.delay(attempt))
                continue
            gone_in_a_row = 0
            self.watches += 1
            if events or self._clock() - started >= self._min_watch_s:
                attempt = 0
                self._recovered()
            else:
                # ended cleanly but at once: something between us and the server closes streams
                attempt += 1
                log.debug("node watch ended at once", node=self.node_name, attempt=attempt)
                await self._sleep(self._backoff.delay(attempt))

    async def _list(self, on_change: OnChange) -> None:
        """List the one Node, apply its labels and watch from the list's resourceVersion."""
        body = await self._client.list(
            "/api/v1/nodes", {"fieldSelector": f"metadata.name={self.node_name}"}, accept=METADATA_LIST_ACCEPT
        )
        items = body.get("items")
        if not isinstance(items, list) or not items or not isinstance(items[0], dict):
            raise KubeError(f"GET {self._client.server}/api/v1/nodes: node {self.node_name!r} not found", status=404)
        self.relists += 1
        self._apply(_labels_of(items[0]), on_change)
        self.synced.set()
        metadata = body.get("metadata")
        version = metadata.get("resourceVersion") if isinstance(metadata, dict) else None
        self._resource_version = str(version or _resource_version(items[0]))

    async def _follow(self, on_change: OnChange) -> int:
        """Follow one watch stream from the current resourceVersion; return the event count.

        The resourceVersion advances with every event, so a stream that breaks resumes
        where it stopped.
        """
        params = {
            "fieldSelector": f"metadata.name={self.node_name}",
            "resourceVersion": self._resource_version,
            "allowWatchBookmarks": "true",
        }
        events = 0
        stream = self._client.watch("/api/v1/nodes", params, timeout_s=self._watch_timeout_s, accept=METADATA_ACCEPT)
        async with contextlib.aclosing(stream) as stream_events:
            async for event in stream_events:
                events += 1
                if events == 1:
                    self._recovered()
                kind, obj = event.get("type"), event["object"]
                if kind in ("ADDED", "MODIFIED"):
                    self._apply(_labels_of(obj), on_change)
                elif kind == "DELETED":
                    log.warning("node object deleted; keeping its last known labels", node=self.node_name)
                self._resource_version = _resource_version(obj) or self._resource_version
        return events

    def _apply(self, api_labels: dict[str, str], on_change: OnChange) -> None:
        before = self.labels
        self._api_labels = api_labels
        after = self.labels
        if after == before:
            return
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        log.info("node labels changed", node=self.node_name, keys=changed)
        on_change(after)

    def _failed(self, exc: KubeError) -> None:
        if self.last_error:
            log.debug("node labels still unavailable", node=self.node_name, error=str(exc))
        else:
            hint = " (the service account needs get/list/watch on nodes)" if exc.status == 403 else ""
            log.warning(
                "node labels unavailable; keeping the last known labels, retrying with backoff" + hint,
                node=self.node_name,
                error=str(exc),
                recoverable=exc.recoverable,
            )
        self.last_error = str(exc)

    def _recovered(self) -> None:
        if self.last_error:
            log.info("node labels available again", node=self.node_name)
            self.last_error = ""


def _labels_of(obj: Mapping[str, Any]) -> dict[str, str]:
    metadata = obj.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, dict) else None
    if not isinstance(labels, dict):
        return {}
    out: dict[str, str] = {}
    for key, value in labels.items():
        if isinstance(key, str) and isinstance(value, str):
            out[key] = value
        else:
            log.debug("node label dropped: its value is not a string", key=str(key)[:80], value=repr(value)[:40])
    return out


def _resource_version(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata")
    return str(metadata.get("resourceVersion") or "") if isinstance(metadata, dict) else ""


def label_source(
    *,
    node_name: str,
    static_labels: Mapping[str, str],
    client: KubeClient | None = None,
    kubeconfig: str | None = None,
    env: Mapping[str, str] | None = None,
    sa_dir: Path = SERVICE_ACCOUNT_DIR,
) -> NodeLabelSource | StaticLabelSource:
    """The API-backed source on ``client`` when there is one, else the static one.

    ``kubeconfig`` (with ``env``/``sa_dir``) is the older form for a caller without a shared
    client: the source then makes its own client and closes it when its watch ends. Raises
    KubeConfigError (a ConfigError) when that explicit kubeconfig cannot be used.
    """
    owns = False
    if client is None and kubeconfig is not None and kube_config_available(kubeconfig, env=env, sa_dir=sa_dir):
        client, owns = KubeClient.from_config(kubeconfig, env=env, sa_dir=sa_dir), True
    if client is None:
        log.info("no Kubernetes API access configured; node labels come from the config only", node=node_name)
        return StaticLabelSource(static_labels)
    log.info("node labels come from the API server", node=node_name, server=client.server, source=client.access.source)
    return NodeLabelSource(client, node_name=node_name, static_labels=static_labels, owns_client=owns)
