"""The running process: the composition root, the running agent's derived state, the event loop."""
