"""The kubelet device plugin (deviceplugin v1beta1) for GPUs owned by ``device-plugin``."""
