"""Choose and open the device backend the config asks for.

``auto`` and ``nvml`` both get the NVML backend, which waits for its driver instead of
failing: it finds ``libnvidia-ml.so.1`` under ``paths.driver_root`` and answers an empty
inventory with the reason until the library loads and NVML initialises (a driver container
may become ready minutes after the agent). The difference is readiness: ``nvml`` is not ready
while it waits, ``auto`` is (a node with no GPUs). Only a missing Python binding, which
never fixes itself, makes ``nvml`` fail at start; ``auto`` then idles as a node with no GPUs.
Simulated devices are only ever chosen explicitly, so a real node can never advertise fake GPUs.
"""

from __future__ import annotations

import structlog

from agent.backends.backend import Backend, NullBackend
from agent.base.errors import LibraryMissingError
from agent.core.config.schema import Config

log = structlog.get_logger("agent.inventory")

#: MPS daemons' directories, under the agent's state directory
MPS_DIR = "mps"


async def open_backend(config: Config, *, node_name: str | None = None, wait_for_driver: bool = True) -> Backend:
    """An opened backend; raises an AgentError subclass (one-line message) on failure.

    ``wait_for_driver=False`` is for one-shot commands: ``--backend nvml`` on a node where
    NVML cannot be loaded raises its one-line error at once instead of waiting for it.
    """
    backend: Backend
    if config.backend == "simulated":
        from agent.backends.simulated import SimulatedBackend

        backend = SimulatedBackend(
            preset=config.preset,
            node_name=node_name or config.node_name,
            health=config.health,
            mps_dir=config.state_dir / MPS_DIR,
        )
    else:
        from agent.backends.nvml.backend import NvmlBackend, import_binding

        try:
            binding = import_binding()
        except LibraryMissingError as exc:
            if config.backend == "nvml":
                raise
            log.info("running as a node with no GPUs", reason=str(exc))
            backend = NullBackend(str(exc))
        else:
            backend = NvmlBackend(
                health=config.health,
                driver_root=config.paths.driver_root,
                required=config.backend == "nvml",
                wait_for_driver=wait_for_driver,
                nvml=binding,
                mps_dir=config.state_dir / MPS_DIR,
            )
    try:
        await backend.open()
    except BaseException:
        await backend.close()
        raise
    return backend
