"""The linker cache reader against hand-built caches and this machine's real one."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from agent.backends import ldcache


def test_build_and_parse_round_trip() -> None:
    pairs = [("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"), ("libz.so.1", "/lib/libz.so.1")]
    entries = ldcache.parse(ldcache.build(pairs, flags=0x0303))
    assert [(e.name, e.path) for e in entries] == pairs
    assert all(e.flags == 0x0303 for e in entries)


def test_native_filter_drops_other_abis() -> None:
    data = ldcache.build([("libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1")], flags=0x0003)
    assert ldcache.native_libraries(ldcache.parse(data), "x86_64") == []
    assert len(ldcache.native_libraries(ldcache.parse(data), "riscv-unknown")) == 1


def test_old_format_prefix_is_skipped() -> None:
    new = ldcache.build([("libcuda.so.1", "/usr/lib/libcuda.so.1")], flags=0x0303)
    old = struct.pack("=11sxI", ldcache.OLD_MAGIC, 1) + b"\0" * 12
    old += b"\0" * ((8 - len(old) % 8) % 8)
    assert [e.name for e in ldcache.parse(old + new)] == ["libcuda.so.1"]


@pytest.mark.parametrize("data", [b"", b"garbage" * 10, ldcache.NEW_MAGIC + b"\0" * 4])
def test_bad_caches_raise(data: bytes) -> None:
    with pytest.raises(ldcache.LdCacheError):
        ldcache.parse(data)


def test_truncated_entries_raise() -> None:
    data = ldcache.build([("a.so", "/a.so")])
    with pytest.raises(ldcache.LdCacheError):
        ldcache.parse(data[: ldcache._NEW_HEADER.size + 4])


@pytest.mark.skipif(shutil.which("ldconfig") is None or not Path("/etc/ld.so.cache").exists(), reason="no ldconfig")
def test_matches_ldconfig_on_this_machine() -> None:
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=True).stdout.splitlines()
    expected = [line.split(" => ")[-1].strip() for line in listing[1:] if " => " in line]
    parsed = [e.path for e in ldcache.parse(Path("/etc/ld.so.cache").read_bytes())]
    assert parsed == expected
