"""The handover decision: desired owners become granted ones only once the old owner let go."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest

from agent.core.config.loader import build_config
from agent.core.config.schema import Owner
from agent.core.mechanism import Holder, Usage
from agent.core.ownership.handover import (
    DRA_SETTLE_S,
    IDLE,
    SETTLE_S,
    Handover,
    Observed,
    covers_device_plugin,
    next_grants,
    seed_grants,
)
from agent.core.ownership.record import GrantRecord, RecordKeeper
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
    assert step.draining["GPU-1"] == Drain(
        DP, NONE, since=1.0, waiting_for=step.draining["GPU-1"].waiting_for, withdrawn=1.0, held=True
    )


def test_a_gpu_granted_to_nobody_still_waits_for_whoever_advertises_it() -> None:
    """At start DRA's slices are unknown (it may list every GPU). The config gives GPU-0 to DRA (a
    drain from the device plugin, which cannot tell yet), then to nobody: once the device plugin let
    go, that drain (derived at start) goes on waiting on DRA, which may still list the GPU (and a
    claim the scheduler allocated from that list must not be stranded). Granting it on waits too."""
    stale = frozenset({"GPU-0", "GPU-1", "GPU-2", "GPU-3"})
    step = next_grants(desired("device-plugin"), None, {DP: seen(known=False), DRA: seen(advertised=stale)}, now=0.0)
    assert step.state_of("GPU-0") == "draining:dra->device-plugin"
    step = next_grants(desired("device-plugin", {"0": "dra"}), step, {DP: seen(known=False), DRA: seen()}, now=1.0)
    assert step.state_of("GPU-0") == "draining:device-plugin->dra"
    observed = {DP: seen(as_of=2.0), DRA: seen(advertised=stale)}
    step = next_grants(desired("device-plugin", {"0": "none"}), step, observed, now=2.0)
    assert step.state_of("GPU-0") == "draining:dra->none"
    assert step.dra_may_prepare("GPU-0")  # waiting on DRA alone: a claim it allocated is honoured
    step = next_grants(desired("device-plugin"), step, observed, now=3.0)
    assert step.state_of("GPU-0") == "draining:dra->device-plugin"
    assert step.draining["GPU-0"].waiting_for == "dra still advertises it"
    step = next_grants(desired("device-plugin"), step, {DP: seen(as_of=4.0), DRA: seen(as_of=4.0)}, now=4.0)
    # withdrawn from the slices now: a claim the scheduler allocated from them may yet be bound
    assert step.draining["GPU-0"].waiting_for == "confirming that dra no longer uses it"
    later = 4.0 + DRA_SETTLE_S
    step = next_grants(desired("device-plugin"), step, {DP: seen(as_of=later), DRA: seen(as_of=later)}, now=later)
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


# --- closing: the device plugin serves a GPU it gives up until the scheduler no longer counts it ---


def closed(gpus: frozenset[str], *, as_of: float = 100.0) -> Observed:
    """The device plugin's observation with a scheduler gate: ``gpus`` are closed."""
    return Observed(Usage(known=True, as_of=as_of), closed=gpus, closing_note="note")


def test_a_gpu_leaving_the_device_plugin_is_still_served_until_the_scheduler_no_longer_counts_it() -> None:
    everything = frozenset({"GPU-0", "GPU-1", "GPU-2", "GPU-3"})
    before = next_grants(desired("device-plugin"), None, {DP: closed(frozenset()), DRA: seen()}, now=0.0)
    want = desired("device-plugin", {"1": "dra"}, version="v2")
    step = next_grants(want, before, {DP: closed(frozenset(), as_of=10.0), DRA: seen()}, now=10.0)
    drain = step.draining["GPU-1"]
    assert drain.closing and drain.phase == "closing" and step.state_of("GPU-1") == "draining:device-plugin->dra"
    assert drain.waiting_for == "the scheduler still counts it on the Node (note)"
    # still the device plugin's to list and to allocate; DRA may not touch it
    assert step.granted_to("GPU-1", DP) and step.closing("GPU-1") and step.granted_to("MIG-0", DP)
    assert not step.granted_to("GPU-1", DRA) and not step.dra_may_prepare("GPU-1")
    assert step.counts()[DP] == 3  # not counted as the device plugin's any more
    # the Node no longer counts it: the plugin stops listing it, the drain proper begins
    gate = Observed(Usage(known=True, as_of=11.0), advertised=everything, closed=frozenset({"GPU-1"}))
    step = next_grants(want, step, {DP: gate, DRA: seen()}, now=11.0)
    drain = step.draining["GPU-1"]
    assert not drain.closing and drain.waiting_for == "device-plugin still advertises it"
    assert not step.granted_to("GPU-1", DP)
    # settled from the moment it was seen withdrawn, not from the drain's start
    step = next_grants(want, step, {DP: seen(as_of=11.2), DRA: seen()}, now=11.2)
    assert step.draining["GPU-1"].withdrawn == 11.2
    step = next_grants(want, step, {DP: seen(as_of=11.2 + SETTLE_S / 2), DRA: seen()}, now=11.5)
    assert step.draining["GPU-1"].waiting_for == "confirming that device-plugin no longer uses it"
    step = next_grants(want, step, {DP: seen(as_of=11.2 + SETTLE_S), DRA: seen()}, now=11.8)
    assert step.draining == {} and step.granted_to("GPU-1", DRA)


