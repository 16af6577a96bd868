"""Orphaned allocations: devices still held for a pod or a claim that is gone.

Three kinds, found every ``orphans.interval_s`` from what the mechanisms say they hold
(:meth:`~agent.core.mechanism.Mechanism.usage`: the kubelet's PodResources, the DRA checkpoint)
and what the API server says still exists:

* ``device-plugin-pod``: the kubelet's PodResources still lists containers of a pod that the API
  server does not have. PodResources gives no pod UID, so a pod re-created under the same name (a
  StatefulSet's) counts as present.
* ``dra-claim``: a prepared claim whose ResourceClaim is gone (or re-created with another UID),
  or whose ``reservedFor`` pods are all gone, or which no pod reserves any more.
* ``cdi-claim-spec``: a CDI claim spec file with no claim behind it in the DRA checkpoint (nor
  in preparation). The CDI reconciler removes such files at its next pass (it keeps exactly
  the specs of prepared claims), so this check never deletes one itself: it reports a file that
  outlives two checks, which means the reconciler cannot remove it. The usual quick cleanups
  are counted in ``gpu_agent_cdi_repairs_total{action="deleted"}``.

What the API server has is *pushed*, not polled (one agent runs on every node, so a poll is
multiplied by the fleet): whether a pod exists comes from the watch of this node's pods
(``agent/kube/pods.py``), which costs no request per check. The API is asked only when something
changed, and then once:

* a pod the watch no longer has is read once (a GET of its metadata) when a second check still
  misses it, before it is called gone: the watch is the trigger, the read the confirmation;
* a ResourceClaim is read once when it is first held (for its UID and ``reservedFor``), and once
  more when every pod it is reserved for has gone (it may be reserved for a new pod by now); an
  answer that says the claim is gone or unreserved is read once more at the next check to confirm;
* while the watch cannot answer (the API server is unreachable, the stream has gone silent),
  nothing is called gone and nothing is read: a read would fail too, or add to the load of an API
  server that is coming back up; what was seen before is neither confirmed nor forgotten.

A kind is reported only when two checks in a row agree (the kubelet, the checkpoint and the
API server change a moment apart): then it is logged once, raised as one Warning Event on the
Node, counted, and listed on ``/debug/state``; when it goes away that is logged too. So an orphan
is reported within two intervals of appearing. Nothing a mechanism holds is released here: a
device-plugin allocation is the kubelet's (only its pod's end frees it), and unpreparing a claim
behind the kubelet's back could hand a GPU that a container still uses to another claim. Those
are for an operator to look at.

A ResourceClaim cannot be deleted while pods are reserved on it (the scheduler puts Kubernetes'
``resource.kubernetes.io/delete-protection`` finalizer on every allocated claim, and it comes off
only once the claim is deallocated), so a claim is not re-read while its pods exist: its going
away follows theirs, which the pod watch sees. Only someone removing that finalizer by hand while
a pod still runs on the claim goes unseen until the pod ends.

Bounds: at most ``orphans.max_lookups`` API reads per check (confirmations first, then claims
never read, then claims whose last read failed, each after a backoff that doubles from one
interval to ten minutes); state is kept only for what is held now.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.base.errors import AgentError
from agent.core.config.current import ConfigState
from agent.core.eventsink import EventSink
from agent.core.mechanism import Mechanism
from agent.kube.claims.model import ClaimRef, ClaimSource, ResourceClaim
from agent.kube.pods import PodLookup, PodState

log = structlog.get_logger("agent.orphans")

#: orphans listed on /debug/state (all are counted)
MAX_LISTED = 100
#: checks in a row that must agree before something is called an orphan
CONFIRMATIONS = 2
#: the longest wait before a claim whose reads failed is read again
MAX_RETRY_S = 600.0


class OrphanKind(StrEnum):
    POD = "device-plugin-pod"
    CLAIM = "dra-claim"
    CDI_SPEC = "cdi-claim-spec"


@dataclass(frozen=True, slots=True)
class Orphan:
    kind: OrphanKind
    namespace: str
    name: str
    uid: str
    #: physical GPUs it holds
    gpus: tuple[str, ...]
    reason: str

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.kind.value, self.namespace, self.name, self.uid)

    def describe(self) -> str:
        on = f" (GPU {', '.join(self.gpus)})" if self.gpus else ""
        if self.kind is OrphanKind.POD:
            return f"pod {self.namespace}/{self.name} still holds devices through the device plugin{on}: {self.reason}"
        if self.kind is OrphanKind.CLAIM:
            return f"claim {self.namespace}/{self.name} ({self.uid}) is still prepared on this node{on}: {self.reason}"
        return f"CDI claim spec of claim {self.uid}: {self.reason}"

    def as_dict(self, since: str) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
            "gpus": list(self.gpus),
            "reason": self.reason,
            "since": since,
            "action": "the CDI reconciler removes it" if self.kind is OrphanKind.CDI_SPEC else "reported",
        }


@dataclass(slots=True)
class _PodSeen:
    """What the checks know of one pod: the watch's answers, and the reads that confirm them."""

    uid: str = ""
    #: checks in a row that found the pod missing (from the watch or a read)
    absent: int = 0
    #: a read during this absence answered 404
    confirmed: bool = False
    #: when it was last read (0: never)
    asked_at: float = 0.0


