"""Where the container edits of a spec come from: the installed driver, or a simulated one.

The service picks one :class:`DriverSource` when it is built (:func:`choose_driver_source`)
and asks it for a fresh :class:`~agent.cdi.generate.DriverView` on every reconcile pass and
device plugin spec check; claim writes reuse the last look at the same inventory for up to one
reconcile interval. Nothing else in the package knows which mode it is in.

* ``installed``: :class:`~agent.cdi.discovery.DriverDiscovery` looks at the driver root
  (device nodes, libraries, hooks). Every NVML node, and a simulated node whose driver
  root holds a (fake) driver, e.g. ``--driver-root`` in the tests.
* ``simulated``: the inventory's backend is ``simulated`` and the driver root exists but
  holds no NVIDIA driver libraries (a kind node, a laptop). Like the dra-example-driver's
  fake GPUs, devices get environment variables only, no device nodes, mounts or hooks:

  - spec level: ``GPU_AGENT_SIMULATED=true``;
  - a GPU: ``GPU_AGENT_SIMULATED_GPU_<gpu index>=<uuid>``;
  - a MIG device: ``GPU_AGENT_SIMULATED_MIG_<gpu index>_<mig index>=<uuid>``;
  - ``all``: every one of those.

  The names are per device, so a container with several devices sees each of them, and
  none starts with ``NVIDIA_``: NVIDIA's runtime hook never acts on a simulated device.
  The recorded driver version is the inventory's ``driver_version``.

A driver root that does not exist is not "no driver": it stays ``installed``, so a mistyped
``--driver-root`` is reported by every pass instead of being papered over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import structlog

from agent.cdi import generate
from agent.cdi.discovery import DriverDiscovery
from agent.cdi.errors import DriverDiscoveryError
from agent.cdi.spec import ContainerEdits
from agent.core.inventory.model import Gpu, Inventory, MigDevice

log = structlog.get_logger("agent.cdi")

DriverMode = Literal["installed", "simulated"]
SIMULATED_BACKEND = "simulated"
SIMULATED_ENV = "GPU_AGENT_SIMULATED=true"
ENV_PREFIX = "GPU_AGENT_SIMULATED_"


def gpu_env(gpu: Gpu) -> str:
    return f"{ENV_PREFIX}GPU_{gpu.index}={gpu.uuid}"


def mig_env(gpu: Gpu, mig: MigDevice) -> str:
    return f"{ENV_PREFIX}MIG_{gpu.index}_{mig.index}={mig.uuid}"


class DriverSource(Protocol):
    """Hands the generator one look at the driver. ``look`` blocks: call it in a worker thread."""

    @property
    def mode(self) -> DriverMode: ...

    def look(self, inventory: Inventory) -> generate.DriverView: ...


@dataclass(frozen=True, slots=True)
class SimulatedDriver:
    """A driver that is only environment variables; every device always has its edits."""

    version: str

    def common_edits(self) -> ContainerEdits:
        return ContainerEdits(env=(SIMULATED_ENV,))

    def gpu_edits(self, gpu: Gpu) -> ContainerEdits:
        return ContainerEdits(env=(gpu_env(gpu),))

    def mig_edits(self, gpu: Gpu, mig: MigDevice) -> ContainerEdits:
        return ContainerEdits(env=(mig_env(gpu, mig),))


class SimulatedDriverSource:
    mode: DriverMode = "simulated"

    def look(self, inventory: Inventory) -> SimulatedDriver:
        return SimulatedDriver(version=inventory.driver_version)


class InstalledDriverSource:
    mode: DriverMode = "installed"

    def __init__(self, discovery: DriverDiscovery) -> None:
        self.discovery = discovery

    def look(self, inventory: Inventory) -> generate.DriverView:
        return self.discovery.discover(
            generate.gpu_minors(inventory),
            generate.cap_minors(inventory),
            buses=[gpu.short_bus_id for gpu in inventory],
            driver_version=inventory.driver_version,
        )


def choose_driver_source(backend: str, discovery: DriverDiscovery) -> DriverSource:
    """The one place the mode is decided; blocking for a simulated backend (a few listings).

    Decided once: a simulated node does not grow a driver, and a real one whose libraries
    vanish for a moment (a driver container upgrading) must not flip to env-only specs.
    """
    if backend != SIMULATED_BACKEND:
        return InstalledDriverSource(discovery)
    root = discovery.driver_root
    try:
        versions = discovery.installed_versions()
    except DriverDiscoveryError as exc:
        log.warning("cdi.driver_root_unusable", driver_root=str(root), error=str(exc), mode="installed")
        return InstalledDriverSource(discovery)
    if versions:
        log.info("cdi.driver_source", mode="installed", driver_root=str(root), versions=sorted(versions))
        return InstalledDriverSource(discovery)
    log.info(
        "cdi.driver_source",
        mode="simulated",
        driver_root=str(root),
        reason="simulated GPUs and no NVIDIA driver libraries under the driver root: env-only specs",
    )
    return SimulatedDriverSource()
