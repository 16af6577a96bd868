"""Generated protobuf code (scripts/gen-proto.sh). Do not edit."""