@dataclass(slots=True)
class _ClaimSeen:
    """The newest API answer about one held claim, and how many reads in a row call it gone."""

    state: PodState
    at: float
    uid: str = ""
    reason: str = ""
    #: answers in a row that say gone, re-created, or reserved for no pod
    suspect: int = 0
    #: (pod name, pod UID) from ``reservedFor``
    reserved_for: tuple[tuple[str, str], ...] = ()
    #: the reservation already read again because every pod in it had gone
    refreshed_for: tuple[tuple[str, str], ...] = ()
    #: reads in a row that failed, and when the next may be made
    failures: int = 0
    retry_at: float = 0.0

    @property
    def unreserved(self) -> bool:
        return self.state is PodState.PRESENT and not self.reserved_for


#: what a planned read is about: ("pod", namespace, name, "") or ("claim", namespace, name, uid)
Subject = tuple[str, str, str, str]


class ClaimSpecListing(Protocol):
    """The CDI claim specs on disk, as the root hands them in (``agent.cdi.names.ClaimSpecDirectory``)."""

    @property
    def where(self) -> str:
        """Where they are, for messages."""
        ...

    def uids(self) -> frozenset[str]:
        """Claim UIDs that have a spec file; blocking (called in a worker thread), never raises."""
        ...


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class OrphanDetector:
    def __init__(
        self,
        *,
        mechanisms: Mapping[str, Mechanism],
        pods: PodLookup,
        claims: ClaimSource,
        config: ConfigState,
        claim_specs: ClaimSpecListing | None = None,
        events: EventSink | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], str] = _utc_now,
    ) -> None:
        self._mechanisms = mechanisms
        self._pods = pods
        self._claims = claims
        self._config = config
        self._claim_specs = claim_specs
        self._events = events
        self._clock = clock
        self._wall = wall
        self._pod_seen: dict[tuple[str, str], _PodSeen] = {}
        self._claim_seen: dict[ClaimRef, _ClaimSeen] = {}
        self._spec_streaks: dict[str, int] = {}
        self._orphans: dict[tuple[str, str, str, str], Orphan] = {}
        self._since: dict[tuple[str, str, str, str], str] = {}
        self.checks = 0
        self.lookups = 0
        self.last_error = ""
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._gauge = Gauge(
            "gpu_agent_orphans",
            "Orphaned allocations now: devices held for a pod or claim that is gone, and CDI claim specs "
            "without a prepared claim",
            ["kind"],
            registry=registry,
        )
        self._found = Counter(
            "gpu_agent_orphans_found", "Orphaned allocations found since start, by kind", ["kind"], registry=registry
        )
        self._lookup_counter = Counter(
            "gpu_agent_orphan_lookups",
            "API reads made to find orphans, by subject and answer",
            ["subject", "answer"],
            registry=registry,
        )
        for kind in OrphanKind:
            self._gauge.labels(kind=kind.value).set(0)
            self._found.labels(kind=kind.value)
        for subject in ("pod", "claim"):
            for state in PodState:
                self._lookup_counter.labels(subject=subject, answer=state.value)

    # --- reading ----------------------------------------------------------------------------

    @property
    def orphans(self) -> list[Orphan]:
        return list(self._orphans.values())

    def pod_uid(self, namespace: str, name: str) -> str:
        """The UID of a pod the API server has ("" when unknown; PodResources does not say)."""
        answer = self._pods.state(namespace, name)
        if answer.state is PodState.PRESENT:
            return answer.uid
        seen = self._pod_seen.get((namespace, name))
        return seen.uid if seen is not None and not seen.absent else ""

    def claim_pods(self, namespace: str, name: str, uid: str) -> tuple[tuple[str, str], ...]:
        """(pod name, pod UID) a held claim is reserved for, as last read (empty until read)."""
        seen = self._claim_seen.get(ClaimRef(namespace, name, uid))
        return seen.reserved_for if seen is not None and seen.state is PodState.PRESENT else ()

    def debug_state(self) -> dict[str, object]:
        listed = [o.as_dict(self._since.get(o.key, "")) for o in list(self._orphans.values())[:MAX_LISTED]]
        counts = {kind.value: 0 for kind in OrphanKind}
        for orphan in self._orphans.values():
            counts[orphan.kind.value] += 1
        return {
            "enabled": self._config.config.orphans.enabled,
            "count": len(self._orphans),
            "by_kind": counts,
            "orphans": listed,
            "checks": self.checks,
            "lookups": self.lookups,
            "watched_subjects": len(self._pod_seen) + len(self._claim_seen),
            "pods": self._pods.debug_state(),
            "last_error": self.last_error or None,
        }

    # --- the loop -----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            config = self._config.config.orphans
            if config.enabled:
                await self.check()
            await asyncio.sleep(config.interval_s)

    async def check(self) -> None:
        """One check: look up what is held, then report what changed. Never raises."""
        self.checks += 1
        spec_uids = await self._spec_uids()
        # read after the listing: a claim prepared meanwhile has its spec and is in the usage
        pods, claims, claim_uids = self._held()
        await self._look_up(pods, claims)
        found: dict[tuple[str, str, str, str], Orphan] = {}
        for orphan in self._pod_orphans(pods) + self._claim_orphans(claims) + self._spec_orphans(spec_uids, claim_uids):
            found[orphan.key] = orphan
        self._report(found)

    def _held(self) -> tuple[dict[tuple[str, str], list[str]], dict[ClaimRef, list[str]], set[str]]:
        """(pod -> GPUs, claim -> GPUs, every claim UID held) from the mechanisms that know."""
        pods: dict[tuple[str, str], list[str]] = {}
        claims: dict[ClaimRef, list[str]] = {}
        claim_uids: set[str] = set()
        for mechanism in self._mechanisms.values():
            usage = mechanism.usage()
            if not usage.known:
                continue
            for gpu, holders in usage.holders.items():
                for h in holders:
                    if h.kind == "container":
                        pods.setdefault((h.namespace, h.name), []).append(gpu)
                    elif h.kind == "claim":
                        claim_uids.add(h.uid)
                        if h.namespace and h.name and h.uid:  # a claim rebuilt from its spec has no name
                            claims.setdefault(ClaimRef(h.namespace, h.name, h.uid), []).append(gpu)
        return pods, claims, claim_uids

    # --- what the API server has --------------------------------------------------------------

    async def _look_up(self, pods: Mapping[tuple[str, str], list[str]], claims: Mapping[ClaimRef, list[str]]) -> None:
        """Bring what is known of held pods and claims up to date: the pod watch, then the few reads due."""
        self.last_error = ""
        self._claim_seen = {ref: seen for ref, seen in self._claim_seen.items() if ref in claims}
        wanted = list(pods)
        for ref, claim in self._claim_seen.items():
            if claim.state is PodState.PRESENT:
                wanted += [(ref.namespace, pod) for pod, _ in claim.reserved_for]
        self._pod_seen = {key: self._pod_seen.get(key) or _PodSeen() for key in dict.fromkeys(wanted)}
        due: list[tuple[int, float, Subject]] = []
        for (namespace, name), pod in self._pod_seen.items():
            priority = self._watched(namespace, name, pod)
            if priority is not None:
                due.append((priority, pod.asked_at, ("pod", namespace, name, "")))
        for ref in claims:
            priority = self._claim_due(ref)
            if priority is not None:
                known = self._claim_seen.get(ref)
                due.append((priority, known.at if known else 0.0, ("claim", ref.namespace, ref.name, ref.uid)))
        chosen = [subject for _, _, subject in sorted(due)[: self._config.config.orphans.max_lookups]]
        await asyncio.gather(*(self._ask(subject) for subject in chosen))

    def _watched(self, namespace: str, name: str, seen: _PodSeen) -> int | None:
        """Apply the watch's answer about one pod; the priority of a read it calls for (None: none)."""
        answer = self._pods.state(namespace, name)
        if answer.state is PodState.PRESENT:
            seen.uid, seen.absent, seen.confirmed = answer.uid, 0, False
            return None
        if answer.state is PodState.GONE:
            seen.absent += 1
            # the second check that misses it reads it once: the watch is the trigger, the read the proof
            return 0 if seen.absent >= CONFIRMATIONS and not seen.confirmed else None
        # the watch cannot say (the API server is unreachable, the view is incomplete): nothing is
        # read either, since a read would fail too or land on a server that is coming back up
        self.last_error = answer.reason
        return None

    def _claim_due(self, ref: ClaimRef) -> int | None:
        """Whether a held claim is to be read at this check, and how urgently (None: not)."""
        seen = self._claim_seen.get(ref)
        if seen is None:
            return 1  # first held: its UID and reservedFor
        if seen.retry_at > self._clock():
            self.last_error = seen.reason  # the last read failed: not again before its backoff
            return None
        if seen.state is PodState.UNKNOWN:
            return 2
        if seen.state is PodState.GONE or seen.unreserved:
            return 0 if seen.suspect < CONFIRMATIONS else None
        if seen.reserved_for != seen.refreshed_for and self._all_missing(ref.namespace, seen.reserved_for):
            return 0  # every pod it was reserved for is gone: is it reserved for another by now?
        return None

    async def _ask(self, subject: Subject) -> None:
        self.lookups += 1
        kind, namespace, name, uid = subject
        now = self._clock()
        if kind == "pod":
            await self._ask_pod(namespace, name, now)
            return
        ref = ClaimRef(namespace, name, uid)
        try:
            claim = await self._claims.get_claim(ref)
        except AgentError as exc:  # KubeError, or the no-API source's refusal
            answer = _ClaimSeen(PodState.UNKNOWN, now, reason=str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a claim the API answers in a shape we cannot read
            answer = _ClaimSeen(PodState.UNKNOWN, now, reason=f"{type(exc).__name__}: {exc}")
        else:
            answer = self._claim_answer(claim, uid, now)
        self._lookup_counter.labels(subject="claim", answer=answer.state.value).inc()
        self._record_claim(ref, answer)

    async def _ask_pod(self, namespace: str, name: str, now: float) -> None:
        answer = await self._pods.lookup(namespace, name)
        self._lookup_counter.labels(subject="pod", answer=answer.state.value).inc()
        seen = self._pod_seen.get((namespace, name))
        if seen is None:
            return
        seen.asked_at = now
        if answer.state is PodState.PRESENT:
            seen.uid, seen.absent, seen.confirmed = answer.uid, 0, False
        elif answer.state is PodState.GONE:
            seen.confirmed = True
        else:
            self.last_error = answer.reason  # unknown neither confirms nor clears what was known

    @staticmethod
    def _claim_answer(claim: ResourceClaim | None, uid: str, now: float) -> _ClaimSeen:
        if claim is None:
            return _ClaimSeen(PodState.GONE, now, reason="the ResourceClaim is gone from the API server")
        if claim.uid != uid:
            return _ClaimSeen(PodState.GONE, now, reason=f"the ResourceClaim was re-created (now UID {claim.uid})")
        reserved = tuple((p.name, p.uid) for p in claim.reserved_for if p.resource == "pods")
        return _ClaimSeen(PodState.PRESENT, now, uid=claim.uid, reserved_for=reserved)

    def _record_claim(self, ref: ClaimRef, answer: _ClaimSeen) -> None:
        old = self._claim_seen.get(ref)
        if answer.state is PodState.UNKNOWN:
            self.last_error = answer.reason
            # a read that keeps failing (RBAC, an API server in trouble) is not repeated every check
            answer.failures = (old.failures if old is not None else 0) + 1
            interval = self._config.config.orphans.interval_s
            answer.retry_at = answer.at + min(MAX_RETRY_S, interval * 2 ** min(answer.failures - 1, 16))
            if old is not None and old.state is not PodState.UNKNOWN:
                # neither confirms nor clears what was known
                old.at, old.reason = answer.at, answer.reason
                old.failures, old.retry_at = answer.failures, answer.retry_at
                return
        if answer.state is PodState.GONE or answer.unreserved:
            answer.suspect = (old.suspect if old is not None else 0) + 1
            if old is not None and old.reserved_for and self._all_missing(ref.namespace, old.reserved_for):
                # read because its pods had gone, two checks running: this answer is the second agreement
                answer.suspect = max(answer.suspect, CONFIRMATIONS)
        if old is not None and answer.state is PodState.PRESENT and old.state is PodState.PRESENT:
            # read again because its pods had gone: not again for the same pods
            answer.refreshed_for = old.reserved_for if answer.reserved_for == old.reserved_for else ()
        self._claim_seen[ref] = answer

    # --- verdicts -----------------------------------------------------------------------------

    def _pod_missing(self, namespace: str, name: str, uid: str = "") -> bool:
        """Missing from the watch for two checks in a row, or present under another UID than ``uid``."""
        seen = self._pod_seen.get((namespace, name))
        if seen is None:
            return False
        if not seen.absent:
            return bool(uid and seen.uid and seen.uid != uid)
        return seen.absent >= CONFIRMATIONS

    def _all_missing(self, namespace: str, pods: tuple[tuple[str, str], ...]) -> bool:
        return bool(pods) and all(self._pod_missing(namespace, pod, uid) for pod, uid in pods)

    def _gone(self, namespace: str, name: str, uid: str = "") -> bool:
        """A pod confirmed gone (missing twice, and a read said 404), or present under another UID."""
        seen = self._pod_seen.get((namespace, name))
        if seen is None:
            return False
        if not seen.absent:
            return bool(uid and seen.uid and seen.uid != uid)
        return seen.absent >= CONFIRMATIONS and seen.confirmed

    def _pod_orphans(self, pods: Mapping[tuple[str, str], list[str]]) -> list[Orphan]:
        return [
            Orphan(
                OrphanKind.POD,
                ns,
                name,
                "",
                tuple(dict.fromkeys(gpus)),
                "the API server has no such pod, but the kubelet's PodResources still lists it",
            )
            for (ns, name), gpus in pods.items()
            if self._gone(ns, name)
        ]

    def _claim_orphans(self, claims: Mapping[ClaimRef, list[str]]) -> list[Orphan]:
        out: list[Orphan] = []
        for ref, gpus in claims.items():
            seen = self._claim_seen.get(ref)
            if seen is None or seen.state is PodState.UNKNOWN:
                continue
            reason = ""
            if seen.state is PodState.GONE and seen.suspect >= CONFIRMATIONS:
                reason = f"{seen.reason}; the kubelet has not unprepared it"
            elif seen.unreserved and seen.suspect >= CONFIRMATIONS:
                reason = "no pod reserves the claim any more; the kubelet has not unprepared it"
            elif (
                seen.state is PodState.PRESENT
                and seen.reserved_for
                and seen.refreshed_for == seen.reserved_for
                and all(self._gone(ref.namespace, p, u) for p, u in seen.reserved_for)
            ):
                names = ", ".join(p for p, _ in seen.reserved_for[:3])
                reason = f"every pod it is reserved for is gone ({names}); the kubelet has not unprepared it"
            if reason:
                out.append(
                    Orphan(OrphanKind.CLAIM, ref.namespace, ref.name, ref.uid, tuple(dict.fromkeys(gpus)), reason)
                )
        return out

    def _spec_orphans(self, spec_uids: frozenset[str], claim_uids: set[str]) -> list[Orphan]:
        where = self._claim_specs.where if self._claim_specs is not None else ""
        streaks: dict[str, int] = {}
        for uid in spec_uids - claim_uids:
            streaks[uid] = self._spec_streaks.get(uid, 0) + 1
        self._spec_streaks = streaks
        return [
            Orphan(
                OrphanKind.CDI_SPEC,
                "",
                "",
                uid,
                (),
                f"no prepared claim in the DRA checkpoint, and still in {where} after {n} checks "
                "(the CDI reconciler removes such specs; see its last errors)",
            )
            for uid, n in sorted(streaks.items())
            if n >= CONFIRMATIONS
        ]

    async def _spec_uids(self) -> frozenset[str]:
        if self._claim_specs is None:
            return frozenset()
        return await asyncio.to_thread(self._claim_specs.uids)

    # --- reporting ----------------------------------------------------------------------------

    def _report(self, found: dict[tuple[str, str, str, str], Orphan]) -> None:
        for key, orphan in found.items():
            if key in self._orphans:
                continue
            self._since[key] = self._wall()
            self._found.labels(kind=orphan.kind.value).inc()
            log.warning("orphaned allocation", kind=orphan.kind.value, orphan=orphan.describe())
            if self._events is not None:
                self._events.warning("OrphanedAllocation", orphan.describe())
        for key, orphan in self._orphans.items():
            if key not in found:
                self._since.pop(key, None)
                log.info("orphaned allocation resolved", kind=orphan.kind.value, orphan=orphan.describe())
        self._orphans = found
        for kind in OrphanKind:
            self._gauge.labels(kind=kind.value).set(sum(1 for o in found.values() if o.kind is kind))
