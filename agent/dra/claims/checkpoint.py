"""The prepared-claims checkpoint: what DRA handed out, on disk, so a restart loses nothing.

File ``<state dir>/checkpoint.json``::

    {"kind": "GpuNodeAgentDraCheckpoint", "version": 2,
     "checksum": "sha256:<hex of the canonical data>",
     "data": {"bootID": "...", "writtenAt": "...", "claims": [<claim>, ...],
              "instances": [<MIG instance the agent made or is making>, ...]}}

Version 2 added what dynamic MIG and shared GPUs need: per device the MIG placement and profile
of an instance-backed device, the memory a share was allocated and its MPS mounts; and the
``instances`` list, the record of every MIG instance the agent made. An instance is recorded
(``uuid`` null) *before* it is created and completed once it exists, so a restart finds every
instance it made, even one whose creation a crash interrupted, and destroys those no prepared
claim needs; an instance not in this list is never touched. A version 1 file still loads (no
instances, no partitions, no shares).

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
import dataclasses
import hashlib
import json
import os
import secrets
import stat
import typing
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
from agent.core.inventory.model import MigPlacement

log = structlog.get_logger("agent.dra")

KIND = "GpuNodeAgentDraCheckpoint"
VERSION = 2
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
    #: the environment the claim's config gave this device (the config applied), and a share's MPS variables
    env: Mapping[str, str] = field(default_factory=dict)
    admin_access: bool = False
    #: an instance-backed device (dynamic MIG): the GPU instance's placement and profile ID
    placement: MigPlacement | None = None
    profile_id: int | None = None
    #: a share of a shared GPU: the memory it was allocated (bytes), and whether it runs under MPS
    share_memory: int | None = None
    mps: bool = False
    #: (host path, container path) bind mounts of the device (a share's MPS pipe and log directories)
    mounts: tuple[tuple[str, str], ...] = ()

    @property
    def is_mig(self) -> bool:
        return self.uuid != self.gpu_uuid

    @property
    def is_share(self) -> bool:
        return self.share_memory is not None


@dataclass(frozen=True, slots=True)
class CreatedInstance:
    """A MIG instance the agent made (or is making) for a claim.

    Recorded before the instance is created, with ``uuid`` None, and completed once it exists; so
    a restart knows every instance it made, and only those.
    """

    gpu_uuid: str
    profile_id: int
    placement: MigPlacement
    claim_uid: str
    uuid: str | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def created(self) -> bool:
        return self.uuid is not None


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]
    #: when it was first prepared (ISO 8601 UTC)
    prepared_at: str
    #: False when the stored answer cannot be trusted until the kubelet prepares the claim again
    #: (then it is completed): rebuilt from a CDI spec after the checkpoint was lost (name and
    #: requests unknown), or left with some MIG instances destroyed by an unprepare that failed
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
    instances: tuple[CreatedInstance, ...] = ()


# --- encoding ------------------------------------------------------------------------------


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _checksum(data: Any) -> str:
    return "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()


def _placement_dict(placement: MigPlacement | None) -> dict[str, int] | None:
    return None if placement is None else {"start": placement.start, "size": placement.size}


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
        "placement": _placement_dict(device.placement),
        "profileID": device.profile_id,
        "shareMemory": device.share_memory,
        "mps": device.mps,
        "mounts": [{"hostPath": host, "containerPath": container} for host, container in device.mounts],
    }


def _instance_dict(instance: CreatedInstance) -> dict[str, Any]:
    return {
        "gpuUUID": instance.gpu_uuid,
        "profileID": instance.profile_id,
        "placement": _placement_dict(instance.placement),
        "claimUID": instance.claim_uid,
        "uuid": instance.uuid,
        "gpuInstanceID": instance.gpu_instance_id,
        "computeInstanceID": instance.compute_instance_id,
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


def _instance_key(instance: CreatedInstance) -> tuple[str, int, str]:
    return (instance.gpu_uuid, instance.placement.start, instance.claim_uid)


def encode(
    claims: Iterable[PreparedClaim],
    *,
    boot_id: str,
    written_at: str,
    instances: Iterable[CreatedInstance] = (),
) -> bytes:
    data = {
        "bootID": boot_id,
        "writtenAt": written_at,
        "claims": [_claim_dict(c) for c in sorted(claims, key=lambda c: c.uid)],
        "instances": [_instance_dict(i) for i in sorted(instances, key=_instance_key)],
    }
    document = {"kind": KIND, "version": VERSION, "checksum": _checksum(data), "data": data}
    # compact: the standard library encodes that in C, indented JSON in Python (several times
    # slower), and the whole checkpoint is encoded before every NodePrepareResources answer
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


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
        if not isinstance(item, kind) or (isinstance(item, bool) and bool not in _types(kind)):
            raise _Unusable(f"{self.where}.{key}: wrong type {type(item).__name__}")
        return item

    def count(self, key: str, *, optional: bool = False) -> int | None:
        """A non-negative int (bool is not one); None only when ``optional`` and null."""
        item = self.get(key, (int, type(None)) if optional else int)
        if item is not None and item < 0:
            raise _Unusable(f"{self.where}.{key}: negative")
        return typing.cast(int | None, item)

    def strings(self, key: str) -> tuple[str, ...]:
        items = self.get(key, list)
        if not all(isinstance(i, str) for i in items):
            raise _Unusable(f"{self.where}.{key}: expected strings")
        return tuple(items)


def _types(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


_DEVICE_FIELDS_V1 = ("pool", "device", "uuid", "gpuUUID", "requests", "shareID", "cdiDeviceIDs", "env", "adminAccess")
_DEVICE_FIELDS = (*_DEVICE_FIELDS_V1, "placement", "profileID", "shareMemory", "mps", "mounts")
_CLAIM_FIELDS = ("namespace", "name", "uid", "preparedAt", "complete", "devices")
_INSTANCE_FIELDS = ("gpuUUID", "profileID", "placement", "claimUID", "uuid", "gpuInstanceID", "computeInstanceID")
#: a placement's slices: far beyond any GPU's 8
_MAX_SLICES = 64


def _placement(value: Any, where: str, *, optional: bool) -> MigPlacement | None:
    if value is None and optional:
        return None
    r = _Reader(value, where, ("start", "size"))
    start, size = r.count("start"), r.count("size")
    assert start is not None and size is not None
    if size < 1 or start + size > _MAX_SLICES:
        raise _Unusable(f"{where}: not a placement of a GPU")
    return MigPlacement(start, size)


def _device(value: Any, where: str, version: int) -> PreparedDevice:
    r = _Reader(value, where, _DEVICE_FIELDS if version >= 2 else _DEVICE_FIELDS_V1)
    env = r.get("env", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise _Unusable(f"{where}.env: expected strings")
    device = PreparedDevice(
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
    if version < 2:
        return device
    mounts = []
    for i, mount in enumerate(r.get("mounts", list)):
        m = _Reader(mount, f"{where}.mounts[{i}]", ("hostPath", "containerPath"))
        mounts.append((m.get("hostPath", str), m.get("containerPath", str)))
    return dataclasses.replace(
        device,
        placement=_placement(r.get("placement", (dict, type(None))), f"{where}.placement", optional=True),
        profile_id=r.count("profileID", optional=True),
        share_memory=r.count("shareMemory", optional=True),
        mps=r.get("mps", bool),
        mounts=tuple(mounts),
    )


def _claim(value: Any, where: str, version: int) -> PreparedClaim:
    r = _Reader(value, where, _CLAIM_FIELDS)
    devices = r.get("devices", list)
    return PreparedClaim(
        namespace=r.get("namespace", str),
        name=r.get("name", str),
        uid=r.get("uid", str),
        prepared_at=r.get("preparedAt", str),
        complete=r.get("complete", bool),
        devices=tuple(_device(d, f"{where}.devices[{i}]", version) for i, d in enumerate(devices)),
    )


def _instance(value: Any, where: str) -> CreatedInstance:
    r = _Reader(value, where, _INSTANCE_FIELDS)
    placement = _placement(r.get("placement", dict), f"{where}.placement", optional=False)
    profile_id = r.count("profileID")
    assert placement is not None and profile_id is not None
    uuid = r.get("uuid", (str, type(None)))
    gi, ci = r.count("gpuInstanceID", optional=True), r.count("computeInstanceID", optional=True)
    if (uuid is None) != (gi is None) or (uuid is None) != (ci is None):
        raise _Unusable(f"{where}: uuid and instance IDs are set together or not at all")
    return CreatedInstance(
        gpu_uuid=r.get("gpuUUID", str),
        profile_id=profile_id,
        placement=placement,
        claim_uid=r.get("claimUID", str),
        uuid=uuid,
        gpu_instance_id=gi,
        compute_instance_id=ci,
    )


@dataclass(frozen=True, slots=True)
class Decoded:
    claims: dict[str, PreparedClaim]
    boot_id: str
    written_at: str
    instances: tuple[CreatedInstance, ...] = ()
    version: int = VERSION


def decode(raw: bytes) -> Decoded:
    """The checkpoint's content; raises _Unusable with the reason."""
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
    fields = ("bootID", "writtenAt", "claims", "instances") if version >= 2 else ("bootID", "writtenAt", "claims")
    body = _Reader(data, "data", fields)
    claims: dict[str, PreparedClaim] = {}
    for i, value in enumerate(body.get("claims", list)):
        claim = _claim(value, f"data.claims[{i}]", version)
        if claim.uid in claims:
            raise _Unusable(f"data.claims[{i}]: claim {claim.uid!r} listed twice")
        claims[claim.uid] = claim
    instances: list[CreatedInstance] = []
    if version >= 2:
        seen: set[tuple[str, int]] = set()
        for i, value in enumerate(body.get("instances", list)):
            instance = _instance(value, f"data.instances[{i}]")
            key = (instance.gpu_uuid, instance.placement.start)
            if key in seen:  # two instances never share a GPU's first memory slice
                raise _Unusable(f"data.instances[{i}]: a second instance at {key}")
            seen.add(key)
            instances.append(instance)
    return Decoded(claims, body.get("bootID", str), body.get("writtenAt", str), tuple(instances), version)


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
            decoded = decode(raw)
        except _Unusable as exc:
            return self._move_aside(str(exc))
        return Loaded(
            status="ok",
            claims=decoded.claims,
            boot_id=decoded.boot_id,
            written_at=decoded.written_at,
            instances=decoded.instances,
        )

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

    def write(self, claims: Iterable[PreparedClaim], *, boot_id: str, instances: Iterable[CreatedInstance] = ()) -> str:
        """Replace the checkpoint durably (one fdatasync); returns the write time. Raises CheckpointError."""
        written_at = self._now()
        data = encode(claims, boot_id=boot_id, written_at=written_at, instances=instances)
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
