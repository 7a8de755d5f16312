"""The replica set's own calls: what the admin routes and the dashboard ask of the cluster.

They travel as ordinary utility calls (`AsyncEngine.utility(name, ...)`), so they run on the front end's
engine thread between two turns of its loop, like every other change to the set's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Protocol

from tokenloop.cluster.errors import ClusterError
from tokenloop.cluster.handoff_flow import HandoffFlow, HandoffStats
from tokenloop.cluster.members import ReplicaHost
from tokenloop.cluster.router import Router, RouteRequest


class ReplicaSetAdmin(ReplicaHost, Protocol):
    """The replica set as its admin calls see it (`ReplicaSet` is one): they run on it, never import it."""

    router: Router
    failover: str
    handoffs: HandoffFlow

    def status(self) -> list[dict[str, Any]]: ...
    def handoff_stats(self) -> HandoffStats: ...
    def owner(self, request_id: str) -> int | None: ...
    def request_ids(self) -> list[str]: ...


def replicas_status(replicas: ReplicaSetAdmin) -> dict[str, Any]:
    return {"replicas": replicas.status(), "router": replicas.router.name, "failover": replicas.failover,
            "handoffs": replicas.handoff_stats().as_dict(),
            "in_flight": [{"request_id": h.request_id, "source": h.source, "destination": h.destination,
                           "stage": h.stage, "reason": h.reason}
                          for h in replicas.handoffs.in_flight.values()]}


def drain(replicas: ReplicaSetAdmin, index: int) -> dict[str, Any]:
    """Admit nothing new on replica `index` and move its running requests to the others."""
    replica = replicas.replica(index)
    others = [r for r in replicas.replicas if r.alive and r.admitting and r.index != index]
    if not others:
        raise ClusterError(f"replica {index} is the last replica that admits work: draining it would "
                           "leave nowhere to run requests")
    replica.admitting = False
    replicas.tracker.set_admitting(index, False)
    moving = []
    for request_id in replicas.requests_on(index):
        if request_id in replicas.handoffs.in_flight:
            continue
        owned = replicas.owned(request_id)
        assert owned is not None
        request = owned.request
        tokens = [*request.prompt_token_ids, *owned.output_token_ids]
        decision = replicas.router.route(RouteRequest(request_id, tokens, request.cache_salt, request.user),
                                         replicas.tracker.views())
        replicas.handoffs.start(request_id, decision.replica, "drain")
        moving.append({"request_id": request_id, "destination": decision.replica})
    return {"replica": index, "admitting": False, "moving": moving}


def undrain(replicas: ReplicaSetAdmin, index: int) -> dict[str, Any]:
    replica = replicas.replica(index)
    if not replica.alive:
        raise ClusterError(f"replica {index} is not alive ({replica.death})")
    replica.admitting = True
    replicas.tracker.set_admitting(index, True)
    return {"replica": index, "admitting": True}


def migrate(replicas: ReplicaSetAdmin, request_id: str, destination: int | None = None) -> dict[str, Any]:
    """Move a running request (each of its samples when n > 1) to replica `destination` (default: the
    least loaded other live replica): live migration, pre-copy of its full blocks while it decodes, then
    a short pause for the tail."""

    if destination is not None:
        replicas.replica(destination)
    ids = [request_id] if replicas.owned(request_id) is not None else [
        rid for rid in replicas.request_ids() if rid.startswith(f"{request_id}#")]
    if not ids:
        raise ClusterError(f"request {request_id!r} is not running in this cluster", status=404)
    moved = []
    for core_id in ids:
        target = destination
        if target is None:
            source = replicas.owner(core_id)
            target = replicas.handoffs.least_loaded(i for i in range(len(replicas.replicas)) if i != source)
            if target is None:
                raise ClusterError("no other live replica to migrate to")
        handoff = replicas.handoffs.start(core_id, target, "migrate")
        moved.append({"request_id": core_id, "source": handoff.source, "destination": target})
    return {"moving": moved}


# The set calls these with itself first: typed so, mypy checks `ReplicaSet` against `ReplicaSetAdmin` there.
CLUSTER_CALLS: dict[str, Callable[Concatenate[ReplicaSetAdmin, ...], Any]] = {
    "cluster_status": replicas_status,
    "cluster_drain": drain,
    "cluster_undrain": undrain,
    "cluster_migrate": migrate,
}
