"""Reading the dynamic linker's cache (``/etc/ld.so.cache``) without running ldconfig.

Format "glibc-ld.so.cache" version "1.1" (glibc ``dl-cache.h``), optionally preceded by the
old "ld.so-1.7.0" table: a 48-byte header (magic, version, entry count, string table
length, flags, extension offset), then 24-byte entries (flags, key and value offsets into
the string table, os version, hwcap). Offsets count from the start of the new header.
"""

from __future__ import annotations

import platform
import struct
from dataclasses import dataclass

OLD_MAGIC = b"ld.so-1.7.0"
NEW_MAGIC = b"glibc-ld.so.cache1.1"
_OLD_HEADER = struct.Struct("=11sxI")  # magic, padding, nlibs
_OLD_ENTRY_SIZE = 12
_NEW_HEADER = struct.Struct("=20sIIB3xI12x")  # magic+version, nlibs, len_strings, flags, ext offset
_NEW_ENTRY = struct.Struct("=iIIIQ")  # flags, key, value, osversion, hwcap

FLAG_TYPE_MASK = 0x00FF
FLAG_ELF_LIBC6 = 0x0003
FLAG_ARCH_MASK = 0xFF00
#: the arch bits of 64-bit libraries per ``platform.machine()``
ARCH_FLAGS = {"x86_64": 0x0300, "aarch64": 0x0A00, "ppc64le": 0x0500}


class LdCacheError(ValueError):
    """Not a linker cache this parser understands."""


@dataclass(frozen=True, slots=True)
class LdCacheEntry:
    name: str  # the SONAME or link name, e.g. libcuda.so.1
    path: str  # absolute, inside the root the cache came from
    flags: int

    @property
    def arch_flags(self) -> int:
        return self.flags & FLAG_ARCH_MASK


def _cstring(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset)
    if offset >= len(data) or end < 0:
        raise LdCacheError(f"string offset {offset} out of range")
    return data[offset:end].decode("utf-8", "surrogateescape")


def _new_header_offset(data: bytes) -> int:
    if data.startswith(NEW_MAGIC):
        return 0
    if data.startswith(OLD_MAGIC):
        if len(data) < _OLD_HEADER.size:
            raise LdCacheError("truncated old-format header")
        _, nlibs = _OLD_HEADER.unpack_from(data)
        offset = _OLD_HEADER.size + int(nlibs) * _OLD_ENTRY_SIZE
        offset = (offset + 7) & ~7  # the new table is aligned for its 64-bit hwcap field
        if data[offset : offset + len(NEW_MAGIC)] == NEW_MAGIC:
            return offset
        raise LdCacheError("old-format cache without a new-format table")
    raise LdCacheError("not a glibc linker cache (bad magic)")


def parse(data: bytes) -> list[LdCacheEntry]:
    """Every entry of the cache, in file order (the linker's search order)."""
    base = _new_header_offset(data)
    if len(data) < base + _NEW_HEADER.size:
        raise LdCacheError("truncated header")
    _, nlibs, _, _, _ = _NEW_HEADER.unpack_from(data, base)
    entries_at = base + _NEW_HEADER.size
    if len(data) < entries_at + nlibs * _NEW_ENTRY.size:
        raise LdCacheError(f"truncated: {nlibs} entries announced")
    out: list[LdCacheEntry] = []
    for i in range(nlibs):
        flags, key, value, _, _ = _NEW_ENTRY.unpack_from(data, entries_at + i * _NEW_ENTRY.size)
        out.append(LdCacheEntry(name=_cstring(data, base + key), path=_cstring(data, base + value), flags=flags))
    return out


def native_libraries(entries: list[LdCacheEntry], machine: str | None = None) -> list[LdCacheEntry]:
    """The glibc entries for this machine's 64-bit ABI (all glibc entries if it is unknown)."""
    arch = ARCH_FLAGS.get(machine or platform.machine())
    return [e for e in entries if e.flags & FLAG_TYPE_MASK == FLAG_ELF_LIBC6 and (arch is None or e.arch_flags == arch)]


def build(entries: list[tuple[str, str]], flags: int | None = None) -> bytes:
    """A new-format cache holding ``(name, path)`` pairs (tests and fake driver roots)."""
    if flags is None:
        flags = FLAG_ELF_LIBC6 | ARCH_FLAGS.get(platform.machine(), 0)
    strings = bytearray()
    table_at = _NEW_HEADER.size + len(entries) * _NEW_ENTRY.size
    packed = bytearray()
    for name, path in entries:
        key = table_at + len(strings)
        strings += name.encode() + b"\0"
        value = table_at + len(strings)
        strings += path.encode() + b"\0"
        packed += _NEW_ENTRY.pack(flags, key, value, 0, 0)
    header = _NEW_HEADER.pack(NEW_MAGIC, len(entries), len(strings), 0, 0)
    return bytes(header + packed + strings)
