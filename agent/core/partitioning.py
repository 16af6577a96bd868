"""Carving a GPU at run time: MIG instances created and destroyed on demand, MPS control daemons.

What DRA's dynamic MIG and shared modes ask of the hardware, as two small interfaces. The
backends implement them (``agent.backends``: NVML on a real node, the simulated backend
elsewhere) and the composition root hands them to DRA, which never names a backend. A feature
the node lacks is a null object whose every call raises :class:`PartitionError` with kind
``NOT_SUPPORTED``.

Physical facts the implementations respect (NVIDIA's MIG user guide; ``nvml.h``):

* a GPU instance is created at an explicit placement (memory slices ``[start, start+size)``);
  creating one over occupied slices fails with NVML_ERROR_INSUFFICIENT_RESOURCES;
* :meth:`MigControl.create` makes the GPU instance and the one compute instance spanning it;
  when the compute instance cannot be made it destroys the GPU instance again before raising
  (never half-created);
* MIG mode changes only with no process on the GPU and, before Hopper, a reset. So
  :meth:`MigControl.create` on a GPU whose MIG mode is off switches it on first where that
  needs no reset (Hopper and later; ``IN_USE`` while something runs on it) and answers
  ``MIG_DISABLED`` elsewhere; destroying the last instance on a GPU switched on that way
  switches it back off, so the whole GPU can be handed out again. This is what NVIDIA's DRA
  driver does (NVIDIA/k8s-dra-driver-gpu ``cmd/gpu-kubelet-plugin/nvlib.go``, tag v0.4.0).
* instances made or destroyed show in the backend's next ``load()`` (the parent's
  ``mig_devices`` and ``mig_enabled``); nothing here refreshes the inventory.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from agent.base.errors import AgentError
from agent.core.inventory.model import MigDevice, MigPlacement


class PartitionErrorKind(StrEnum):
    #: the instance or the GPU is in use (NVML_ERROR_IN_USE)
    IN_USE = "in-use"
    #: the placement is taken or the GPU has no room (NVML_ERROR_INSUFFICIENT_RESOURCES)
    INSUFFICIENT_RESOURCES = "insufficient-resources"
    #: the GPU or the driver cannot do this (NVML_ERROR_NOT_SUPPORTED; no MIG; no MPS binary)
    NOT_SUPPORTED = "not-supported"
    #: the GPU is not in MIG mode (or has a mode change pending)
    MIG_DISABLED = "mig-disabled"
    #: the instance is already gone (destroy is then done)
    NOT_FOUND = "not-found"
    #: the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)
    GPU_LOST = "gpu-lost"
    #: anything else, with NVML's words in the message
    FAILED = "failed"


class PartitionError(AgentError):
    """A create, destroy or daemon operation failed; ``kind`` says why, the message says what."""

    def __init__(self, message: str, *, kind: PartitionErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


class MigControl(Protocol):
    """Creates and destroys MIG instances on this node's GPUs. Calls never block the event loop."""

    async def create(self, parent_uuid: str, profile_id: int, placement: MigPlacement) -> MigDevice:
        """A new GPU instance of ``profile_id`` at ``placement`` with one full compute instance.

        The answer names the new MIG device (UUID, instance IDs, capability minors, profile and
        placement). Raises :class:`PartitionError`; on any failure nothing is left behind.
        """
        ...

    async def destroy(self, parent_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        """Destroy the compute instance, then the GPU instance. ``NOT_FOUND`` when already gone."""
        ...

    async def instances(self, parent_uuid: str) -> tuple[MigDevice, ...]:
        """The MIG devices that exist on ``parent_uuid`` now, whoever made them."""
        ...


@dataclass(frozen=True, slots=True)
class MpsDaemon:
    """One running MPS control daemon, as a container needs to reach it."""

    gpu_uuid: str
    #: CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY on the host (mounted into containers)
    pipe_dir: Path
    log_dir: Path


class MpsControl(Protocol):
    """Runs and supervises one MPS control daemon per shared GPU."""

    async def ensure(self, gpu_uuid: str) -> MpsDaemon:
        """The GPU's daemon, started if it is not running. Raises :class:`PartitionError`."""
        ...

    async def set_limits(self, gpu_uuid: str, *, active_thread_percentage: int, pinned_memory_mib: int) -> None:
        """Defaults the daemon gives new clients on ``gpu_uuid``. Raises :class:`PartitionError`."""
        ...

    async def release(self, gpu_uuid: str) -> None:
        """Stop the GPU's daemon (no share needs it any more); idempotent."""
        ...

    def status(self) -> dict[str, object]:
        """JSON-ready state for ``/debug/state``: the daemons, their directories, last errors."""
        ...


class NoMig:
    """A node or backend that cannot make MIG instances."""

    def __init__(self, reason: str = "MIG instances cannot be created on this node") -> None:
        self.reason = reason

    async def create(self, parent_uuid: str, profile_id: int, placement: MigPlacement) -> MigDevice:
        raise PartitionError(self.reason, kind=PartitionErrorKind.NOT_SUPPORTED)

    async def destroy(self, parent_uuid: str, gpu_instance_id: int, compute_instance_id: int) -> None:
        raise PartitionError(self.reason, kind=PartitionErrorKind.NOT_SUPPORTED)

    async def instances(self, parent_uuid: str) -> tuple[MigDevice, ...]:
        return ()


class NoMps:
    """A node or backend without MPS."""

    def __init__(self, reason: str = "MPS is not available on this node") -> None:
        self.reason = reason

    async def ensure(self, gpu_uuid: str) -> MpsDaemon:
        raise PartitionError(self.reason, kind=PartitionErrorKind.NOT_SUPPORTED)

    async def set_limits(self, gpu_uuid: str, *, active_thread_percentage: int, pinned_memory_mib: int) -> None:
        raise PartitionError(self.reason, kind=PartitionErrorKind.NOT_SUPPORTED)

    async def release(self, gpu_uuid: str) -> None:
        return None

    def status(self) -> dict[str, object]:
        return {"enabled": False, "reason": self.reason}
