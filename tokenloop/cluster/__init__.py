"""Many engine cores behind one front door: replicas, routing, handoff (see docs/layout.md).

Submodules are imported directly (`from tokenloop.cluster.router import make_router`); this package
re-exports the router's public names for convenience.
"""

from tokenloop.cluster.load import LoadTracker, ReplicaLoad
from tokenloop.cluster.router import (
    ROUTERS,
    Dispatcher,
    NoReplicaError,
    RouteDecision,
    Router,
    RouterConfig,
    RouteRequest,
    make_router,
)
from tokenloop.cluster.step_costs import StepCosts

__all__ = ["ROUTERS", "Dispatcher", "LoadTracker", "NoReplicaError", "ReplicaLoad", "RouteDecision", "RouteRequest",
           "Router", "RouterConfig", "StepCosts", "make_router"]
