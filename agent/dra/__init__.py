"""DRA: the kubelet DRA plugin, ResourceSlices and prepared claims for GPUs owned by ``dra``."""
