"""This Node as the API server has it: its labels, its UID and its allocatable, from one watch.

Ownership rules may match nodes by label (``ownership.nodes[].match.labels``) and one
ConfigMap serves every node, so each agent follows its own Node object. A platform team that
relabels a node pool (say, to move it to DRA) sees the agents follow within seconds. The
registration watchdog compares the Node's ``status.allocatable`` with what the agent advertises;
it reads it from the same watch (:attr:`NodeLabelSource.status`), so following the Node costs one
open stream and no polling: the whole object is watched, because labels alone
(``PartialObjectMetadata``) carry no status.

``label_source`` picks the implementation: :class:`NodeLabelSource` on the process's shared
API client when there is one, else :class:`StaticLabelSource` (labels from the config only).
Labels set in the config (``node_labels``) win over the API's. A label whose value is not a
string (a null from a broken server) is dropped with a debug line, never turned into "None".

The DaemonSet's service account needs read access to Node objects (a ClusterRole;
``config/base/rbac.yaml`` carries it)::

    rules:
      - apiGroups: [""]
        resources: [nodes]
        verbs: [get, list, watch]

``get`` serves :meth:`NodeLabelSource.fetch` (and the slice publisher's read of the UID);
``list`` and ``watch`` serve :meth:`NodeLabelSource.watch`, which lists the one node
(``fieldSelector=metadata.name=``) and follows it as ``agent/kube/listwatch.py`` describes:
resumed from its resourceVersion, listed again only after 410 Gone, every retry after a backoff
with jitter. API errors never escape: the last known labels stay in force, and one log line per
failure streak says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import structlog

from agent.core.mechanism import NodeStatus
from agent.kube.access import SERVICE_ACCOUNT_DIR, kube_config_available
from agent.kube.client import METADATA_ACCEPT, KubeClient
from agent.kube.errors import KubeError
from agent.kube.listwatch import PRODUCTION, ListWatch, WatchTiming
from agent.kube.nodestatus import allocatable_of

log = structlog.get_logger("agent.kube")

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
    """This Node from the API server: its labels, merged under ``static_labels``, and its allocatable.

    ``fetch`` and ``on_change`` report the same thing: the merged labels. ``on_change`` is
    called from ``watch`` only when they differ from what ``fetch`` or the previous
    ``on_change`` reported. :attr:`status` is the Node's ``status.allocatable`` from the same
    watch, for the registration watchdog (:class:`~agent.kube.nodestatus.NodeStatusSource`).
    """

    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        static_labels: Mapping[str, str] | None = None,
        timing: WatchTiming = PRODUCTION,
        owns_client: bool = False,
    ) -> None:
        self._client = client
        #: a client this source made itself (see ``label_source``) is closed when ``watch`` ends
        self._owns_client = owns_client
        self.node_name = node_name
        self._static = dict(static_labels or {})
        self._api_labels: dict[str, str] = {}
        self._allocatable: dict[str, int] | None = None
        #: the Node's metadata.uid once read
        self.uid = ""
        #: set once the Node has been read from the API server
        self.synced = asyncio.Event()
        self._on_change: OnChange = lambda labels: None
        self._watch = ListWatch(
            client,
            path="/api/v1/nodes",
            params={"fieldSelector": f"metadata.name={node_name}"},
            on_list=self._listed,
            on_event=self._event,
            on_error=self._failed,
            on_recovered=self._recovered,
            timing=timing,
        )
        #: the current failure streak's error ("" when the last request worked)
        self.last_error = ""

    async def close(self) -> None:
        """Close the client if this source made it itself (``label_source(kubeconfig=...)``)."""
        if self._owns_client:
            await self._client.close()

    @property
    def labels(self) -> dict[str, str]:
        return {**self._api_labels, **self._static}

    @property
    def watches(self) -> int:
        """Watch streams opened so far."""
        return self._watch.watches

    @property
    def relists(self) -> int:
        return self._watch.lists

    @property
    def status(self) -> NodeStatus:
        """The Node's extended allocatable as last watched; unknown while the watch is not fresh."""
        if self._allocatable is None:
            return NodeStatus(reason=f"the Node has not been read yet{self._why()}")
        if not self._watch.fresh():
            return NodeStatus(reason=f"the Node watch is not current{self._why()}")
        return NodeStatus(allocatable=dict(self._allocatable))

    async def refresh(self) -> None:
        """Nothing to do: the watch keeps :attr:`status` current (the watchdog calls this each round)."""

    def debug_state(self) -> dict[str, object]:
        return {"node": self.node_name, **self._watch.debug_state()}

    def _why(self) -> str:
        error = self.last_error or self._watch.last_error
        return f": {error}" if error else ""

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
        """List, then watch the Node until cancelled, calling ``on_change`` on every label change."""
        self._on_change = on_change
        try:
            await self._watch.run()
        finally:
            await self.close()

    def _listed(self, items: list[Any]) -> None:
        if not items or not isinstance(items[0], dict):
            raise KubeError(f"GET {self._client.server}/api/v1/nodes: node {self.node_name!r} not found", status=404)
        self._apply(items[0])
        self.synced.set()

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self._apply(obj)
        elif kind == "DELETED":
            log.warning("node object deleted; keeping its last known labels", node=self.node_name)

    def _apply(self, node: Mapping[str, Any]) -> None:
        metadata = node.get("metadata")
        uid = metadata.get("uid") if isinstance(metadata, dict) else None
        self.uid = uid if isinstance(uid, str) else self.uid
        self._allocatable = allocatable_of(node)
        before = self.labels
        self._api_labels = _labels_of(node)
        after = self.labels
        if after == before:
            return
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        log.info("node labels changed", node=self.node_name, keys=changed)
        self._on_change(after)

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
