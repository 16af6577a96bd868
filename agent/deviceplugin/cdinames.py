"""What the device plugin needs from the CDI service (``agent.cdi.service.CdiService``)."""

from __future__ import annotations

from typing import Protocol


class CdiNames(Protocol):
    """Qualified CDI names for the devices the plugin hands out.

    The plugin never writes spec files; before it returns CDI names to the kubelet it asks
    the CDI service to make sure the spec that defines them is on disk.
    """

    def device_name(self, device_uuid: str) -> str:
        """The fully-qualified name (``vendor/class=name``) of a GPU or MIG device by UUID."""
        ...

    async def ensure_device_plugin_spec(self) -> None:
        """Make sure the device-plugin spec file exists and is current; idempotent."""
        ...