def test_going_back_while_closing_ends_the_drain_with_nothing_moved() -> None:
    before = next_grants(desired("device-plugin"), None, {DP: closed(frozenset()), DRA: seen()}, now=0.0)
    step = next_grants(desired("device-plugin", {"1": "none"}), before, {DP: closed(frozenset()), DRA: seen()}, now=1.0)
    assert step.draining["GPU-1"].closing
    back = next_grants(desired("device-plugin"), step, {DP: closed(frozenset()), DRA: seen()}, now=2.0)
    assert back.draining == {} and back.granted_to("GPU-1", DP)


def test_only_drains_away_from_the_device_plugin_close() -> None:
    """DRA's withdrawal is seen by the scheduler at once (it reads the slices); a drain derived at
    start never closes either: nothing of it was listed by this process."""
    before = next_grants(desired("dra"), None, {DP: closed(frozenset()), DRA: seen()}, now=0.0)
    step = next_grants(desired("dra", {"2": "none"}), before, {DP: closed(frozenset()), DRA: seen(as_of=1.0)}, now=1.0)
    assert not step.draining["GPU-2"].closing and not step.granted_to("GPU-2", DRA)
    start = next_grants(
        desired("dra"), None, {DP: Observed(Usage(known=False), closed=frozenset()), DRA: seen()}, now=0.0
    )
    assert start.draining["GPU-0"].derived and not start.draining["GPU-0"].closing


def test_a_claim_on_a_gpu_draining_away_from_dra_may_still_be_prepared() -> None:
    """The scheduler allocated from a slice that still listed it: the kubelet's Prepare is honoured
    (nobody else has the GPU), and the drain then waits for that claim."""
    before = next_grants(desired("dra"), None, {DP: seen(), DRA: seen()}, now=0.0)
    step = next_grants(desired("dra", {"1": "device-plugin"}), before, {DP: seen(), DRA: seen(as_of=1.0)}, now=1.0)
    assert step.state_of("GPU-1") == "draining:dra->device-plugin"
    assert step.dra_may_prepare("GPU-1") and step.dra_may_prepare("GPU-0")
    assert not step.granted_to("GPU-1", DP)
    done = next_grants(desired("dra", {"1": "device-plugin"}), step, {DP: seen(), DRA: seen(as_of=9.0)}, now=9.0)
    assert done.granted_to("GPU-1", DP) and not done.dra_may_prepare("GPU-1")


def test_no_gpu_goes_to_dra_while_the_record_on_disk_may_give_it_to_the_device_plugin() -> None:
    before = next_grants(desired("device-plugin"), None, {DP: seen(), DRA: seen()}, now=0.0)
    want = desired("device-plugin", {"1": "dra"}, version="v2")
    on_disk = frozenset({"GPU-0", "GPU-1", "GPU-2", "GPU-3"})
    step = next_grants(want, before, {DP: seen(as_of=5.0), DRA: seen()}, now=5.0, recorded=on_disk)
    step = next_grants(want, step, {DP: seen(as_of=9.0), DRA: seen()}, now=9.0, recorded=on_disk)
    assert step.draining["GPU-1"].waiting_for == "the record of grants on disk still gives it to device-plugin"
    step = next_grants(want, step, {DP: seen(as_of=9.5), DRA: seen()}, now=9.5, recorded=on_disk - {"GPU-1"})
    assert step.granted_to("GPU-1", DRA)
    # at start too: a GPU the record names is not granted to DRA before the record drops it
    start = next_grants(want, None, {DP: seen(), DRA: seen()}, now=0.0, recorded=on_disk)
    assert start.state_of("GPU-1") == "draining:device-plugin->dra" and start.granted_to("GPU-0", DP)


