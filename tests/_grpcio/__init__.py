"""Generated grpcio stubs for tests (scripts/gen-proto.sh). Do not edit."""
