"""Watch one directory for changed file names, on the event loop, without slow polling.

Usage::

    async with DirectoryWatcher(path) as watcher:
        async for names in watcher:      # a non-empty set of file names (not paths)
            ...

A name is reported when a file of that name is created, deleted, moved in or out, closed after
writing, or has its metadata changed (inotify ``IN_CREATE | IN_DELETE | IN_MOVED_TO |
IN_MOVED_FROM | IN_CLOSE_WRITE | IN_ATTRIB``). Changes that arrive while the consumer is busy
are coalesced into one set, so a slow consumer never builds a backlog. The report says *that*
something happened to a name; the consumer looks at the file system to see *what* (is
``kubelet.sock`` there now? did the config file's content change?).

The directory need not exist: the watcher then watches the nearest existing ancestor and
starts watching the directory when it appears, reporting every name already in it. When the
directory itself is deleted or moved away (``IN_DELETE_SELF``/``IN_MOVE_SELF``) the watcher
falls back to the ancestor again.

:data:`RESCAN` (``"*"``) in a batch means the watcher cannot say exactly what changed: names
may have appeared, changed *or vanished* without being named. It is added on an inotify queue
overflow (``IN_Q_OVERFLOW``: events were dropped), when the watched directory is deleted,
moved away or replaced (the names that went with it are not known), and on a switch from
inotify to polling; the batch also holds every name in the directory at that moment. A
consumer that sees it treats every name it cares about as changed and looks again. The
polling mode never reports it: it diffs listings, so its reports are exact. (A real file
named ``*`` is reported as ``*`` too, which only costs the consumer a needless look.)

Linux inotify is used through ``ctypes`` (libc ``inotify_init1``/``inotify_add_watch``) with
``loop.add_reader``. Where inotify is unavailable (not Linux, no libc symbol, watch limits
exhausted) the watcher polls instead: a directory listing every ``poll_interval`` seconds,
diffed by inode, size, mtime and ctime. ``use_inotify=False`` forces polling (tests).

To watch one file (a mounted ConfigMap), watch its directory and filter by name: ConfigMap
updates replace a symlinked directory (``..data``) by rename, which shows up as
``IN_MOVED_TO`` of ``..data`` in the directory, never as a write to the file itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import os
import struct
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType

import structlog

log = structlog.get_logger("agent.fswatch")

IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

#: events on the watched directory's entries that are reported by name
TARGET_MASK = IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM | IN_CLOSE_WRITE | IN_ATTRIB
#: events on the watched directory itself
SELF_MASK = IN_DELETE_SELF | IN_MOVE_SELF
#: events on an ancestor while the directory is missing
ANCESTOR_MASK = IN_CREATE | IN_MOVED_TO | IN_DELETE_SELF | IN_MOVE_SELF

#: reported (with the current listing) when the watcher cannot name what changed: anything in
#: the directory may have been created, changed or deleted; see the module docstring
RESCAN = "*"

_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len
_READ_SIZE = 64 * 1024

Sleep = Callable[[float], Awaitable[None]]


class _Inotify:
    """The three libc calls, loaded once; ``None`` from :meth:`load` where unavailable."""

    _instance: _Inotify | None = None
    _tried = False

    def __init__(self, libc: ctypes.CDLL) -> None:
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int
        self.rm_watch = libc.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self.rm_watch.restype = ctypes.c_int

    @classmethod
    def load(cls) -> _Inotify | None:
        if not cls._tried:
            cls._tried = True
            if sys.platform.startswith("linux"):
                try:
                    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                    cls._instance = cls(libc)
                except (OSError, AttributeError) as exc:
                    log.info("inotify unavailable, directory watches will poll", error=str(exc))
        return cls._instance


class DirectoryWatcher:
    """Reports sets of changed file names in ``path``; see the module docstring."""

    def __init__(
        self,
        path: Path,
        *,
        poll_interval: float = 0.2,
        use_inotify: bool | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.path = Path(path).absolute()
        self.poll_interval = poll_interval
        self._want_inotify = use_inotify
        self._sleep = sleep
        self._pending: set[str] = set()
        self._wakeup = asyncio.Event()
        self._closed = False
        # inotify state
        self._lib: _Inotify | None = None
        self._fd = -1
        self._wd = -1
        self._watching_target = False
        self._armed_once = False
        # polling state
        self._poll_task: asyncio.Task[None] | None = None

    @property
    def mode(self) -> str:
        """``inotify`` or ``poll`` (after ``__aenter__``)."""
        return "inotify" if self._fd >= 0 else "poll"

    # --- lifecycle -------------------------------------------------------------

    async def __aenter__(self) -> DirectoryWatcher:
        self._closed = False
        lib = _Inotify.load() if self._want_inotify is not False else None
        if lib is not None and self._start_inotify(lib):
            return self
        if self._want_inotify:
            raise OSError(errno.ENOSYS, "inotify is not available")
        snapshot = _listing(self.path)
        self._poll_task = asyncio.create_task(self._poll(snapshot), name=f"fswatch-poll:{self.path}")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop watching; a consumer waiting in ``async for`` ends. Idempotent."""
        self._closed = True
        self._wakeup.set()
        if self._fd >= 0:
            loop = asyncio.get_running_loop()
            loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = self._wd = -1
        task, self._poll_task = self._poll_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __aiter__(self) -> DirectoryWatcher:
        return self

    async def __anext__(self) -> set[str]:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()
        names, self._pending = self._pending, set()
        return names

    def _report(self, names: set[str]) -> None:
        if names:
            self._pending |= names
            self._wakeup.set()

    # --- inotify ---------------------------------------------------------------

    def _start_inotify(self, lib: _Inotify) -> bool:
        fd = lib.init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            log.info("inotify_init1 failed, polling instead", path=str(self.path), errno=ctypes.get_errno())
            return False
        self._lib, self._fd = lib, fd
        if not self._arm():
            os.close(fd)
            self._fd = -1
            return False
        asyncio.get_running_loop().add_reader(fd, self._on_readable)
        return True

    def _add_watch(self, path: Path, mask: int) -> int:
        assert self._lib is not None
        return int(self._lib.add_watch(self._fd, os.fsencode(path), mask | IN_ONLYDIR))

    def _arm(self) -> bool:
        """Watch the directory, or its nearest existing ancestor; False if nothing can be watched.

        The new watch is added before the old one is removed, so no event falls between them;
        ``inotify_add_watch`` on the inode already watched returns the same descriptor (with the
        new mask), which is then kept. The old watch's ``IN_IGNORED`` is skipped by wd mismatch.
        """
        assert self._lib is not None
        old_wd, was_target = self._wd, self._watching_target
        candidate = self.path
        while True:
            is_target = candidate == self.path
            wd = self._add_watch(candidate, (TARGET_MASK | SELF_MASK) if is_target else ANCESTOR_MASK)
            if wd >= 0:
                if old_wd >= 0 and wd != old_wd:
                    self._lib.rm_watch(self._fd, old_wd)  # EINVAL if the kernel dropped it: fine
                self._wd, self._watching_target = wd, is_target
                if is_target and not was_target and self._armed_once:
                    # it appeared: whatever is in it counts as new (not on the first arm,
                    # where nothing has changed yet)
                    self._report(set(_listing(self.path)))
                self._armed_once = True
                return True
            err = ctypes.get_errno()
            if err in (errno.ENOENT, errno.ENOTDIR) and candidate.parent != candidate:
                candidate = candidate.parent
                continue
            log.info("inotify_add_watch failed, polling instead", path=str(candidate), errno=err)
            return False

    def _read(self) -> bytes:
        """One read of queued events (a seam for tests that fake kernel events)."""
        return os.read(self._fd, _READ_SIZE)

    def _on_readable(self) -> None:
        try:
            data = self._read()
        except BlockingIOError:
            return
        except OSError as exc:
            log.warning("inotify read failed", path=str(self.path), error=str(exc))
            return
        names: set[str] = set()
        rearm = rescan = False
        offset = 0
        while offset + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            raw = data[offset + _EVENT.size : offset + _EVENT.size + length]
            offset += _EVENT.size + length
            name = os.fsdecode(raw.rstrip(b"\0"))
            if mask & IN_Q_OVERFLOW:
                # events were dropped, perhaps the directory's own IN_DELETE_SELF/IN_IGNORED
                # too: look again at what is there and make sure the watch is on it
                log.warning("inotify queue overflowed, rescanning", path=str(self.path))
                rescan = rearm = True
                continue
            if wd != self._wd:
                continue
            if self._watching_target:
                if mask & (SELF_MASK | IN_IGNORED):
                    # the directory went away (perhaps already re-created): what was in it is
                    # unknown; whatever is there when we watch again is reported as new
                    self._watching_target = False
                    rescan = rearm = True
                elif name:
                    names.add(name)
            elif mask & (SELF_MASK | IN_IGNORED) or name:
                # something appeared in (or happened to) an ancestor: try to get closer
                rearm = True
        if rearm and not self._arm():
            self._report(names)
            self._switch_to_polling()
            return
        if rescan:
            names |= {RESCAN, *_listing(self.path)}
        self._report(names)

    def _switch_to_polling(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._fd)
        os.close(self._fd)
        self._fd = self._wd = -1
        snapshot = _listing(self.path)
        # events may have been lost on the way here: say so, with what is there now
        self._report({RESCAN, *snapshot})
        self._poll_task = loop.create_task(self._poll(snapshot), name=f"fswatch-poll:{self.path}")

    # --- polling ---------------------------------------------------------------

    async def _poll(self, previous: dict[str, tuple[int, int, int, int]]) -> None:
        while True:
            await self._sleep(self.poll_interval)
            current = _listing(self.path)
            changed = {n for n in previous.keys() | current.keys() if previous.get(n) != current.get(n)}
            previous = current
            self._report(changed)


def _listing(path: Path) -> dict[str, tuple[int, int, int, int]]:
    """name -> (inode, size, mtime_ns, ctime_ns) for the entries of ``path``; empty if missing."""
    out: dict[str, tuple[int, int, int, int]] = {}
    try:
        entries = list(os.scandir(path))
    except OSError:
        return out
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        out[entry.name] = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out
