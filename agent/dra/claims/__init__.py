"""Claim preparation: the domain behind NodePrepareResources and NodeUnprepareResources, and its checkpoint."""
