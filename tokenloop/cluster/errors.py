"""The errors of the cluster's own calls, below every room of `cluster/` that raises them."""

from __future__ import annotations

from tokenloop.errors import ClusterConflictError, ReplicaNotFoundError, TokenloopError


def ClusterError(message: str, status: int = 409) -> TokenloopError:  # named and raised like a class
    """The error of a cluster call the set cannot do: 404 for an unknown replica or request, 409 else."""
    return ReplicaNotFoundError(message) if status == 404 else ClusterConflictError(message)
