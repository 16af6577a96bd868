"""The NVML backend: real GPUs through NVIDIA's ``nvidia-ml-py`` binding (module ``pynvml``)."""
