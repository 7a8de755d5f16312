"""What the replica set's helper rooms know of it: the replicas and the requests it owns, and the slice of the set
that the handoff flow acts on. They live below the set (replica_set.py), so that the rooms it is split into
(handoff_flow.py, admin.py) name what they need without importing it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenloop.cluster.load import LoadTracker
from tokenloop.core.messages import CallResult, CoreRequest, InputMessage
from tokenloop.observe.records import HandoffRecord


@dataclass
class Replica:
    """One engine core of the set, and what the set knows of it."""

    index: int
    client: Any  # a CoreClient
    alive: bool = True
    admitting: bool = True
    death: str | None = None
    restarts: int = 0


@dataclass
class OwnedRequest:
    """A core request the set routed: where it is and what it produced (enough to run it again)."""

    request: CoreRequest
    replica: int
    output_token_ids: list[int] = field(default_factory=list)
    route: dict[str, Any] | None = None


class ReplicaHost(Protocol):
    """The replica set as the handoff flow sees it (`ReplicaSet` is one)."""

    info: Any  # replica 0's `CoreInfo` (block size, vocabulary, context length: the same on every replica)
    replicas: list[Replica]
    tracker: LoadTracker
    clock: Callable[[], int]
    prefill_replicas: int

    def owned(self, request_id: str) -> OwnedRequest | None: ...
    def requests_on(self, index: int) -> list[str]: ...
    def replica(self, index: int) -> Replica: ...
    def send_to(self, index: int, messages: list[InputMessage]) -> None: ...
    def fail(self, request_id: str, why: str) -> None: ...
    def call(self, index: int, name: str, args: list[Any], callback: Callable[[CallResult], None]) -> None: ...
    def emit_handoff(self, record: HandoffRecord) -> None: ...
