"""What one device-plugin server does next, decided from what it observes; pure.

:class:`~agent.deviceplugin.server.PluginServer` builds an :class:`Observation` whenever it wakes (a
filesystem event batch, a rescan, a stream that opened or ended — each only a hint, settled
first) or a timer of its own fires, asks :func:`decide`, and takes the one :class:`Step`:

========================================================  ===========================
observed                                                  step
========================================================  ===========================
not serving, within a repair's pause                      WAIT
not serving                                               START (serve, Register)
the watchdog asked for a repair                           STOP, then a pause, then START
the kubelet holds a ListAndWatch stream of this run       IDLE: registered
our socket file is gone or replaced                       RESTART (stop, serve, Register)
Register accepted, the stream not open yet, within bound  WAIT for the stream
a retry is not due yet (backoff after a failure)          WAIT
otherwise: never accepted / the kubelet ended our         REGISTER
stream / no stream within the bound
========================================================  ===========================

Why this gives one registration per kubelet start: a kubelet restart always ends our stream
(the old process dies) and removes our socket, and the new kubelet's ``kubelet.sock`` comes
after; however those arrive, the server registers once with whichever kubelet answers and then
stays IDLE while that kubelet holds the stream. It never registers while the kubelet holds a
stream of ours, so never while the kubelet may still be ending an older one — the race in which
a real kubelet dropped the new connection. IDLE wins over a missing socket file: the kubelet
only dials the socket inside Register, and the restart that needs a new file ends the stream
first.

A watchdog repair (``agent/observe/watchdog.py``: the kubelet's allocatable devices or the Node's status
disagree with what this server lists, for longer than the kubelet needs to catch up) outranks
IDLE: the kubelet may hold a stream of ours and still count the wrong devices. The run stops
(our streams end) and the server pauses before it serves and registers again: the kubelet
handles a stream's end a moment after it sees it, by dropping the resource's *current* client,
so a Register sent at once would be the new client it drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Action(StrEnum):
    IDLE = "idle"
    WAIT = "wait"
    START = "start"
    RESTART = "restart"
    STOP = "stop"
    REGISTER = "register"


@dataclass(frozen=True, slots=True)
class Observation:
    now: float  # monotonic seconds
    serving: bool
    #: the socket file at our path is the one this run listens on
    socket_present: bool
    kubelet_stream_open: bool
    #: the latest Register call of this run was accepted
    accepted: bool
    #: the kubelet opened a stream after the latest Register call
    stream_seen: bool
    #: until when an accepted Register may wait for the kubelet's stream
    stream_deadline: float | None = None
    #: earliest time for the next attempt after a failure (None: now)
    retry_at: float | None = None
    #: why the watchdog asked for a repair ("" when it did not)
    repair: str = ""
    #: after a repair's STOP: no START before this time (monotonic)
    paused_until: float | None = None


@dataclass(frozen=True, slots=True)
class Step:
    action: Action
    reason: str = ""
    #: for WAIT (and after a step): look again at this time at the latest; None: on a wake-up only
    until: float | None = None


def decide(seen: Observation) -> Step:
    """The one step to take now (see the module table)."""
    retry_due = seen.retry_at is None or seen.now >= seen.retry_at
    if not seen.serving:
        if seen.paused_until is not None and seen.now < seen.paused_until:
            return Step(Action.WAIT, until=seen.paused_until)
        return Step(Action.START, "not serving") if retry_due else Step(Action.WAIT, until=seen.retry_at)
    if seen.repair:
        return Step(Action.STOP, f"watchdog: {seen.repair}")
    if seen.kubelet_stream_open:
        return Step(Action.IDLE)
    if not seen.socket_present:
        return Step(Action.RESTART, "own socket deleted or replaced")
    if seen.accepted and not seen.stream_seen:
        if seen.stream_deadline is not None and seen.now < seen.stream_deadline:
            return Step(Action.WAIT, until=seen.stream_deadline)
        reason = "the kubelet opened no ListAndWatch stream after Register"
    elif seen.accepted:
        reason = "the kubelet ended our ListAndWatch stream"
    else:
        reason = "not registered"
    if not retry_due:
        return Step(Action.WAIT, until=seen.retry_at)
    return Step(Action.REGISTER, reason)
