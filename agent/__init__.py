"""gpu-node-agent: NVIDIA GPUs for Kubernetes through device plugins, DRA and CDI at once."""

__version__ = "0.1.0"
