"""Choose and open the device backend the config asks for.

``auto`` means NVML when it is there and otherwise a node with no GPUs. Simulated devices
are only ever chosen explicitly, so a real node can never advertise fake GPUs.
"""

from __future__ import annotations

import structlog

from agent.config.schema import Config
from agent.inventory.backend import Backend, NullBackend

log = structlog.get_logger("agent.inventory")


async def open_backend(config: Config, *, node_name: str | None = None) -> Backend:
    """An opened backend; raises an AgentError subclass (one-line message) on failure."""
    backend: Backend
    if config.backend == "simulated":
        from agent.inventory.simulated import SimulatedBackend

        backend = SimulatedBackend(preset=config.preset, node_name=node_name or config.node_name, health=config.health)
    elif config.backend == "nvml":
        from agent.inventory.nvml import NvmlBackend

        backend = NvmlBackend(health=config.health)
    else:
        from agent.inventory.nvml import NvmlBackend, nvml_available

        if await nvml_available():
            backend = NvmlBackend(health=config.health)
        else:
            log.info("NVML not available or no GPUs visible; running as a node with no GPUs")
            backend = NullBackend("NVML not available or no GPUs visible")
    try:
        await backend.open()
    except BaseException:
        await backend.close()
        raise
    return backend
