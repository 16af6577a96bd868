"""The prepared-claims checkpoint: what DRA handed out, on disk, so a restart loses nothing.

File ``<state dir>/checkpoint.json``::

    {"kind": "GpuNodeAgentDraCheckpoint", "version": 1,
     "checksum": "sha256:<hex of the canonical data>",
     "data": {"bootID": "...", "writtenAt": "...", "claims": [<claim>, ...]}}

The checksum covers ``data`` in canonical JSON (sorted keys, no spaces, UTF-8), so a file
cut short or edited by hand is detected. Writes are durable with one ``fdatasync``
(:class:`agent.base.slotfile.SlotFile`: the document goes into one of two slots of
``checkpoint.json.slots``, rewritten in place, and ``checkpoint.json`` is a copy replaced after
it); a write a crash cuts short leaves the previous checkpoint. One write records a whole batch
(the driver groups them).

Loading never crashes the agent over the file's content: a file that is truncated, not JSON,
fails its checksum or its schema, or comes from a newer version of the agent is moved aside
as ``checkpoint.json.corrupt-<UTC time>`` and reported in :class:`Loaded`; the caller then
rebuilds what it can (from the CDI claim specs on disk). Only an unreadable directory (no
permission, I/O error) is a :class:`~agent.base.errors.StartupError`: that is a deployment problem
no rebuild can fix.

All methods block (file I/O); the driver calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import structlog

from agent.base.atomicfile import temp_target
from agent.base.errors import AgentError, StartupError
from agent.base.slotfile import SUFFIX as SLOTS_SUFFIX
from agent.base.slotfile import SlotFile

log = structlog.get_logger("agent.dra")

KIND = "GpuNodeAgentDraCheckpoint"
VERSION = 1
FILE_NAME = "checkpoint.json"
MAX_BYTES = 32 * 1024 * 1024
FILE_MODE = 0o600
DIR_MODE = 0o750
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


class CheckpointError(AgentError):
    """The checkpoint could not be written; the claims of that batch are not prepared."""

    recoverable = True


class _Unusable(Exception):
    """The file's content cannot be trusted (the message says why)."""


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """This boot's ID ("" when the kernel does not say: then every checkpoint counts as this boot's)."""
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()[:64]
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One allocation result of a prepared claim (several results may name one device)."""

    pool: str
    name: str
    #: the GPU or MIG UUID the container gets
    uuid: str
    #: the physical GPU (ownership, usage)
    gpu_uuid: str
    #: top-level request names (no ``/sub``); empty when unknown (rebuilt from CDI specs)
    requests: tuple[str, ...]
    share_id: str | None
    cdi_ids: tuple[str, ...]
    #: the environment the claim's config gave this device (the config applied)
    env: Mapping[str, str] = field(default_factory=dict)
    admin_access: bool = False

    @property
    def is_mig(self) -> bool:
        return self.uuid != self.gpu_uuid


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]
    #: when it was first prepared (ISO 8601 UTC)
    prepared_at: str
    #: False when rebuilt from a CDI spec after the checkpoint was lost: the claim's name and
    #: requests are unknown until the kubelet prepares it again (then it is completed)
    complete: bool = True


@dataclass(frozen=True, slots=True)
class Loaded:
    status: Literal["missing", "ok", "corrupt"]
    claims: dict[str, PreparedClaim] = field(default_factory=dict)
    boot_id: str = ""
    written_at: str = ""
    #: why the file was not usable (status "corrupt"), and where it was moved
    problem: str = ""
    moved_to: Path | None = None


# --- encoding ------------------------------------------------------------------------------


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _checksum(data: Any) -> str:
    return "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()


def _device_dict(device: PreparedDevice) -> dict[str, Any]:
    return {
        "pool": device.pool,
        "device": device.name,
        "uuid": device.uuid,
        "gpuUUID": device.gpu_uuid,
        "requests": list(device.requests),
        "shareID": device.share_id,
        "cdiDeviceIDs": list(device.cdi_ids),
        "env": dict(device.env),
        "adminAccess": device.admin_access,
    }


def _claim_dict(claim: PreparedClaim) -> dict[str, Any]:
    return {
        "namespace": claim.namespace,
        "name": claim.name,
        "uid": claim.uid,
        "preparedAt": claim.prepared_at,
        "complete": claim.complete,
        "devices": [_device_dict(d) for d in claim.devices],
    }


def encode(claims: Iterable[PreparedClaim], *, boot_id: str, written_at: str) -> bytes:
    data = {
        "bootID": boot_id,
        "writtenAt": written_at,
        "claims": [_claim_dict(c) for c in sorted(claims, key=lambda c: c.uid)],
    }
    document = {"kind": KIND, "version": VERSION, "checksum": _checksum(data), "data": data}
    return json.dumps(document, indent=1, sort_keys=True, ensure_ascii=False).encode() + b"\n"


class _Reader:
    """Strict field access: a missing field, a wrong type or an unknown field is _Unusable."""

    def __init__(self, value: Any, where: str, fields: tuple[str, ...]) -> None:
        if not isinstance(value, dict):
            raise _Unusable(f"{where}: expected an object")
        unknown = set(value) - set(fields)
        if unknown:
            raise _Unusable(f"{where}: unknown field {sorted(unknown)[0]!r}")
        missing = set(fields) - set(value)
        if missing:
            raise _Unusable(f"{where}: missing field {sorted(missing)[0]!r}")
        self.value, self.where = value, where

    def get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        item = self.value[key]
        if not isinstance(item, kind):  # the schema has no int fields, so bool-is-int cannot slip in
            raise _Unusable(f"{self.where}.{key}: wrong type {type(item).__name__}")
        return item

    def strings(self, key: str) -> tuple[str, ...]:
        items = self.get(key, list)
        if not all(isinstance(i, str) for i in items):
            raise _Unusable(f"{self.where}.{key}: expected strings")
        return tuple(items)


_DEVICE_FIELDS = ("pool", "device", "uuid", "gpuUUID", "requests", "shareID", "cdiDeviceIDs", "env", "adminAccess")
_CLAIM_FIELDS = ("namespace", "name", "uid", "preparedAt", "complete", "devices")


def _device(value: Any, where: str) -> PreparedDevice:
    r = _Reader(value, where, _DEVICE_FIELDS)
    env = r.get("env", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise _Unusable(f"{where}.env: expected strings")
    return PreparedDevice(
        pool=r.get("pool", str),
        name=r.get("device", str),
        uuid=r.get("uuid", str),
        gpu_uuid=r.get("gpuUUID", str),
        requests=r.strings("requests"),
        share_id=r.get("shareID", (str, type(None))),
        cdi_ids=r.strings("cdiDeviceIDs"),
        env=env,
        admin_access=r.get("adminAccess", bool),
    )


def _claim(value: Any, where: str) -> PreparedClaim:
    r = _Reader(value, where, _CLAIM_FIELDS)
    devices = r.get("devices", list)
    return PreparedClaim(
        namespace=r.get("namespace", str),
        name=r.get("name", str),
        uid=r.get("uid", str),
        prepared_at=r.get("preparedAt", str),
        complete=r.get("complete", bool),
        devices=tuple(_device(d, f"{where}.devices[{i}]") for i, d in enumerate(devices)),
    )


def decode(raw: bytes) -> tuple[dict[str, PreparedClaim], str, str]:
    """(claims by UID, boot ID, written at); raises _Unusable with the reason."""
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Unusable(f"not JSON (truncated?): {exc}") from exc
    if not isinstance(document, dict) or document.get("kind") != KIND:
        raise _Unusable(f"not a checkpoint of this agent (kind is not {KIND})")
    version = document.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise _Unusable("no version")
    if version > VERSION:
        raise _Unusable(f"written by a newer agent (version {version}; this agent reads {VERSION})")
    top = _Reader(document, "checkpoint", ("kind", "version", "checksum", "data"))
    data = top.get("data", dict)
    if top.get("checksum", str) != _checksum(data):
        raise _Unusable("checksum mismatch (the file was changed or cut short)")
    body = _Reader(data, "data", ("bootID", "writtenAt", "claims"))
    claims: dict[str, PreparedClaim] = {}
    for i, value in enumerate(body.get("claims", list)):
        claim = _claim(value, f"data.claims[{i}]")
        if claim.uid in claims:
            raise _Unusable(f"data.claims[{i}]: claim {claim.uid!r} listed twice")
        claims[claim.uid] = claim
    return claims, body.get("bootID", str), body.get("writtenAt", str)


# --- the file ------------------------------------------------------------------------------


class CheckpointStore:
    """Reads and writes ``<directory>/checkpoint.json``."""

    def __init__(self, directory: Path, *, now: Callable[[], str] = utc_now) -> None:
        self.directory = directory
        self.path = directory / FILE_NAME
        self._now = now
        self._file = SlotFile(self.path, mode=FILE_MODE, max_bytes=MAX_BYTES)

    def load(self) -> Loaded:
        """The checkpoint on disk; an unusable one is moved aside (see the module docstring)."""
        self._remove_stale_temp_files()
        if not self._file.exists():
            return Loaded(status="missing")
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG  # only the slots: a crash came before the first copy was made
        except OSError as exc:
            raise StartupError(f"cannot read the DRA checkpoint {self.path}: {exc.strerror or exc}") from exc
        try:
            if not stat.S_ISREG(mode):
                raise _Unusable("not a regular file")
            raw = self._read()
            claims, boot_id, written_at = decode(raw)
        except _Unusable as exc:
            return self._move_aside(str(exc))
        return Loaded(status="ok", claims=claims, boot_id=boot_id, written_at=written_at)

    def _read(self) -> bytes:
        try:
            raw = self._file.read()
        except ValueError as exc:
            raise _Unusable(str(exc)) from exc
        except OSError as exc:
            raise StartupError(f"cannot read the DRA checkpoint {self.path}: {exc.strerror or exc}") from exc
        if raw is None:
            raise _Unusable("no complete record in its slots, and no copy")
        return raw

    def _move_aside(self, problem: str) -> Loaded:
        stamp = self._now().replace(":", "").replace("-", "").replace(".", "")
        target = self.path.with_name(f"{FILE_NAME}.corrupt-{stamp}")
        while target.exists():
            target = self.path.with_name(f"{FILE_NAME}.corrupt-{stamp}-{secrets.token_hex(2)}")
        try:
            self._file.rename(target)
        except OSError as exc:
            raise StartupError(
                f"the DRA checkpoint {self.path} is unusable ({problem}) and cannot be moved aside: "
                f"{exc.strerror or exc}"
            ) from exc
        log.error("dra.checkpoint_unusable", path=str(self.path), problem=problem, moved_to=str(target))
        return Loaded(status="corrupt", problem=problem, moved_to=target)

    def write(self, claims: Iterable[PreparedClaim], *, boot_id: str) -> str:
        """Replace the checkpoint durably (one fdatasync); returns the write time. Raises CheckpointError."""
        written_at = self._now()
        data = encode(claims, boot_id=boot_id, written_at=written_at)
        try:
            self.directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create {self.directory}: {exc.strerror or exc}") from exc
        try:
            self._file.write(data)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot write {self.path}: {getattr(exc, 'strerror', None) or exc}") from exc
        return written_at

    def _remove_stale_temp_files(self) -> None:
        """Temp files of a write a crash interrupted (the checkpoint itself is intact)."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if temp_target(name) in (FILE_NAME, FILE_NAME + SLOTS_SUFFIX):
                with contextlib.suppress(OSError):
                    os.unlink(self.directory / name)
                    log.info("dra.checkpoint_temp_removed", file=name)
