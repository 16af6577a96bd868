"""The operator-facing watchers the composition root adds to the agent, built in one place.

* :class:`~agent.observe.utilization.UtilizationSampler`: how busy each GPU and MIG device is;
* :class:`~agent.observe.orphans.OrphanDetector`: devices held for pods or claims that are gone;
* :class:`~agent.observe.watchdog.Watchdog`: what the agent advertises against what the node shows.

Each runs as a root task (:meth:`Observers.roots`) and reads the mechanisms only through
:class:`~agent.core.mechanism.Mechanism`. What they need from the API server is pushed to them: the
orphan check reads this node's pods from one watch (``agent/kube/pods.py``, a root task of its own
once the node has GPUs), and the watchdog reads the Node's allocatable from the Node watch the
agent keeps for its labels (``node``). Without API access (``kube`` None) the orphan check and the
watchdog still run on what needs no API (CDI claim specs; the kubelet's PodResources view).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from agent.backends.backend import Backend
from agent.core.config.current import ConfigState
from agent.core.eventsink import EventSink
from agent.core.inventory.current import InventoryState
from agent.core.mechanism import Mechanism
from agent.kube.claims.model import ClaimSource
from agent.kube.claims.source import NoApiClaims
from agent.kube.client import KubeClient
from agent.kube.nodestatus import NoApiNodeStatus, NodeStatusSource
from agent.kube.pods import NoApiPods, NodePods, PodArrivals, PodLookup
from agent.observe.orphans import ClaimSpecListing, OrphanDetector
from agent.observe.utilization import UtilizationSampler
from agent.observe.watchdog import Watchdog


@dataclass(frozen=True, slots=True)
class Observers:
    utilization: UtilizationSampler
    orphans: OrphanDetector
    watchdog: Watchdog
    #: this node's pods, for the orphan check
    pods: PodLookup
    #: waits until the node has GPUs (a node without GPUs watches nothing)
    has_gpus: Callable[[], Awaitable[None]]

    def roots(self) -> dict[str, Callable[[], Awaitable[None]]]:
        return {
            "utilization": self.utilization.run,
            "orphans": self.orphans.run,
            "watchdog": self.watchdog.run,
            "node-pods": self._watch_pods,
        }

    async def _watch_pods(self) -> None:
        await self.has_gpus()
        await self.pods.run()

    def debug_state(self) -> dict[str, object]:
        return {
            "utilization": self.utilization.debug_state(),
            "orphans": self.orphans.debug_state(),
            "watchdog": self.watchdog.debug_state(),
        }


def busy_gpus(mechanisms: Mapping[str, Mechanism]) -> frozenset[str]:
    """Physical GPUs something holds through any mechanism (as far as each can tell)."""
    return frozenset(gpu for m in mechanisms.values() for gpu, held in m.usage().holders.items() if held)


def build_observers(
    *,
    config: ConfigState,
    backend: Backend,
    inventory: InventoryState,
    mechanisms: Mapping[str, Mechanism],
    registry: CollectorRegistry,
    kube: KubeClient | None = None,
    node_name: str = "",
    claims: ClaimSource | None = None,
    pod_arrivals: PodArrivals | None = None,
    claim_specs: ClaimSpecListing | None = None,
    events: EventSink | None = None,
    node: NodeStatusSource | None = None,
) -> Observers:
    """``node``: the Node's status (the Node watch); without it the watchdog's node checks are skipped.
    ``pod_arrivals`` is told about pods arriving on the node and leaving it (the pod watch's)."""
    pods: PodLookup = NodePods(kube, node_name=node_name, arrivals=pod_arrivals) if kube is not None else NoApiPods()

    async def has_gpus() -> None:
        with inventory.changes.subscribe() as changes:
            while not inventory.current.gpus:
                await changes.get()

    return Observers(
        utilization=UtilizationSampler(
            backend=backend,
            inventory=inventory,
            config=config,
            busy=lambda: busy_gpus(mechanisms),
            registry=registry,
        ),
        orphans=OrphanDetector(
            mechanisms=mechanisms,
            pods=pods,
            claims=claims or NoApiClaims(),
            config=config,
            claim_specs=claim_specs,
            events=events,
            registry=registry,
        ),
        watchdog=Watchdog(
            mechanisms=mechanisms,
            node=node or NoApiNodeStatus(),
            config=config,
            has_gpus=lambda: bool(inventory.current.gpus),
            events=events,
            registry=registry,
        ),
        pods=pods,
        has_gpus=has_gpus,
    )
