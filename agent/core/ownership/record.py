"""The durable record of the device plugin's grants: what a restarted agent may offer at once.

A starting agent knows nothing about what its previous run handed out until it has asked the
kubelet (PodResources), read the DRA checkpoint and listed its ResourceSlices, which takes until
the API client is up. The device plugin registers long before that, and an empty first
ListAndWatch tells the kubelet "this node has no GPUs": every pod it admits meanwhile fails.

So the handover keeps, in the state directory, the set of GPUs granted to the device plugin,
written (atomically, fsynced) whenever that set changes, with one rule that makes it safe to
trust: **a GPU is never granted to another mechanism while the record on disk may still list
it** (:func:`agent.core.ownership.handover.next_grants` takes the set that may be on disk). So a
GPU the record lists was the device plugin's, and nothing else can have been given it since: no
ResourceSlice lists it, no claim was allocated or prepared on it. A restarted agent grants such
a GPU to the device plugin at once when the config still gives it to the device plugin
(:func:`~agent.core.ownership.handover.seed_grants`), before anything else is known.

A record that cannot be read is removed (a later run must not trust what this one could not
check); one that cannot be removed either counts as listing every GPU, so nothing goes to DRA.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterable
from pathlib import Path

import structlog

from agent.base.atomicfile import replace_file

log = structlog.get_logger("agent.handover")

RECORD_FILE = "ownership-grants.json"
FORMAT = 1
#: a record of a few hundred GPUs is a few tens of KiB; past this it is not ours
MAX_BYTES = 1024 * 1024


class GrantRecord:
    """The file. Every method blocks (file I/O): callers run them off the event loop."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / RECORD_FILE

    def load(self) -> frozenset[str] | None:
        """The GPUs the record lists; empty when there is none or it is not ours to trust; None
        when it exists but cannot be read (the caller removes it)."""
        try:
            with self.path.open("rb") as f:
                raw = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return frozenset()
        except OSError as exc:
            log.warning("cannot read the record of grants", path=str(self.path), error=exc.strerror or str(exc))
            return None
        try:
            doc = json.loads(raw) if len(raw) <= MAX_BYTES else None
        except ValueError:
            doc = None
        gpus = doc.get("device_plugin") if isinstance(doc, dict) and doc.get("format") == FORMAT else None
        if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
            log.warning("the record of grants is not one this agent wrote; ignoring it", path=str(self.path))
            return None
        return frozenset(gpus)

    def write(self, gpus: frozenset[str]) -> None:
        """Replace the record; raises OSError."""
        body = {"format": FORMAT, "device_plugin": sorted(gpus)}
        replace_file(self.path, json.dumps(body, indent=1).encode() + b"\n", mode=0o600)

    def remove(self) -> None:
        """Remove the record; raises OSError (a missing one is fine)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return


class RecordKeeper:
    """Keeps the record in step with the device plugin's grants, one write at a time, off the loop.

    :meth:`want` (from the handover's evaluation, no I/O) names the set the record should list;
    :meth:`flush` (awaited by the handover's loop when :meth:`pending`) writes it. Until a write
    has finished, both the old and the new set may be on disk: :attr:`maybe_on_disk` is their
    union, and the handover grants none of those GPUs to DRA.
    """

    def __init__(self, record: GrantRecord, *, on_disk: frozenset[str] | None, all_gpus: Iterable[str] = ()) -> None:
        self.record = record
        #: what the file lists as far as we know; None: it could not be read or removed
        self._durable: frozenset[str] | None = on_disk
        self._all = frozenset(all_gpus)
        self._wanted: frozenset[str] | None = None
        self.writes = 0
        self.last_error = ""

    @property
    def maybe_on_disk(self) -> frozenset[str]:
        """Every GPU the file may list now (all of them while its content is unknown)."""
        durable = self._all if self._durable is None else self._durable
        return durable | (self._wanted or frozenset()) if self.pending() else durable

    def want(self, gpus: frozenset[str], all_gpus: Iterable[str] = ()) -> None:
        """The record should list ``gpus`` (the device plugin's grants now)."""
        self._all |= frozenset(all_gpus)
        self._wanted = gpus

    def pending(self) -> bool:
        return self._wanted is not None and self._wanted != self._durable

    async def flush(self) -> None:
        """Write what :meth:`want` named last; on failure remove the file instead. Never raises."""
        gpus = self._wanted
        if gpus is None or gpus == self._durable:
            return
        try:
            await asyncio.to_thread(self.record.write, gpus)
        except OSError as exc:
            error = f"writing {self.record.path}: {exc.strerror or exc}"
            try:
                await asyncio.to_thread(self.record.remove)
            except OSError as gone:
                error += f"; removing it: {gone.strerror or gone}"
            else:
                self._durable = frozenset()
            if error != self.last_error:
                log.error("cannot keep the record of grants; a restart offers GPUs only once it has asked", error=error)
            self.last_error = error
            return
        self.writes += 1
        self.last_error = ""
        self._durable = gpus

    async def forget_unreadable(self) -> None:
        """The record exists but could not be read at start: remove it (or keep counting every GPU)."""
        if self._durable is not None:
            return
        try:
            await asyncio.to_thread(self.record.remove)
        except OSError as exc:
            self.last_error = f"removing unreadable {self.record.path}: {exc.strerror or exc}"
            log.error("cannot remove the unreadable record of grants; no GPU goes to DRA", error=self.last_error)
            return
        self._durable = frozenset()

    def debug_state(self) -> dict[str, object]:
        return {
            "path": str(self.record.path),
            "on_disk": None if self._durable is None else sorted(self._durable),
            "pending": self.pending(),
            "writes": self.writes,
            "last_error": self.last_error or None,
        }
