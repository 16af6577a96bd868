"""The CDI name rules (library ``pkg/parser``), qualified names and spec file names.

File names carry ownership: the agent only ever touches files whose name starts with the
``<vendor>-<class>`` of one of its own kinds (annotations, which could mark ownership
inside the file, need cdiVersion 0.6.0 and Debian's podman 4.3 stops at 0.5.0).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from agent.cdi.errors import InvalidNameError

_VENDOR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")
# a claim UID becomes part of a file name and of device names: no ':' (file names), no '/'
_CLAIM_UID = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_NOT_NAME_CHAR = re.compile(r"[^A-Za-z0-9_.:-]")
MAX_CLAIM_UID = 128

SPEC_SUFFIX = ".json"
SPEC_SUFFIXES = (".json", ".yaml")


def vendor_problem(vendor: str) -> str | None:
    if not _VENDOR_CLASS.fullmatch(vendor):
        return f"invalid vendor {vendor!r}: starts with a letter, ends with a letter or digit, [A-Za-z0-9_.-] inside"
    return None


def class_problem(klass: str) -> str | None:
    if not _VENDOR_CLASS.fullmatch(klass):
        return f"invalid class {klass!r}: starts with a letter, ends with a letter or digit, [A-Za-z0-9_.-] inside"
    return None


def device_name_problem(name: str) -> str | None:
    if not _DEVICE_NAME.fullmatch(name):
        return f"invalid device name {name!r}: letters or digits at both ends, [A-Za-z0-9_.:-] inside"
    return None


def split_kind(kind: str) -> tuple[str, str]:
    """``vendor/class`` -> (vendor, class), validated."""
    vendor, sep, klass = kind.partition("/")
    if not sep:
        raise InvalidNameError(f"invalid CDI kind {kind!r}: want <vendor>/<class>")
    problem = vendor_problem(vendor) or class_problem(klass)
    if problem:
        raise InvalidNameError(f"invalid CDI kind {kind!r}: {problem}")
    return vendor, klass


def check_device_name(name: str) -> str:
    problem = device_name_problem(name)
    if problem:
        raise InvalidNameError(problem)
    return name


@functools.lru_cache(maxsize=4096)
def qualified_name(kind: str, name: str) -> str:
    """``vendor/class=name``, the string handed to the kubelet and the runtime.

    Pure, and asked for the same few names on every Allocate: kept once validated (an invalid
    name raises and is not kept)."""
    split_kind(kind)
    return f"{kind}={check_device_name(name)}"


def device_part(device_id: str) -> str:
    """A device UUID made fit for a device name (legacy MIG UUIDs contain '/')."""
    return _NOT_NAME_CHAR.sub("_", device_id)


def check_claim_uid(claim_uid: str) -> str:
    if len(claim_uid) > MAX_CLAIM_UID or not _CLAIM_UID.fullmatch(claim_uid):
        raise InvalidNameError(
            f"claim UID {claim_uid!r} cannot be used in a CDI name: letters or digits at both ends, "
            f"[A-Za-z0-9_.-] inside, at most {MAX_CLAIM_UID} characters"
        )
    return claim_uid


def claim_device_name(claim_uid: str, device_id: str) -> str:
    """Unique per claim, so a runtime cache never resolves a stale entry of another claim."""
    return check_device_name(f"{check_claim_uid(claim_uid)}-{device_part(device_id)}")


def spec_file_name(kind: str) -> str:
    """``<vendor>-<class>.json`` (the library's GenerateSpecName)."""
    vendor, klass = split_kind(kind)
    return f"{vendor}-{klass}{SPEC_SUFFIX}"


def transient_prefix(kind: str) -> str:
    vendor, klass = split_kind(kind)
    return f"{vendor}-{klass}_"


def transient_spec_file_name(kind: str, transient_id: str) -> str:
    """``<vendor>-<class>_<id>.json`` (the library's GenerateTransientSpecName)."""
    return f"{transient_prefix(kind)}{check_claim_uid(transient_id.replace('/', '_'))}{SPEC_SUFFIX}"


def claim_uid_of(kind: str, file_name: str) -> str | None:
    """The claim UID of a transient spec file name of ``kind``, else None."""
    prefix = transient_prefix(kind)
    if not (file_name.startswith(prefix) and file_name.endswith(SPEC_SUFFIX)):
        return None
    uid = file_name[len(prefix) : -len(SPEC_SUFFIX)]
    return uid if _CLAIM_UID.fullmatch(uid) else None


@dataclass(frozen=True, slots=True)
class ClaimSpecDirectory:
    """The transient claim specs of ``kind`` in ``directory``: which claims have one."""

    directory: Path
    kind: str

    @property
    def where(self) -> str:
        return str(self.directory)

    def uids(self) -> frozenset[str]:
        """Claim UIDs with a spec file; an absent or unreadable directory has none. Blocking."""
        try:
            names = [entry.name for entry in self.directory.iterdir()]
        except OSError:
            return frozenset()
        return frozenset(uid for name in names if (uid := claim_uid_of(self.kind, name)) is not None)
