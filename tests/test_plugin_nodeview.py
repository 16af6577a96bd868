"""What the scheduler may count of the plugin's resources, and when a closing GPU may go."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pytest

from agent.core.config.schema import Owner, PluginConfig, TimeSlicingConfig
from agent.core.mechanism import NodeCeiling, NoNodeCounts
from agent.core.ownership.table import Drain, OwnershipTable
from agent.deviceplugin.nodeview import GIVE_UP_S, GRACE_S, closed_gpus, node_ceilings
from agent.deviceplugin.resources import plan_resources
from tests.test_plugin_fakes import ownership_for
from tests.test_plugin_resources import Health, inventory


class Counts:
    """A Node gate whose answers the test sets."""

    def __init__(self, held: Mapping[str, float | None]) -> None:
        self.held = dict(held)
        self.ceilings: dict[str, NodeCeiling] = {}

    def lower_to(self, ceilings: Mapping[str, NodeCeiling]) -> None:
        self.ceilings = dict(ceilings)

    def held_since(self, resource: str) -> float | None:
        return self.held.get(resource)

    def debug_state(self) -> dict[str, object]:
        return {}


def closing(table: OwnershipTable, gpu: str, since: float = 0.0) -> OwnershipTable:
    drain = Drain(source=Owner.DEVICE_PLUGIN, target=Owner.DRA, since=since, closing=True)
    return replace(table, draining={**table.draining, gpu: drain})


async def test_ceilings_leave_out_closing_gpus_and_count_health_as_the_kubelet_does() -> None:
    inv = await inventory("h100-8x-nvlink")
    g = {i: inv.find(str(i)).uuid for i in range(8)}  # type: ignore[union-attr]
    resources = plan_resources(inv, PluginConfig()).resources
    table = closing(ownership_for(inv, {g[1]: Owner.DRA}), g[2])
    assert table.granted_to(g[2], Owner.DEVICE_PLUGIN)  # still listed
    ceilings = node_ceilings(resources, table, Health({g[3]}))
    # listed: 7 (GPU 1 is DRA's); minus the closing GPU 2; GPU 3 counts in capacity, not allocatable
    assert ceilings == {"nvidia.com/gpu": NodeCeiling(capacity=6, allocatable=5)}


async def test_ceilings_count_replicas() -> None:
    inv = await inventory("h100-8x-nvlink")
    g = {i: inv.find(str(i)).uuid for i in range(8)}  # type: ignore[union-attr]
    config = PluginConfig(time_slicing=TimeSlicingConfig(replicas=4))
    resources = plan_resources(inv, config).resources
    table = closing(ownership_for(inv, {}), g[0])
    assert {n: c.allocatable for n, c in node_ceilings(resources, table, Health()).items()} == {"nvidia.com/gpu": 28}


@pytest.mark.parametrize(
    ("held", "now", "closed", "note"),
    [
        (None, 1.0, False, "lowering the Node's nvidia.com/gpu"),
        (0.5, 0.5 + GRACE_S / 2, False, "the Node's nvidia.com/gpu is lowered; pods bound before may still arrive"),
        (0.5, 0.5 + GRACE_S, True, ""),
        (None, GIVE_UP_S, True, ""),  # the Node could not be lowered: the drain goes on regardless
    ],
)
async def test_a_closing_gpu_is_closed_once_the_node_showed_the_lower_count_for_the_grace(
    held: float | None, now: float, closed: bool, note: str
) -> None:
    inv = await inventory("h100-8x-nvlink")
    g = {i: inv.find(str(i)).uuid for i in range(8)}  # type: ignore[union-attr]
    resources = plan_resources(inv, PluginConfig()).resources
    table = closing(ownership_for(inv, {}), g[5])
    result = closed_gpus(resources, table, Counts({"nvidia.com/gpu": held}), now)
    assert result.view.closed == (frozenset({g[5]}) if closed else frozenset())
    assert result.view.note == note
    assert result.given_up == (frozenset({g[5]}) if held is None and closed else frozenset())


async def test_without_api_access_closing_gpus_are_closed_at_once() -> None:
    inv = await inventory("h100-8x-nvlink")
    g0 = inv.find("0").uuid  # type: ignore[union-attr]
    resources = plan_resources(inv, PluginConfig()).resources
    result = closed_gpus(resources, closing(ownership_for(inv, {}), g0), NoNodeCounts(), 0.0)
    assert result.view.closed == {g0} and not result.given_up
