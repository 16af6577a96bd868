"""gpu-node-agent: NVIDIA GPUs for Kubernetes through device plugins, DRA and CDI at once."""

import sys

__version__ = "0.1.0"


def _import_structlog_without_rich() -> None:
    """structlog imports rich, when it can, for pretty tracebacks on a terminal: about 5 MiB of
    RSS and a tenth of a second at every start, for output the agent does not make (JSON lines
    in the cluster; plain tracebacks on a terminal do). Import structlog while rich reads as
    absent; rich stays importable for whoever asks later (typer's help and usage errors)."""
    if "structlog" in sys.modules or "rich" in sys.modules:
        return
    sys.modules["rich"] = None  # type: ignore[assignment]  # `import rich` raises ImportError
    try:
        import structlog  # noqa: F401
    finally:
        del sys.modules["rich"]


_import_structlog_without_rich()