def test_grants_from_the_record_need_nobody_asked_and_are_continued() -> None:
    """After a restart, a GPU the record gives the device plugin that the config still gives it is
    granted before PodResources answered or the slices were listed; the handover keeps it there
    while DRA, not listed yet, may "advertise" every GPU."""
    want = desired("device-plugin", {"3": "dra"})
    seed = seed_grants(want, frozenset({"GPU-0", "GPU-1", "GPU-3"}))
    assert granted_gpus(seed, DP) == {"GPU-0", "GPU-1"} and seed.granted_to("MIG-0", DP) is False
    assert not covers_device_plugin(seed, want)
    assert covers_device_plugin(seed_grants(want, frozenset({"GPU-0", "GPU-1", "GPU-2"})), want)
    everything = frozenset({"GPU-0", "GPU-1", "GPU-2", "GPU-3"})
    doubt = {DP: seen(known=False), DRA: seen(advertised=everything)}
    step = next_grants(want, seed, doubt, now=0.0)
    assert granted_gpus(step, DP) == {"GPU-0", "GPU-1"}
    assert step.state_of("GPU-2") == "draining:dra->device-plugin"  # not in the record: derived


def test_the_record_keeps_the_device_plugin_grants(tmp_path: Path) -> None:
    keeper = RecordKeeper(GrantRecord(tmp_path), on_disk=frozenset())
    clock = [0.0]
    observed = {DP: seen(as_of=0.0), DRA: seen()}
    state = OwnershipState()
    handover = Handover(
        ownership=state,
        observe={owner: (lambda owner=owner: observed[owner]) for owner in (DP, DRA)},  # type: ignore[misc]
        clock=lambda: clock[0],
        record=keeper,
    )
    handover.set_desired(desired("device-plugin", {"1": "dra"}))
    assert keeper.pending() and keeper.maybe_on_disk == {"GPU-0", "GPU-2", "GPU-3"}
    asyncio.run(keeper.flush())
    assert GrantRecord(tmp_path).load() == {"GPU-0", "GPU-2", "GPU-3"} and not keeper.pending()
    handover.set_desired(desired("dra"))
    assert keeper.maybe_on_disk == {"GPU-0", "GPU-2", "GPU-3"}  # the old set until the write is done
    observed[DP] = seen(as_of=10.0)
    clock[0] = 10.0
    handover.evaluate()
    assert granted_gpus(state.current, DRA) == {"GPU-1"}, "GPUs the file may list wait for the write"
    asyncio.run(keeper.flush())
    handover.evaluate()
    assert granted_gpus(state.current, DRA) == {"GPU-0", "GPU-1", "GPU-2", "GPU-3"}
    assert GrantRecord(tmp_path).load() == frozenset()


def test_the_first_grants_are_decided_once_nothing_for_the_device_plugin_waits_on_a_doubt() -> None:
    """The first ListAndWatch answer waits for this. A GPU a prepared claim holds is known not to be
    coming (it does not hold the answer back); one whose holder is not known yet is a doubt."""
    state = OwnershipState()
    observed = {DP: seen(known=False), DRA: seen(known=False, reason="checkpoint not read")}
    handover = Handover(
        ownership=state,
        observe={o: (lambda o=o: observed[o]) for o in (DP, DRA)},  # type: ignore[misc]
        clock=lambda: 0.0,
    )
    handover.set_desired(desired("device-plugin"))
    assert not state.decided.is_set()
    claim = Holder(kind="claim", namespace="ml", name="c", uid="u")
    observed[DRA] = seen({"GPU-2": (claim,)})
    handover.evaluate()
    assert state.decided.is_set() and state.current.draining["GPU-2"].held
    assert granted_gpus(state.current, DP) == {"GPU-0", "GPU-1", "GPU-3"}
