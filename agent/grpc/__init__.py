"""gRPC plumbing shared by every server: Unix sockets, connection and call caps, wire-shape checks, write coalescing."""
