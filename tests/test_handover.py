"""The handover decision: desired owners become granted ones only once the old owner let go."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from agent.core.config.loader import build_config
from agent.core.config.schema import Owner
from agent.core.mechanism import Holder, Usage
from agent.core.ownership.handover import IDLE, SETTLE_S, Handover, Observed, next_grants
from agent.core.ownership.table import Drain, OwnershipState, OwnershipTable, compute_ownership
from tests.test_ownership import _inventory, granted_gpus

DP, DRA, NONE = Owner.DEVICE_PLUGIN, Owner.DRA, Owner.NONE


def desired(default: str, gpus: Mapping[str, str] | None = None, version: str = "v") -> OwnershipTable:
    doc: dict[str, object] = {"default": default}
    if gpus:
        doc["nodes"] = [{"match": {"names": ["n1"]}, "gpus": dict(gpus)}]
    config = build_config({"ownership": doc})
    return compute_ownership(_inventory(), config.ownership, node_name="n1", node_labels={}, version=version)


def pod(name: str) -> Holder:
    return Holder(kind="container", namespace="ml", name=name, uid=f"uid-{name}", detail="main")


def seen(
    holders: Mapping[str, tuple[Holder, ...]] | None = None,
    *,
    known: bool = True,
    advertised: frozenset[str] = frozenset(),
    as_of: float = 100.0,
    reason: str = "",
) -> Observed:
    return Observed(Usage(known=known, holders=holders or {}, reason=reason, as_of=as_of), advertised)


def test_start_up_grants_what_nobody_else_holds() -> None:
    table = next_grants(desired("device-plugin"), None, {DP: seen(), DRA: seen()}, now=0.0)
    assert table.draining == {}
    assert granted_gpus(table, DP) == {"GPU-0", "GPU-1", "GPU-2", "GPU-3"}
    assert table.granted_to("MIG-0", DP)  # MIG devices follow the parent


def test_start_up_continues_a_drain_from_what_the_other_mechanism_holds() -> None:
    """Killed mid-drain: the pods the device plugin handed out still hold GPU-1; DRA must wait."""
    want = desired("device-plugin", {"1": "dra"})
    table = next_grants(want, None, {DP: seen({"GPU-1": (pod("a"),)}), DRA: seen()}, now=0.0)
    assert table.state_of("GPU-1") == "draining:device-plugin->dra"
    assert not table.granted_to("GPU-1", DRA) and not table.granted_to("GPU-1", DP)
    assert "pod ml/a" in table.draining["GPU-1"].waiting_for
    assert table.granted_to("GPU-0", DP)


def test_unknown_usage_is_never_idle() -> None:
    """No PodResources answer yet: GPUs the config gives to DRA wait; the device plugin's own do not."""
    want = desired("dra", {"0": "device-plugin"})
    table = next_grants(want, None, {DP: seen(known=False, reason="no socket"), DRA: seen()}, now=0.0)
    assert table.granted_to("GPU-0", DP)
    for gpu in ("GPU-1", "GPU-2", "GPU-3"):
        assert table.state_of(gpu) == "draining:device-plugin->dra"
        assert table.draining[gpu].waiting_for == "device-plugin cannot tell who uses it: no socket"


def test_a_config_change_drains_until_the_last_user_leaves_then_grants() -> None:
    before = next_grants(desired("device-plugin"), None, {DP: seen(), DRA: seen()}, now=0.0)
    want = desired("device-plugin", {"1": "dra"}, version="v2")
    everything = frozenset({"GPU-0", "GPU-1", "GPU-2", "GPU-3"})
    # the old owner still lists the GPU in this observation: it cannot have stopped yet
    step = next_grants(want, before, {DP: seen(advertised=everything, as_of=10.0), DRA: seen()}, now=10.0)
    assert step.draining["GPU-1"].waiting_for == "device-plugin still advertises it"
    assert not step.granted_to("GPU-1", DP) and not step.granted_to("GPU-1", DRA)
    # it stopped listing it, but a pod holds it
    step = next_grants(want, step, {DP: seen({"GPU-1": (pod("a"), pod("b"))}, as_of=11.0), DRA: seen()}, now=11.0)
    assert step.draining["GPU-1"].waiting_for == "in use through device-plugin by pod ml/a, ml/b"
    # the pods are gone, but the observation predates the settle window: a kubelet Allocate may be in flight
    step = next_grants(want, step, {DP: seen(as_of=10.0 + SETTLE_S / 2), DRA: seen()}, now=12.0)
    assert step.draining["GPU-1"].waiting_for == "confirming that device-plugin no longer uses it"
    step = next_grants(want, step, {DP: seen(as_of=12.0), DRA: seen()}, now=12.0)
    assert step.draining == {} and step.granted_to("GPU-1", DRA)


