"""Where the driver root is, as the agent sees it and as the host's container runtime sees it.

The agent usually runs in a DaemonSet pod that mounts the driver root somewhere of its own:
the host's ``/run/nvidia/driver`` at ``/driver-root``, or the host's ``/`` at ``/host``.
Discovery looks (stat, linker cache, listings) under the agent's path; every host path a spec
names (device node and mount ``hostPath``, the hook binary) is read by the runtime on the
host, so it is written under the host's path. Container paths never change.

Same rule as NVIDIA's root transformer (nvidia-container-toolkit ``pkg/nvcdi/transform/root``):
a path under the agent's root is moved under the host's root, component by component; a path
outside it (``/dev`` of a driver container, a hook binary found elsewhere) is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True, slots=True)
class RootMapping:
    """``container_root``: the driver root as the agent sees it; ``host_root``: as the runtime sees it."""

    container_root: Path
    host_root: Path

    @classmethod
    def same(cls, root: Path) -> RootMapping:
        """No translation: the agent sees the driver root where the runtime does."""
        return cls(container_root=root, host_root=root)

    @property
    def is_identity(self) -> bool:
        return PurePosixPath(self.container_root) == PurePosixPath(self.host_root)

    def host_path(self, path: str) -> str:
        """``path`` (an agent-visible absolute path) as the runtime on the host sees it.

        Identity mappings return ``path`` untouched, so specs stay byte for byte what they
        were before host roots existed.
        """
        if self.is_identity:
            return path
        try:
            relative = PurePosixPath(path).relative_to(PurePosixPath(self.container_root))
        except ValueError:
            return path  # outside the driver root: not the driver's file, the host sees it as is
        return str(PurePosixPath(self.host_root) / relative)
