"""Device backends behind one protocol: NVML for real GPUs, presets for simulated ones; the driver root's files."""
