"""Whether the kubelet holds a ListAndWatch stream of one server run: what "registered" means.

The kubelet answers ``Register`` only after dialling the plugin's socket and calling
GetDevicePluginOptions on that connection; then it opens ListAndWatch on the same connection
and keeps the stream for as long as it counts the plugin as registered. When the kubelet dies,
restarts or drops the plugin, the stream ends. So the plugin is registered exactly while a
ListAndWatch stream is open on a connection that asked for the options while one of our
``Register`` calls was in flight — whatever filesystem events came or did not come, and whatever inode numbers
``kubelet.sock`` had.

A :class:`KubeletLink` lives as long as one server run (a restart makes a new one). The server
(:mod:`agent.deviceplugin.server`) marks its Register attempts; the servicer reports connections and
streams through :class:`~agent.deviceplugin.service.ResourceService`. Connections are opaque
hashable keys here (the servicer's choice), so this module knows nothing of gRPC.

Fallback: a kubelet that registered us without asking for the options on any connection (none
is known to) would never be recognised; for that case a stream opened after a successful
Register on any connection counts, and its connection becomes the kubelet's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from datetime import UTC, datetime

#: kubelet connections remembered per run (one per Register attempt; old ones are dead anyway)
MAX_KUBELET_CONNECTIONS = 16


def _iso(at: float | None) -> str:
    return "" if at is None else datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds")


@dataclass(slots=True)
class _Stream:
    connection: Hashable
    opened_at: float  # wall clock, for display
    kubelet: bool


class KubeletLink:
    """The kubelet's hold on one server run. Loop thread only; every method is O(1)."""

    def __init__(
        self,
        *,
        on_change: Callable[[], None] = lambda: None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._on_change = on_change
        self._now = wall_clock
        self._registering = False
        #: connections that asked for the options while one of this run's Register calls was in
        #: flight, newest last (a dict as an ordered set, bounded)
        self._kubelet_connections: dict[Hashable, None] = {}
        #: the latest Register call was accepted
        self.accepted = False
        self._streams: dict[int, _Stream] = {}
        self._next_token = 0
        self.registered_at: float | None = None  # wall clock of the latest accepted Register
        #: whether the kubelet opened a stream after the latest Register attempt
        self.stream_seen = False
        #: the open kubelet stream's start (wall clock); None while it holds none
        self.stream_open_since: float | None = None
        self.streams_ended = 0  # kubelet streams that ended, over the run

    # --- the server's side ------------------------------------------------------------

    def register_started(self) -> None:
        """A Register call is about to be sent; what the kubelet does next belongs to it."""
        self._registering = True
        self.accepted = False
        self.stream_seen = False

    def register_finished(self, *, accepted: bool) -> None:
        self._registering = False
        self.accepted = accepted
        if accepted:
            self.registered_at = self._now()

    # --- the servicer's side ----------------------------------------------------------

    def options_requested(self, connection: Hashable) -> None:
        """GetDevicePluginOptions arrived on ``connection``."""
        if self._registering:
            self._remember(connection)

    def _remember(self, connection: Hashable) -> None:
        self._kubelet_connections.pop(connection, None)
        self._kubelet_connections[connection] = None
        while len(self._kubelet_connections) > MAX_KUBELET_CONNECTIONS:
            del self._kubelet_connections[next(iter(self._kubelet_connections))]

    def stream_opened(self, connection: Hashable) -> int:
        """A ListAndWatch stream opened on ``connection``; returns a token for :meth:`stream_closed`."""
        kubelet = connection in self._kubelet_connections
        if not kubelet and self.accepted and not self._kubelet_connections:
            kubelet = True  # the fallback of the module docstring
            self._remember(connection)
        token = self._next_token
        self._next_token += 1
        self._streams[token] = _Stream(connection, self._now(), kubelet)
        if kubelet:
            self.stream_seen = True
            if self.stream_open_since is None:
                self.stream_open_since = self._streams[token].opened_at
            self._on_change()
        return token

    def stream_closed(self, token: int) -> None:
        stream = self._streams.pop(token, None)
        if stream is None or not stream.kubelet:
            return
        self.streams_ended += 1
        if not self.kubelet_stream_open:
            self.stream_open_since = None
        self._on_change()

    # --- reading ----------------------------------------------------------------------

    @property
    def kubelet_stream_open(self) -> bool:
        """The kubelet holds a ListAndWatch stream of this run: registered."""
        return any(s.kubelet for s in self._streams.values())

    @property
    def open_streams(self) -> int:
        """Every open ListAndWatch stream of this run, the kubelet's and others'."""
        return len(self._streams)

    def debug_state(self) -> dict[str, object]:
        return {
            "registered": self.kubelet_stream_open,
            "registered_since": _iso(self.registered_at) if self.kubelet_stream_open else "",
            "stream_open_since": _iso(self.stream_open_since),
            "kubelet_streams_ended": self.streams_ended,
        }
