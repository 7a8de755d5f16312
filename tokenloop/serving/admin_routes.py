"""/admin/*: the operator's routes for a server with several engine replicas (behind the API key).

    GET  /admin/replicas                    each replica's state, the router, handoff counts
    POST /admin/replicas/{index}/drain      admit nothing new there; its running requests move to the others
    POST /admin/replicas/{index}/undrain    admit work there again
    POST /admin/requests/{request_id}/migrate[?to=K]  move a running request (to K, or the least loaded)

They call the replica set's own calls (`tokenloop.cluster.admin`) on the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from tokenloop.errors import ReplicaNotFoundError
from tokenloop.serving.errors import clipped


def make_admin_router(get_engine: Callable[[], Any]) -> APIRouter:
    router = APIRouter(prefix="/admin")

    async def cluster_call(name: str, *args: Any) -> JSONResponse:
        engine = get_engine()
        if not getattr(engine.client, "is_replica_set", False):
            raise ReplicaNotFoundError("this server runs one engine core: there are no replicas to manage "
                                       "(start it with --replicas N)")
        return JSONResponse(await engine.utility(name, *args))

    def replica_index(index: str) -> int:
        try:
            return int(index)
        except ValueError:
            engine = get_engine()
            count = len(getattr(engine.client, "replicas", []))
            raise ReplicaNotFoundError(f"no replica {clipped(index)!r}: the valid indices are "
                                       f"0..{count - 1}") from None

    @router.get("/replicas")
    async def replicas() -> JSONResponse:
        return await cluster_call("cluster_status")

    @router.post("/replicas/{index}/drain")
    async def drain(index: str) -> JSONResponse:
        return await cluster_call("cluster_drain", replica_index(index))

    @router.post("/replicas/{index}/undrain")
    async def undrain(index: str) -> JSONResponse:
        return await cluster_call("cluster_undrain", replica_index(index))

    @router.post("/requests/{request_id}/migrate")
    async def migrate(request_id: str, to: str | None = None) -> JSONResponse:
        return await cluster_call("cluster_migrate", request_id, None if to is None else replica_index(to))

    return router
