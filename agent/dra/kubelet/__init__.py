"""The kubelet-facing side of DRA: the plugin's sockets, its gRPC services, registration and the health stream."""
