"""Orphaned allocations: devices still held for a pod or a claim that is gone.

Three kinds, found every ``orphans.interval_s`` from what the mechanisms say they hold
(:meth:`~agent.core.mechanism.Mechanism.usage`) and what the API server says still exists:

* ``device-plugin-pod``: the kubelet's PodResources still lists containers of a pod that the API
  server does not have (404). Only pods PodResources lists are looked up. PodResources gives no
  pod UID, so a pod re-created under the same name (a StatefulSet's) counts as present.
* ``dra-claim``: a prepared claim whose ResourceClaim is gone (404, or re-created with another
  UID), or whose ``reservedFor`` pods are all gone, or which no pod reserves any more.
* ``cdi-claim-spec``: a CDI claim spec file with no claim behind it in the DRA checkpoint (nor
  in preparation). The CDI reconciler removes such files at its next pass (it keeps exactly
  the specs of prepared claims), so this check never deletes one itself: it reports a file that
  outlives two checks, which means the reconciler cannot remove it. The usual quick cleanups
  are counted in ``gpu_agent_cdi_repairs_total{action="deleted"}``.

A kind is reported only when two checks in a row agree (the kubelet, the checkpoint and the
API server change a moment apart): then it is logged once, raised as one Warning Event on the
Node, counted, and listed on ``/debug/state``; when it goes away that is logged too. Nothing a
mechanism holds is released here: a device-plugin allocation is the kubelet's (only its pod's
end frees it), and unpreparing a claim behind the kubelet's back could hand a GPU that a
container still uses to another claim. Those are for an operator to look at.

Bounds: at most ``orphans.max_lookups`` API reads per check (pods never asked about first, then
answers to confirm, then the oldest); state is kept only for what is held now.
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

#: (kind, namespace, name, uid): what one answer is about
Subject = tuple[str, str, str, str]


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
class _Answer:
    """The newest API answer about one subject, and how many checks in a row called it gone."""

    state: PodState
    at: float
    uid: str = ""
    reason: str = ""
    gone_streak: int = 0
    #: a claim's reservedFor (pod name, pod UID)
    reserved_for: tuple[tuple[str, str], ...] = ()
    unreserved_streak: int = 0


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
        self._answers: dict[Subject, _Answer] = {}
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
        """The UID of a pod the check has seen (""; PodResources does not say)."""
        answer = self._answers.get(("pod", namespace, name, ""))
        return answer.uid if answer is not None else ""

    def claim_pods(self, namespace: str, name: str, uid: str) -> tuple[tuple[str, str], ...]:
        """(pod name, pod UID) a held claim is reserved for, as last read (empty until read)."""
        answer = self._answers.get(("claim", namespace, name, uid))
        return answer.reserved_for if answer is not None and answer.state is PodState.PRESENT else ()

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
            "watched_subjects": len(self._answers),
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

    # --- lookups ------------------------------------------------------------------------------

    async def _look_up(self, pods: Mapping[tuple[str, str], list[str]], claims: Mapping[ClaimRef, list[str]]) -> None:
        wanted: list[Subject] = [("pod", ns, name, "") for ns, name in pods]
        wanted += [("claim", ref.namespace, ref.name, ref.uid) for ref in claims]
        for ref in claims:
            answer = self._answers.get(("claim", ref.namespace, ref.name, ref.uid))
            if answer is not None and answer.state is PodState.PRESENT:
                wanted += [("pod", ref.namespace, pod, "") for pod, _ in answer.reserved_for]
        wanted = list(dict.fromkeys(wanted))
        for stale in set(self._answers) - set(wanted):
            del self._answers[stale]
        budget = self._config.config.orphans.max_lookups
        chosen = sorted(wanted, key=self._priority)[:budget]
        self.last_error = ""
        refs = {("claim", r.namespace, r.name, r.uid): r for r in claims}
        results = await asyncio.gather(*(self._ask(subject, refs.get(subject)) for subject in chosen))
        for subject, answer in zip(chosen, results, strict=True):
            self._record(subject, answer)

    def _priority(self, subject: Subject) -> tuple[int, float]:
        """Never asked first, then answers to confirm, then unknown ones, then the oldest."""
        answer = self._answers.get(subject)
        if answer is None:
            return (0, 0.0)
        if answer.state is PodState.GONE or answer.unreserved_streak:
            return (1, answer.at)
        if answer.state is PodState.UNKNOWN:
            return (2, answer.at)
        return (3, answer.at)

    async def _ask(self, subject: Subject, ref: ClaimRef | None) -> _Answer:
        self.lookups += 1
        kind, namespace, name, uid = subject
        now = self._clock()
        if kind == "pod":
            pod = await self._pods.lookup(namespace, name)
            self._lookup_counter.labels(subject="pod", answer=pod.state.value).inc()
            return _Answer(pod.state, now, uid=pod.uid, reason=pod.reason)
        assert ref is not None
        try:
            claim = await self._claims.get_claim(ref)
        except AgentError as exc:  # KubeError, or the no-API source's refusal
            answer = _Answer(PodState.UNKNOWN, now, reason=str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a claim the API answers in a shape we cannot read
            answer = _Answer(PodState.UNKNOWN, now, reason=f"{type(exc).__name__}: {exc}")
        else:
            answer = self._claim_answer(claim, uid, now)
        self._lookup_counter.labels(subject="claim", answer=answer.state.value).inc()
        return answer

    @staticmethod
    def _claim_answer(claim: ResourceClaim | None, uid: str, now: float) -> _Answer:
        if claim is None:
            return _Answer(PodState.GONE, now, reason="the ResourceClaim is gone from the API server")
        if claim.uid != uid:
            return _Answer(PodState.GONE, now, reason=f"the ResourceClaim was re-created (now UID {claim.uid})")
        reserved = tuple((p.name, p.uid) for p in claim.reserved_for if p.resource == "pods")
        return _Answer(PodState.PRESENT, now, uid=claim.uid, reserved_for=reserved)

    def _record(self, subject: Subject, answer: _Answer) -> None:
        old = self._answers.get(subject)
        gone = answer.state is PodState.GONE
        if answer.state is PodState.UNKNOWN:
            self.last_error = answer.reason
            if old is not None:  # unknown neither confirms nor clears what was known
                old.at, old.reason = answer.at, answer.reason
                return
        answer.gone_streak = (old.gone_streak if old is not None else 0) + 1 if gone else 0
        unreserved = answer.state is PodState.PRESENT and subject[0] == "claim" and not answer.reserved_for
        answer.unreserved_streak = (old.unreserved_streak if old is not None else 0) + 1 if unreserved else 0
        self._answers[subject] = answer

    # --- verdicts -----------------------------------------------------------------------------

    def _gone(self, namespace: str, name: str, uid: str = "") -> bool:
        """A pod confirmed gone, or present under another UID than the one a claim names."""
        answer = self._answers.get(("pod", namespace, name, ""))
        if answer is None:
            return False
        if answer.state is PodState.PRESENT:
            return bool(uid and answer.uid and answer.uid != uid)
        return answer.gone_streak >= CONFIRMATIONS

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
            answer = self._answers.get(("claim", ref.namespace, ref.name, ref.uid))
            if answer is None or answer.state is PodState.UNKNOWN:
                continue
            reason = ""
            if answer.state is PodState.GONE and answer.gone_streak >= CONFIRMATIONS:
                reason = f"{answer.reason}; the kubelet has not unprepared it"
            elif answer.state is PodState.PRESENT and answer.unreserved_streak >= CONFIRMATIONS:
                reason = "no pod reserves the claim any more; the kubelet has not unprepared it"
            elif answer.reserved_for and all(self._gone(ref.namespace, p, u) for p, u in answer.reserved_for):
                names = ", ".join(p for p, _ in answer.reserved_for[:3])
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