def test_changing_back_ends_the_drain_at_once() -> None:
    before = next_grants(desired("device-plugin"), None, {DP: seen(), DRA: seen()}, now=0.0)
    busy = {DP: seen({"GPU-1": (pod("a"),)}), DRA: seen()}
    step = next_grants(desired("device-plugin", {"1": "dra"}), before, busy, now=1.0)
    assert "GPU-1" in step.draining
    back = next_grants(desired("device-plugin"), step, busy, now=2.0)
    assert back.draining == {} and back.granted_to("GPU-1", DP)


def test_a_new_target_keeps_the_drain_and_its_start() -> None:
    before = next_grants(desired("device-plugin"), None, {DP: seen(), DRA: seen()}, now=0.0)
    busy = {DP: seen({"GPU-1": (pod("a"),)}), DRA: seen()}
    step = next_grants(desired("device-plugin", {"1": "dra"}), before, busy, now=1.0)
    step = next_grants(desired("device-plugin", {"1": "none"}), step, busy, now=2.0)
    assert step.draining["GPU-1"] == Drain(DP, NONE, since=1.0, waiting_for=step.draining["GPU-1"].waiting_for)


def test_a_gpu_granted_to_nobody_still_waits_for_whoever_advertises_it() -> None:
    """At start DRA's slices are unknown (it may list every GPU). The config gives GPU-0 to DRA (a
    drain from the device plugin, which cannot tell yet), then to nobody: that drain completes once
    the device plugin let go, while DRA may still list the GPU. Granting it on must wait for that."""
    stale = frozenset({"GPU-0", "GPU-1", "GPU-2", "GPU-3"})
    step = next_grants(desired("device-plugin"), None, {DP: seen(known=False), DRA: seen(advertised=stale)}, now=0.0)
    assert step.state_of("GPU-0") == "draining:dra->device-plugin"
    step = next_grants(desired("device-plugin", {"0": "dra"}), step, {DP: seen(known=False), DRA: seen()}, now=1.0)
    assert step.state_of("GPU-0") == "draining:device-plugin->dra"
    observed = {DP: seen(as_of=2.0), DRA: seen(advertised=stale)}
    step = next_grants(desired("device-plugin", {"0": "none"}), step, observed, now=2.0)
    assert step.state_of("GPU-0") == "none"
    step = next_grants(desired("device-plugin"), step, observed, now=3.0)
    assert step.state_of("GPU-0") == "draining:dra->device-plugin"
    assert step.draining["GPU-0"].waiting_for == "dra still advertises it"
    step = next_grants(desired("device-plugin"), step, {DP: seen(as_of=4.0), DRA: seen(as_of=4.0)}, now=4.0)
    assert step.granted_to("GPU-0", DP)


def test_maintenance_drains_then_nobody_advertises() -> None:
    before = next_grants(desired("dra"), None, {DP: seen(), DRA: seen()}, now=0.0)
    claim = Holder(kind="claim", namespace="ml", name="c", uid="u")
    step = next_grants(desired("dra", {"2": "none"}), before, {DP: seen(), DRA: seen({"GPU-2": (claim,)})}, now=1.0)
    assert step.state_of("GPU-2") == "draining:dra->none"
    assert "by claim ml/c" in step.draining["GPU-2"].waiting_for
    step = next_grants(desired("dra", {"2": "none"}), step, {DP: seen(), DRA: seen(as_of=5.0)}, now=5.0)
    assert step.draining == {} and step.owner_of("GPU-2") is NONE
    assert not step.granted_to("GPU-2", DRA) and step.granted_to("GPU-2", NONE) is not False
    # out of maintenance: nobody can hold a GPU nobody advertised, so it is granted at once
    back = next_grants(desired("device-plugin"), step, {DP: seen(), DRA: seen()}, now=6.0)
    assert back.granted_to("GPU-2", DP)


