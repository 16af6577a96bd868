"""Where the driver root is, as the agent sees it and as the host's container runtime sees it.

The agent usually runs in a DaemonSet pod that mounts the driver root somewhere of its own:
the host's ``/run/nvidia/driver`` at ``/driver-root``, or the host's ``/`` at ``/host``.
Discovery looks (stat, linker cache, listings) under the agent's path; every host path a spec
names (device node and mount ``hostPath``, the hook binary) is read by the runtime on the
host, so it is written under the host's path. Container paths never change.

Same rule as NVIDIA's root transformer (nvidia-container-toolkit ``pkg/nvcdi/transform/root``):
a path under the agent's root is moved under the host's root, component by component; a path
outside it (``/dev`` of a driver container, a hook binary found elsewhere) is left as it is.

The host's own ``/`` is visible to the agent too when the mapping says where: with
``host_root`` ``/`` the driver root *is* the host's root, and with the host's ``/`` mounted at
``/host`` and ``driver_root: /host/run/nvidia/driver``, ``host_root: /run/nvidia/driver``, it
is ``/host``. Discovery then looks there for the host's live ``/dev`` and for the hook binary.
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

    def visible_host_root(self) -> Path | None:
        """Where the agent sees the host's ``/``, when the mapping tells; else None."""
        container, host = PurePosixPath(self.container_root), PurePosixPath(self.host_root)
        if self.is_identity:
            return None  # nothing says where the host is: the roots are only equal
        if host == PurePosixPath("/"):
            return Path(container)
        if len(container.parts) > len(host.parts) and container.parts[-(len(host.parts) - 1) :] == host.parts[1:]:
            return Path(*container.parts[: len(container.parts) - len(host.parts) + 1])
        return None

    def host_path(self, path: str) -> str:
        """``path`` (an agent-visible absolute path) as the runtime on the host sees it.

        Identity mappings return ``path`` untouched, so specs stay byte for byte what they
        were before host roots existed.
        """
        if self.is_identity:
            return path
        pure = PurePosixPath(path)
        try:
            relative = pure.relative_to(PurePosixPath(self.container_root))
        except ValueError:
            pass
        else:
            return str(PurePosixPath(self.host_root) / relative)
        visible = self.visible_host_root()
        if visible is not None and visible != Path("/"):
            try:
                return str(PurePosixPath("/") / pure.relative_to(PurePosixPath(visible)))
            except ValueError:
                pass
        return path  # outside both roots: not the driver's file, the host sees it as is

    def agent_path(self, host_path: Path) -> Path | None:
        """Where the agent sees the host's ``host_path``; None when it cannot tell."""
        pure = PurePosixPath(host_path)
        try:
            return Path(self.container_root) / pure.relative_to(PurePosixPath(self.host_root))
        except ValueError:
            pass
        visible = self.visible_host_root()
        if visible is not None:
            return visible / pure.relative_to("/")
        return None
