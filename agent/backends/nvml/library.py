"""Loading ``libnvidia-ml.so.1`` from the driver root into the NVML binding.

nvidia-ml-py loads the library on the first ``nvmlInit`` with ``CDLL("libnvidia-ml.so.1")``,
i.e. from the process's own loader path. In a DaemonSet pod, or with a driver container, the
driver's libraries are not there: they are under ``paths.driver_root``. Like NVIDIA's device
plugin (go-nvml ``WithLibraryPath``), the agent finds the library under the driver root
(:func:`agent.backends.driverroot.find_library`, the lookup CDI discovery uses) and hands it to the
binding before ``nvmlInit``: the binding keeps its library in the module global ``nvmlLib``
(guarded by ``libLoadLock``) and only loads its default when that is still None.

When nothing is found under the driver root the binding's own default is tried, so a process
whose loader path does have the driver (a host install with ``driver_root: /``, or a
container the NVIDIA runtime prepared) keeps working.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from agent.backends.driverroot import find_library

SONAME = "libnvidia-ml.so.1"

#: loads a shared library; ``ctypes.CDLL`` in production
LibraryLoader = Callable[[str], object]


class BindingUnsupported(Exception):
    """The binding has no ``nvmlLib``/``libLoadLock`` globals to load the library through."""


@dataclass(frozen=True, slots=True)
class LibraryChoice:
    """Which library ``nvmlInit`` is about to use, and where it was looked for."""

    path: Path | None  # None: the binding's default (the process's loader path)
    searched: str  # one line: where the driver root was searched and what was found


def locate(driver_root: Path, machine: str | None = None) -> LibraryChoice:
    """The library under the driver root, or the binding's default when there is none. Blocking."""
    search = find_library(driver_root, SONAME, machine)
    return LibraryChoice(path=search.found, searched=search.describe())


def bind(nvml: ModuleType, path: Path, loader: LibraryLoader = ctypes.CDLL) -> bool:
    """Make ``path`` the binding's library unless one is loaded already; True when it was bound now.

    Raises OSError when the file does not load (not a library, wrong architecture) and
    BindingUnsupported when the binding cannot be given a library. A library once loaded
    stays for the life of the process (the binding offers no unload), so a later call with
    another path changes nothing and answers False.
    """
    lock = getattr(nvml, "libLoadLock", None)
    if lock is None or not hasattr(nvml, "nvmlLib"):
        raise BindingUnsupported(
            "this NVML binding (module pynvml) cannot be pointed at a library path; "
            "install nvidia-ml-py, whose pynvml keeps the library in pynvml.nvmlLib"
        )
    with lock:
        if getattr(nvml, "nvmlLib", None) is not None:
            return False
        setattr(nvml, "nvmlLib", loader(str(path)))  # noqa: B010  (the binding's module global)
        return True


def loaded(nvml: ModuleType) -> bool:
    """Whether the binding holds a library already (ours or its default)."""
    return getattr(nvml, "nvmlLib", None) is not None
