"""ResourceSlices: what this node offers through DRA, planned purely and kept written on the API server."""
