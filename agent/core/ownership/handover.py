"""Live ownership handover: turn the desired owners into granted ones without touching a pod.

The config says which mechanism *should* own each GPU (the desired table, from
:func:`agent.core.ownership.table.compute_ownership`). A GPU is *granted* to that mechanism only once the
mechanism that had it no longer uses it; in between it drains:

* away from the device plugin it first *closes*: the plugin still lists it and answers Allocate
  until it reports that the scheduler no longer counts it on the Node (:class:`Observed`
  ``closed``; the plugin lowers the Node's counts itself), so no pod the scheduler placed on it
  meanwhile is turned away at admission;
* then the old owner stops advertising it (it reads the granted table: ListAndWatch drops it on
  the next send, the ResourceSlice in its next write), and it is granted to nobody;
* the drain completes when the old owner reports, in an observation made a settle after the GPU
  was seen withdrawn (an Allocate the kubelet had in flight; a claim the scheduler allocated from
  the slice before it changed), that nothing holds the GPU; then the new owner gets it;
* a mechanism that cannot tell (the kubelet's PodResources socket missing or failing, the DRA
  checkpoint not loaded yet, the node's pods not listed) means *unknown*, never idle: the drain
  waits and says why;
* changing the config back to the old owner ends the drain at once (nothing moved).

On start there is no previous grant to continue from but the grants phase 1 made from the
durable record (:mod:`agent.core.ownership.record`, :func:`seed_grants`): :func:`next_grants`
derives every other GPU from what each mechanism has in use (PodResources, the DRA checkpoint,
the slices) and the desired owners, so an agent killed in the middle of a drain continues it;
no GPU goes to DRA while the record on disk may still give it to the device plugin. The pure
decision is :func:`next_grants`; :class:`Handover` runs it whenever the desired table changes
and, while any drain is open, a few times a second, and keeps the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import structlog

from agent.core.config.schema import Owner
from agent.core.mechanism import Usage
from agent.core.ownership.record import RecordKeeper
from agent.core.ownership.table import Drain, OwnershipState, OwnershipTable

log = structlog.get_logger("agent.handover")

#: an observation must be this much younger than the moment the device plugin stopped listing the
#: GPU before it counts: covers an Allocate the kubelet had already sent
SETTLE_S = 0.5
#: the same for DRA, from the moment the slice without the GPU was written: covers the scheduler's
#: cycles that started before it saw that slice (their allocation is written in PreBind, then the
#: pod is bound) and the pod list that shows the bound pod
DRA_SETTLE_S = 2.0
#: how often open drains are re-checked
TICK_S = 0.25
#: holders named in a waiting reason (the rest are counted)
SHOWN_HOLDERS = 3

MECHANISMS = (Owner.DEVICE_PLUGIN, Owner.DRA)
_SETTLE = {Owner.DEVICE_PLUGIN: SETTLE_S, Owner.DRA: DRA_SETTLE_S}


@dataclass(frozen=True, slots=True)
class Observed:
    """What one mechanism reports right now: who uses which GPU, and what it advertises.

    ``closed`` is for a mechanism whose withdrawal the scheduler sees late (the device plugin:
    the Node's counts): the GPUs it still serves that the scheduler no longer counts on, so a
    closing drain may stop serving them. None: the scheduler sees its withdrawal at once.
    """

    usage: Usage
    advertised: frozenset[str] = frozenset()
    closed: frozenset[str] | None = None
    #: why closing GPUs are not closed yet (for ``waiting_for``)
    closing_note: str = ""


IDLE = Observed(Usage(known=True, as_of=float("inf")))


def seed_grants(desired: OwnershipTable, recorded: frozenset[str]) -> OwnershipTable:
    """The grants a starting agent can make before it has asked anyone: the GPUs the durable
    record says were the device plugin's, that the config still gives it.

    The record (:mod:`agent.core.ownership.record`) lists a GPU only while no other mechanism
    can have been granted it since, so such a GPU is neither in a ResourceSlice nor held through
    DRA. Every other GPU is left out of ``owners``: :func:`next_grants` derives it at start.
    """
    dp = Owner.DEVICE_PLUGIN
    owners: dict[str, Owner] = {gpu: dp for gpu in desired.gpus() if gpu in recorded and desired.owner_of(gpu) is dp}
    for mig, parent in desired.parents.items():
        if parent in owners:
            owners[mig] = owners[parent]
    return replace(desired, owners=owners, draining={})


def covers_device_plugin(seed: OwnershipTable, desired: OwnershipTable) -> bool:
    """Whether ``seed`` grants the device plugin every GPU the config gives it."""
    return all(
        seed.owners.get(gpu) is Owner.DEVICE_PLUGIN
        for gpu in desired.gpus()
        if desired.owner_of(gpu) is Owner.DEVICE_PLUGIN
    )


def next_grants(
    desired: OwnershipTable,
    previous: OwnershipTable | None,
    observed: Mapping[Owner, Observed],
    now: float,
    *,
    recorded: frozenset[str] = frozenset(),
) -> OwnershipTable:
    """The granted table that follows ``previous`` for ``desired`` and what the mechanisms report.

    ``previous`` is None on start (derive from usage), or holds only some GPUs (the grants made
    at start from the durable record: :func:`seed_grants`); a GPU it does not hold is derived.
    ``observed`` has an entry per mechanism; a mechanism that does not exist on this node reports
    :data:`IDLE`. ``recorded``: the GPUs the durable record may still list as the device
    plugin's; none of them is granted to DRA until the record drops it.
    """
    owners: dict[str, Owner] = {}
    draining: dict[str, Drain] = {}
    for gpu in desired.gpus():
        want = desired.owner_of(gpu)
        had = previous.owners.get(gpu) if previous is not None else None
        drain = previous.draining.get(gpu) if previous is not None else None
        if had is None:  # start-up, or a GPU that (re)appeared: whoever still holds it drains first
            holder = _first_holder(gpu, want, observed, unknown_blocks=True)
            drain = None if holder is None else Drain(source=holder, target=want, since=now, derived=True)
        elif drain is not None:
            if want is drain.source and drain.closing:
                drain = None  # the device plugin never stopped serving it: nothing moved
            elif want is drain.source and drain.derived:
                # a drain derived at start: its "source" was a doubt, not a grant, so this is a new
                # grant, and every other mechanism must be seen not to hold it a settle after it
                # stopped advertising it (a claim the scheduler allocated from an earlier run's
                # slice shows in DRA's look at the node's pods only then): drain from each in turn
                first = next((m for m in MECHANISMS if m is not want), None)
                drain = None if first is None else Drain(source=first, target=want, since=now, derived=True)
            elif want is drain.source:
                # back to the old owner, which never let go (nothing else had it meanwhile)
                holder = _first_holder(gpu, want, observed, unknown_blocks=False)
                drain = None if holder is None else Drain(source=holder, target=want, since=now)
            elif want is not drain.target:
                drain = replace(drain, target=want)
        elif had is Owner.NONE and want is not Owner.NONE:
            # granted to nobody, but a drain derived at start and retargeted to none completed
            # when its source let go: the other mechanism may still hold or advertise it
            holder = _first_holder(gpu, want, observed, unknown_blocks=False)
            drain = None if holder is None else Drain(source=holder, target=want, since=now)
        elif had is not want:
            # the device plugin keeps serving it until the scheduler no longer counts it
            drain = Drain(source=had, target=want, since=now, closing=had is Owner.DEVICE_PLUGIN)
        if drain is None and want is Owner.DRA and gpu in recorded:
            drain = Drain(source=Owner.DEVICE_PLUGIN, target=want, since=now, derived=True)
        if drain is not None:
            drain = _progress(gpu, drain, observed, now, recorded=recorded)
        if drain is None:
            owners[gpu] = want
        else:
            owners[gpu] = Owner.DEVICE_PLUGIN if drain.closing else Owner.NONE
            draining[gpu] = drain
    for mig, parent in desired.parents.items():
        owners[mig] = owners[parent]
    return replace(desired, owners=owners, draining=draining)


def _first_holder(gpu: str, want: Owner, observed: Mapping[Owner, Observed], *, unknown_blocks: bool) -> Owner | None:
    """Another mechanism that holds the GPU, advertises it (slices of an earlier run), or — with
    ``unknown_blocks`` — cannot tell whether it holds it: the GPU must drain from it first."""
    doubt = None
    for owner in MECHANISMS:
        if owner is want:
            continue
        seen = observed.get(owner, IDLE)
        if seen.usage.known and seen.usage.in_use(gpu):
            return owner
        if doubt is None and ((unknown_blocks and not seen.usage.known) or gpu in seen.advertised):
            doubt = owner
    return doubt


def _progress(
    gpu: str, drain: Drain, observed: Mapping[Owner, Observed], now: float, *, recorded: frozenset[str]
) -> Drain | None:
    """The drain after this observation: still closing, waiting (and why), or done (None).

    A drain derived at start waits on its source, then on every later mechanism that is not its
    target, in turn (its source becomes the one it waits on): at start any mechanism may hold or
    advertise the GPU (an earlier run's slices, a claim the scheduler allocated from them).
    """
    if drain.source is Owner.NONE:
        return None
    source = observed.get(drain.source, IDLE)
    name = drain.source.value
    if drain.closing:
        if source.closed is not None and gpu not in source.closed:
            note = source.closing_note or "the Node's counts are not lowered yet"
            return replace(drain, waiting_for=f"the scheduler still counts it on the Node ({note})")
        drain = replace(drain, closing=False)
    if gpu in source.advertised:
        return replace(drain, withdrawn=None, waiting_for=f"{name} still advertises it", held=False)
    if drain.withdrawn is None:
        drain = replace(drain, withdrawn=now)
    waiting = _waiting_for(gpu, drain, source)
    if waiting:
        held = source.usage.known and source.usage.in_use(gpu)
        return replace(drain, waiting_for=waiting, held=held)
    if drain.derived:
        later = MECHANISMS[MECHANISMS.index(drain.source) + 1 :] if drain.source in MECHANISMS else ()
        following = next((m for m in later if m is not drain.target), None)
        if following is not None:
            moved = replace(drain, source=following, withdrawn=None)
            return _progress(gpu, moved, observed, now, recorded=recorded)
    if drain.target is Owner.DRA and gpu in recorded:
        return replace(drain, waiting_for="the record of grants on disk still gives it to device-plugin")
    return None


def _waiting_for(gpu: str, drain: Drain, source: Observed) -> str:
    """Why a withdrawn drain cannot complete yet: holders, or no recent enough observation; ""."""
    name = drain.source.value
    usage = source.usage
    if not usage.known:
        return f"{name} cannot tell who uses it: {usage.reason or 'no answer yet'}"
    holders = usage.holders.get(gpu, ())
    if holders:
        shown = ", ".join(f"{h.namespace}/{h.name}" for h in holders[:SHOWN_HOLDERS])
        more = f" and {len(holders) - SHOWN_HOLDERS} more" if len(holders) > SHOWN_HOLDERS else ""
        kind = "claim" if holders[0].kind == "claim" else "pod"
        return f"in use through {name} by {kind} {shown}{more}"
    assert drain.withdrawn is not None
    if usage.as_of < drain.withdrawn + _SETTLE.get(drain.source, SETTLE_S):
        return f"confirming that {name} no longer uses it"
    return ""


class HandoverListener(Protocol):
    """Told about drains as they start, complete, or wait too long (Events, metrics)."""

    def started(self, gpu: str, drain: Drain) -> None: ...

    def completed(self, gpu: str, source: Owner, target: Owner, waited_s: float) -> None: ...

    def waiting_long(self, gpu: str, drain: Drain, waited_s: float) -> None: ...

    def index_moved(self, key: str, old_uuid: str, new_uuid: str) -> None: ...


class Handover:
    """Keeps the granted table in step with the desired one; the only writer of grants."""

    def __init__(
        self,
        *,
        ownership: OwnershipState,
        observe: Mapping[Owner, Callable[[], Observed]],
        listener: HandoverListener | None = None,
        long_wait_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = TICK_S,
        record: RecordKeeper | None = None,
        resume: OwnershipTable | None = None,
    ) -> None:
        """``record`` keeps the durable record of the device plugin's grants (none: no record);
        ``resume`` is the grants made at start from it (:func:`seed_grants`), continued here."""
        self._ownership = ownership
        self.record = record
        self._observe = dict(observe)
        self._listener = listener
        self._long_wait_s = long_wait_s
        self._clock = clock
        self._tick_s = tick_s
        self._desired: OwnershipTable | None = None
        self._granted: OwnershipTable | None = resume
        self._warned: set[tuple[str, float]] = set()
        #: index override key -> the GPU it named last time
        self._index_targets: dict[str, str] = {}
        self._kick = asyncio.Event()
        self.completed = 0
        self.started = 0

    @property
    def desired(self) -> OwnershipTable | None:
        return self._desired

    def set_long_wait(self, seconds: float) -> None:
        self._long_wait_s = seconds

    def set_desired(self, desired: OwnershipTable) -> None:
        """A new desired table (config, inventory or labels changed): grant what can be granted now."""
        self._check_index_overrides(desired)
        for warning in desired.inert_overrides:
            if self._desired is None or warning not in self._desired.inert_overrides:
                log.warning("ownership override is inert", detail=warning)
        self._desired = desired
        self.evaluate()
        self._kick.set()

    def observations(self) -> dict[Owner, Observed]:
        return {owner: observe() for owner, observe in self._observe.items()}

    def evaluate(self) -> OwnershipTable | None:
        """Recompute the grants from the latest observations; publish when they change."""
        if self._desired is None:
            return None
        now = self._clock()
        recorded = self.record.maybe_on_disk if self.record is not None else frozenset()
        granted = next_grants(self._desired, self._granted, self.observations(), now, recorded=recorded)
        self._report(self._granted, granted, now)
        self._granted = granted
        # this start's grants are known once nothing the device plugin should have waits on a doubt
        # (an answer, a listing); a GPU another mechanism's users hold is known not to be coming
        decided = not any(
            d.derived and d.target is Owner.DEVICE_PLUGIN and not d.held for d in granted.draining.values()
        )
        if self._ownership.update(granted, self._desired, decided=decided):
            self._kick.set()  # look again at once: the mechanisms act on the new grants now
        if self.record is not None:
            gpus = granted.gpus()
            self.record.want(frozenset(g for g in gpus if granted.owners[g] is Owner.DEVICE_PLUGIN), gpus)
        return granted

    async def run(self) -> None:
        """Re-check open drains a few times a second, and at once after a desired change or a
        change of grants; keep the durable record in step between evaluations."""
        while True:
            self._kick.clear()
            self.evaluate()
            if self.record is not None and self.record.pending():
                await self.record.flush()
                if not self.record.last_error:
                    continue
            timeout = self._tick_s if self._granted is None or self._granted.draining else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._kick.wait()

    # --- reporting -------------------------------------------------------------------

    def _report(self, before: OwnershipTable | None, after: OwnershipTable, now: float) -> None:
        old = before.draining if before is not None else {}
        for gpu, drain in after.draining.items():
            if gpu not in old or old[gpu].target is not drain.target:
                self.started += 1
                log.info(
                    "handover started",
                    gpu=gpu,
                    source=drain.source.value,
                    target=drain.target.value,
                    waiting_for=drain.waiting_for,
                )
                if self._listener is not None:
                    self._listener.started(gpu, drain)
            waited = now - drain.since
            if waited >= self._long_wait_s and (gpu, drain.since) not in self._warned:
                self._warned.add((gpu, drain.since))
                log.warning(
                    "handover waiting",
                    gpu=gpu,
                    source=drain.source.value,
                    target=drain.target.value,
                    waited_s=round(waited, 1),
                    waiting_for=drain.waiting_for,
                )
                if self._listener is not None:
                    self._listener.waiting_long(gpu, drain, waited)
        for gpu, drain in old.items():
            if gpu in after.draining:
                continue
            self._warned = {w for w in self._warned if w[0] != gpu}
            target = after.owners.get(gpu)
            if target is None:
                log.warning("GPU vanished while draining", gpu=gpu, source=drain.source.value)
                continue
            waited = now - drain.since
            self.completed += 1
            log.info(
                "handover completed" if target is drain.target else "handover cancelled",
                gpu=gpu,
                source=drain.source.value,
                owner=target.value,
                waited_s=round(waited, 3),
            )
            if self._listener is not None:
                self._listener.completed(gpu, drain.source, target, waited)

    def _check_index_overrides(self, desired: OwnershipTable) -> None:
        """An override by index now naming another GPU (NVML renumbers when one falls off the bus)."""
        targets = desired.index_overrides
        for rule, gpu in targets.items():
            old = self._index_targets.get(rule)
            if old is not None and old != gpu:
                log.warning(
                    "an index override now names another GPU; running pods stay protected by the drain",
                    rule=rule,
                    old_gpu=old,
                    new_gpu=gpu,
                )
                if self._listener is not None:
                    self._listener.index_moved(rule, old, gpu)
        self._index_targets.update(targets)
