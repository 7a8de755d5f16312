"""LoRA adapters loaded at run time (`POST /v1/load_lora_adapter`) on a replica set: on every replica or none.

The front end's load and unload are utility calls, broadcast to every live replica like any other
(`ReplicaSet._utility`). This room keeps the set's replicas agreeing on which adapters they serve:
- a load that failed on some replica (its file unreadable there, the name taken there) is undone on the
  replicas where it succeeded, so that the caller's error holds for the whole set and a retry starts clean;
- a replica started again after a death gets the adapters loaded at run time since the set started, before
  any request can reach it (the loads go out before the router sees it alive, and a core runs its messages
  in order);
- the answers merge as the front end reads them: in-flight requests and the requests an unload ended are
  summed over the replicas.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

LOAD, UNLOAD = "load_lora", "unload_lora"

# How the replicas' answers to the LoRA calls merge (the rest of the set's merges: replica_set._MERGE).
MERGE: dict[str, Callable[[list[Any]], Any]] = {
    "lora_in_flight": sum,  # requests of the adapter still running, on every replica
    UNLOAD: sum,  # the requests the unload ended, on every replica
}

# A utility call the set sends to one replica: (replica index, call name, its arguments).
ReplicaCall = tuple[int, str, list[Any]]


class RuntimeAdapters:
    """The adapters loaded at run time on every replica (name -> path), and the calls that keep it so."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}

    def answered(self, name: str, args: list[Any], succeeded: list[int], failed: bool) -> list[ReplicaCall]:
        """A broadcast call answered by every replica (`succeeded`: those that did not fail): what it
        changed here, and the calls that undo a load some replica refused on those that took it."""
        if name == LOAD:
            adapter, path = args[0], args[1]
            if not failed:
                self.loaded[adapter] = path
                return []
            if succeeded:
                logger.warning("LoRA adapter %s failed to load on some replica: unloading it from replicas %s",
                               adapter, succeeded)
            return [(index, UNLOAD, [adapter]) for index in succeeded]
        if name == UNLOAD and (not failed or succeeded):  # gone from at least one replica: not replayed
            self.loaded.pop(args[0], None)
        return []

    def replays(self, index: int) -> list[ReplicaCall]:
        """The loads a replica started again needs to serve what the others serve."""
        return [(index, LOAD, [name, path]) for name, path in self.loaded.items()]
