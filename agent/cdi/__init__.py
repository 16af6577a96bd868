"""CDI: spec files that tell the container runtime how to hand a GPU to a container.

Both mechanisms (device plugin, DRA) call :class:`agent.cdi.service.CdiService`; neither
writes spec files itself.
"""
