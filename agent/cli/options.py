"""Options that several commands take, defined once so that each reads the same everywhere.

Every command that reads NVML (``run``, ``inventory``, ``config plan``, ``cdi generate``) finds
``libnvidia-ml.so.1`` under the driver root, so each takes ``--driver-root``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

DriverRootOpt = Annotated[
    Path | None,
    typer.Option(
        "--driver-root",
        help="Where the NVIDIA driver's files live (libnvidia-ml.so.1): / (default) or e.g. /run/nvidia/driver.",
        readable=False,
    ),
]
HostDriverRootOpt = Annotated[
    Path | None,
    typer.Option(
        "--host-driver-root",
        help="Where the host's container runtime sees the driver root, if not where this command does (CDI specs).",
        readable=False,
    ),
]
