from __future__ import annotations

import pytest

from agent.core.config.loader import build_config
from agent.core.config.schema import Owner
from agent.core.inventory.model import Gpu, Inventory, MigDevice
from agent.core.ownership.table import OwnershipState, OwnershipTable, compute_ownership


def granted_gpus(table: OwnershipTable, owner: Owner) -> frozenset[str]:
    """Physical GPUs (no MIG devices) granted to ``owner``."""
    return frozenset(gpu for gpu in table.gpus() if table.granted_to(gpu, owner))


def _inventory() -> Inventory:
    gpus = []
    for i in range(4):
        migs: tuple[MigDevice, ...] = ()
        if i == 3:
            migs = tuple(
                MigDevice(
                    uuid=f"MIG-{j}",
                    parent_uuid="GPU-3",
                    index=j,
                    gpu_instance_id=j + 1,
                    compute_instance_id=0,
                    profile="1g.10gb",
                    memory_mib=9856,
                )
                for j in range(2)
            )
        gpus.append(
            Gpu(
                uuid=f"GPU-{i}",
                index=i,
                minor=i,
                product_name="H100",
                architecture="hopper",
                compute_capability="9.0",
                memory_mib=81559,
                pci_bus_id=f"00000000:{i:02x}:00.0",
                numa_node=0,
                mig_enabled=bool(migs),
                mig_devices=migs,
            )
        )
    return Inventory(backend="test", driver_version="570", cuda_driver_version="12.8", gpus=tuple(gpus))


def _table(doc: dict[str, object], node: str = "n1", labels: dict[str, str] | None = None) -> dict[str, Owner]:
    config = build_config({"ownership": doc})
    table = compute_ownership(_inventory(), config.ownership, node_name=node, node_labels=labels or {}, version="v")
    return dict(table.owners)


def test_cluster_default_applies_everywhere_including_mig() -> None:
    owners = _table({"default": "dra"})
    assert set(owners.values()) == {Owner.DRA}
    assert owners["MIG-0"] is Owner.DRA


def test_node_rule_by_name_then_gpu_overrides_by_uuid_and_index() -> None:
    doc = {
        "default": "device-plugin",
        "nodes": [{"match": {"names": ["n1"]}, "default": "dra", "gpus": {"GPU-0": "device-plugin", "3": "none"}}],
    }
    owners = _table(doc)
    assert owners["GPU-0"] is Owner.DEVICE_PLUGIN
    assert owners["GPU-1"] is Owner.DRA
    assert owners["GPU-3"] is Owner.NONE
    assert owners["MIG-1"] is Owner.NONE  # MIG devices follow the parent
    assert set(_table(doc, node="n2").values()) == {Owner.DEVICE_PLUGIN}


def test_the_table_says_which_overrides_are_by_index_and_the_gpu_each_names() -> None:
    doc = {"nodes": [{"match": {"names": ["n1"]}, "gpus": {"GPU-0": "dra", "3": "none", "1": "dra", "9": "dra"}}]}
    config = build_config({"ownership": doc})
    table = compute_ownership(_inventory(), config.ownership, node_name="n1", node_labels={}, version="v")
    # by UUID is not by index; an inert one names no GPU
    assert table.index_overrides == {"ownership.nodes[0].gpus['1']": "GPU-1", "ownership.nodes[0].gpus['3']": "GPU-3"}


def test_node_rule_by_labels_needs_all_labels_and_first_match_wins() -> None:
    doc = {
        "nodes": [
            {"match": {"labels": {"pool": "dra", "zone": "a"}}, "default": "none"},
            {"match": {"labels": {"pool": "dra"}}, "default": "dra"},
        ]
    }
    assert set(_table(doc, labels={"pool": "dra"}).values()) == {Owner.DRA}
    assert set(_table(doc, labels={"pool": "dra", "zone": "a"}).values()) == {Owner.NONE}
    assert set(_table(doc, labels={"pool": "other"}).values()) == {Owner.DEVICE_PLUGIN}


@pytest.mark.parametrize("key", ["GPU-404", "9"])
def test_override_for_a_gpu_not_on_the_node_is_inert(key: str) -> None:
    """A GPU that fell off the bus (or a pool rule naming another node's GPU) is not a config error."""
    config = build_config({"ownership": {"nodes": [{"match": {"names": ["n1"]}, "gpus": {key: "dra", "1": "dra"}}]}})
    table = compute_ownership(_inventory(), config.ownership, node_name="n1", node_labels={}, version="v")
    assert table.inert_overrides == (
        f"ownership.nodes[0].gpus[{key!r}]: no GPU with that UUID or index on node 'n1'; inert until one appears",
    )
    assert table.owner_of("GPU-1") is Owner.DRA and table.owner_of("GPU-0") is Owner.DEVICE_PLUGIN
    assert table.rules["GPU-1"] == "ownership.nodes[0].gpus['1']" and table.rules["GPU-0"] == "cluster default"


def test_table_queries() -> None:
    config = build_config({"ownership": {"nodes": [{"match": {"names": ["n1"]}, "gpus": {"1": "dra"}}]}})
    table = compute_ownership(_inventory(), config.ownership, node_name="n1", node_labels={}, version="v1")
    assert granted_gpus(table, Owner.DRA) == {"GPU-1"}
    assert granted_gpus(table, Owner.DEVICE_PLUGIN) == {"GPU-0", "GPU-2", "GPU-3"}
    assert table.counts() == {Owner.DEVICE_PLUGIN: 3, Owner.DRA: 1, Owner.NONE: 0}
    assert table.owner_of("GPU-unknown") is Owner.NONE
    assert table.node_rule == "ownership.nodes[0]"


def test_state_publishes_only_real_changes() -> None:
    inv = _inventory()
    config = build_config({})
    state = OwnershipState()
    with state.changes.subscribe() as sub:
        assert state.update(compute_ownership(inv, config.ownership, node_name="n", node_labels={}, version="1"))
        assert not state.update(compute_ownership(inv, config.ownership, node_name="n", node_labels={}, version="2"))
        assert len(sub.drain()) == 1
        assert state.current.version == "2"
