"""Access to the Kubernetes API server: one client, discovery, the node-label source, events."""