def test_a_gpu_that_vanishes_while_draining_is_dropped_and_rederived_when_it_returns() -> None:
    full = desired("device-plugin", {"GPU-3": "dra"})
    before = next_grants(desired("device-plugin"), None, {DP: seen(), DRA: seen()}, now=0.0)
    busy = {DP: seen({"GPU-3": (pod("a"),)}), DRA: seen()}
    step = next_grants(full, before, busy, now=1.0)
    assert "GPU-3" in step.draining
    gone = replace_owners(full, drop="GPU-3")
    step = next_grants(gone, step, busy, now=2.0)
    assert "GPU-3" not in step.owners and step.draining == {}
    step = next_grants(full, step, busy, now=3.0)  # back, still held: drains again
    assert step.state_of("GPU-3") == "draining:device-plugin->dra"


def replace_owners(table: OwnershipTable, *, drop: str) -> OwnershipTable:
    from dataclasses import replace

    owners = {u: o for u, o in table.owners.items() if u != drop and table.parents.get(u) != drop}
    parents = {m: p for m, p in table.parents.items() if p != drop}
    return replace(table, owners=owners, parents=parents)


def test_vanished_overrides_are_inert_not_errors() -> None:
    table = desired("device-plugin", {"9": "dra", "GPU-404": "none", "1": "dra"})
    assert table.owner_of("GPU-1") is DRA
    assert len(table.inert_overrides) == 2
    assert all("inert until one appears" in w for w in table.inert_overrides)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []

    def started(self, gpu: str, drain: Drain) -> None:
        self.events.append(("started", gpu, drain.label))

    def completed(self, gpu: str, source: Owner, target: Owner, waited_s: float) -> None:
        self.events.append(("completed", gpu, f"{source.value}->{target.value}"))

    def waiting_long(self, gpu: str, drain: Drain, waited_s: float) -> None:
        self.events.append(("waiting", gpu, drain.label))

    def index_moved(self, key: str, old_uuid: str, new_uuid: str) -> None:
        self.events.append(("index", key, old_uuid, new_uuid))


def test_handover_publishes_grants_and_tells_its_listener() -> None:
    clock = [0.0]
    observed = {DP: seen(as_of=0.0), DRA: seen()}
    state = OwnershipState()
    recorder = Recorder()
    handover = Handover(
        ownership=state,
        observe={owner: (lambda owner=owner: observed[owner]) for owner in (DP, DRA)},  # type: ignore[misc]
        listener=recorder,
        long_wait_s=30.0,
        clock=lambda: clock[0],
    )
    handover.set_desired(desired("device-plugin"))
    assert state.current.granted_to("GPU-1", DP) and recorder.events == []
    with state.changes.subscribe() as changes:
        observed[DP] = seen({"GPU-1": (pod("a"),)}, as_of=1.0)
        clock[0] = 1.0
        handover.set_desired(desired("device-plugin", {"1": "dra"}, version="v2"))
        assert changes.get_nowait() is state.current  # the grant change is announced
        assert state.desired.owner_of("GPU-1") is DRA and state.current.state_of("GPU-1").startswith("draining")
        clock[0] = 40.0
        handover.evaluate()
        handover.evaluate()  # warned once per drain
        observed[DP] = seen(as_of=41.0)
        clock[0] = 41.0
        handover.evaluate()
    assert recorder.events == [
        ("started", "GPU-1", "draining:device-plugin->dra"),
        ("waiting", "GPU-1", "draining:device-plugin->dra"),
        ("completed", "GPU-1", "device-plugin->dra"),
    ]
    assert state.current.granted_to("GPU-1", DRA)


def test_an_index_override_that_now_names_another_gpu_is_reported() -> None:
    """GPU-1 falls off the bus and NVML renumbers the rest: index 2 is GPU-3 now."""
    from dataclasses import replace

    recorder = Recorder()
    handover = Handover(ownership=OwnershipState(), observe={}, listener=recorder)
    handover.set_desired(desired("device-plugin", {"2": "dra"}))
    inventory = _inventory()
    left = tuple(replace(g, index=i) for i, g in enumerate(g for g in inventory.gpus if g.uuid != "GPU-1"))
    config = build_config({"ownership": {"nodes": [{"match": {"names": ["n1"]}, "gpus": {"2": "dra"}}]}})
    renumbered = compute_ownership(
        replace(inventory, gpus=left), config.ownership, node_name="n1", node_labels={}, version="v2"
    )
    handover.set_desired(renumbered)
    assert recorder.events == [("index", "ownership.nodes[0].gpus['2']", "GPU-2", "GPU-3")]


@pytest.mark.parametrize("owner", [DP, DRA])
def test_a_missing_mechanism_counts_as_idle(owner: Owner) -> None:
    table = next_grants(desired("device-plugin", {"1": "dra"}), None, {owner: IDLE}, now=0.0)
    assert table.draining == {}
