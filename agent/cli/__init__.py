"""``gpu-agent``: the command line."""
