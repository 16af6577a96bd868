"""One resource's device-plugin behaviour, free of gRPC: what the servicer calls.

A :class:`ResourceService` lives as long as one server run (a restart builds a new one), so
its ``changed`` feed, ``stopping`` flag and kubelet ``link`` are per run: stopping a run ends
exactly that run's ListAndWatch streams. An inventory or plugin-config change that keeps the
resource name swaps the resource, config, inventory and scorer in place
(:meth:`ResourceService.update`) instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from agent.base.feeds import Broadcast
from agent.core.config.schema import Owner, PluginConfig
from agent.core.inventory.model import Inventory
from agent.core.ownership.table import OwnershipState
from agent.deviceplugin.allocate import Allocator, ContainerAllocation, resolve_ids
from agent.deviceplugin.cdinames import CdiNames
from agent.deviceplugin.errors import AllocationError, ErrorKind
from agent.deviceplugin.link import KubeletLink
from agent.deviceplugin.preferred import TopologyScorer, preferred_allocation
from agent.deviceplugin.resources import DeviceState, HealthLookup, Resource, advertised

#: how long a first ListAndWatch answer waits for this start's grants
FIRST_LIST_WAIT_S = 3.0


@dataclass(frozen=True, slots=True)
class Options:
    pre_start_required: bool = False
    get_preferred_allocation_available: bool = True


@dataclass(frozen=True, slots=True)
class PreferredRequest:
    available: Sequence[str]
    must_include: Sequence[str]
    size: int


class ResourceService:
    def __init__(
        self,
        *,
        resource: Resource,
        config: PluginConfig,
        inventory: Inventory,
        ownership: OwnershipState,
        health: HealthLookup,
        cdi: CdiNames,
        scorer: TopologyScorer | None = None,
        link: KubeletLink | None = None,
    ) -> None:
        self.resource = resource
        self.options = Options()
        #: the kubelet's hold on this run (registration state), fed by the servicer
        self.link = link or KubeletLink()
        self._config = config
        self._inventory = inventory
        self._ownership = ownership
        self._health = health
        self._cdi = cdi
        self._allocator = Allocator(config=config, cdi=cdi)
        self._scorer = scorer or TopologyScorer(inventory)
        #: "the device list may have changed"; one pending item per stream is enough
        self.changed: Broadcast[None] = Broadcast(maxsize=1)
        self.stopping = False

    # --- ListAndWatch ------------------------------------------------------------

    def devices(self) -> list[DeviceState]:
        return advertised(self.resource, self._ownership.current, self._health)

    async def grants_decided(self, timeout_s: float = FIRST_LIST_WAIT_S) -> None:
        """Until this start's grants are known (bounded), before the first ListAndWatch answer.

        Right after a start the handover may not have decided yet which GPUs are the plugin's;
        an empty first list would tell the kubelet "no GPUs here" (see
        :class:`~agent.core.ownership.table.OwnershipState`). Waits at most ``timeout_s``.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._ownership.decided.wait()

    def notify(self) -> None:
        """Tell every open ListAndWatch stream to send the current list."""
        self.changed.publish(None)

    def update(self, *, resource: Resource, config: PluginConfig, inventory: Inventory, scorer: TopologyScorer) -> None:
        """Serve a re-planned ``resource`` (same name) under ``config`` for ``inventory``; open
        streams resend.

        Loop thread only. A request already past its ID checks finishes against the resource
        it started with; the next one sees the new device list (a GPU that went is then an
        unknown ID, ``INVALID_ARGUMENT``).
        """
        if resource.name != self.resource.name:
            raise ValueError(f"service for {self.resource.name} cannot serve {resource.name}")
        self.resource = resource
        if config != self._config:
            self._config = config
            self._allocator = Allocator(config=config, cdi=self._cdi)
        self._inventory = inventory
        self._scorer = scorer
        self.notify()

    # --- who is on the other end (the servicer reports, the link decides) --------------

    def options_requested(self, connection: Hashable) -> None:
        self.link.options_requested(connection)

    def stream_opened(self, connection: Hashable) -> int:
        return self.link.stream_opened(connection)

    def stream_closed(self, token: int) -> None:
        self.link.stream_closed(token)

    def stop_streams(self) -> None:
        """End every ListAndWatch stream of this run (each returns after its current send)."""
        self.stopping = True
        self.changed.publish(None)

    # --- unary RPCs ----------------------------------------------------------------

    async def allocate(self, requests: Sequence[Sequence[str]]) -> list[ContainerAllocation]:
        answers = await self._allocator.allocate(
            self.resource, requests, ownership=self._ownership.current, health=self._health
        )
        # the allocator may have awaited the CDI spec: an ownership handover or a health change
        # that landed meanwhile must still refuse the devices (never both mechanisms at once)
        for ids in requests:
            resolve_ids(self.resource, ids, ownership=self._ownership.current, health=self._health)
        return answers

    def prestart(self, ids: Sequence[str]) -> None:
        self._allocator.prestart(self.resource, ids, ownership=self._ownership.current, health=self._health)

    def preferred(self, requests: Sequence[PreferredRequest]) -> list[list[str]]:
        if not requests:
            raise AllocationError(
                ErrorKind.INVALID_ARGUMENT, f"preferred allocation {self.resource.name}: no container requests"
            )
        return [
            preferred_allocation(
                available=self._staying(r),
                must_include=r.must_include,
                size=r.size,
                gpu_of=self.resource.gpu_of,
                inventory=self._inventory,
                replica_policy=self._config.replica_policy,
                scorer=self._scorer,
                usable=self._usable,
            )
            for r in requests
        ]

    def _staying(self, request: PreferredRequest) -> Sequence[str]:
        """The available devices less those of GPUs the plugin is giving up (closing), when the
        rest is enough: a pod admitted while a GPU closes then does not hold up its handover."""
        table = self._ownership.current
        gpu_of = self.resource.gpu_of
        staying = [i for i in request.available if i in request.must_include or not table.closing(gpu_of.get(i, ""))]
        return staying if len(staying) >= request.size else request.available

    def _usable(self, device_id: str) -> bool:
        """Whether a listed device may be handed out now (called for known IDs only)."""
        device = self.resource.by_id[device_id]
        granted = self._ownership.current.granted_to(device.gpu_uuid, Owner.DEVICE_PLUGIN)
        return granted and self._health.is_healthy(device.target_uuid)
