"""Read-only access to the Kubernetes API server: the client and the node-label source."""
