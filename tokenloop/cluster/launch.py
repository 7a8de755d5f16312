"""Start N engine cores (local processes, Ray actors, or in this process for tests) as one ReplicaSet."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenloop.cluster.load import LoadTracker
from tokenloop.cluster.replica_set import FAILOVER_MODES, ReplicaSet
from tokenloop.cluster.router import RouterConfig, make_router
from tokenloop.core.heartbeat import DEFAULT_HANG_TIMEOUT_S, check_hang_timeout
from tokenloop.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokenloop.config import EngineConfig
    from tokenloop.model.loader import Checkpoint

logger = logging.getLogger(__name__)

CLUSTER_KINDS = ("local", "ray", "inprocess")


@dataclass(frozen=True)
class ClusterOptions:
    """How many cores, where they run, how requests reach them and what happens when one dies."""

    replicas: int = 2
    cluster: str = "local"  # local processes, Ray actors, or in this process (tests)
    router: str = "cost"
    failover: str = "fail"  # or "recompute": a dead replica's requests resume elsewhere from their tokens
    restart: bool = True  # start a dead replica again
    prefill_replicas: int = 0  # > 0: the first K replicas prefill, the rest decode (handoff after prefill)
    ray_address: str | None = None
    lease_s: float = 30.0
    precopy: bool = True  # live migration copies full blocks while the request decodes, then the tail
    rebalance: bool = False  # move requests queued behind a full replica to one with a free slot
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S  # a replica without progress this long counts as dead

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise InvalidRequestError(f"--replicas must be >= 1, got {self.replicas}")
        if self.cluster not in CLUSTER_KINDS:
            raise InvalidRequestError(f"unknown cluster kind {self.cluster!r}; known: {', '.join(CLUSTER_KINDS)}")
        if self.failover not in FAILOVER_MODES:
            raise InvalidRequestError(f"unknown failover mode {self.failover!r}; known: "
                                      f"{', '.join(FAILOVER_MODES)}")
        if self.ray_address is not None and self.cluster != "ray":
            raise InvalidRequestError("--ray-address needs --cluster ray")
        check_hang_timeout(self.hang_timeout_s)
        if self.prefill_replicas and self.prefill_replicas >= self.replicas:
            raise InvalidRequestError(f"--prefill-replicas {self.prefill_replicas} leaves no decode replica of "
                                      f"{self.replicas}")


def replica_config(config: EngineConfig) -> EngineConfig:
    """Every replica publishes KV events: the router computes exact prefix hits from them."""
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_kv_events=True))


def start_replica_set(config: EngineConfig, options: ClusterOptions, *,
                      checkpoint: Checkpoint | None = None, startup_timeout_s: float = 300.0) -> ReplicaSet:
    """Start every replica (in parallel), then the router over them; on failure, stop what started."""
    config = replica_config(config)
    scheduler = config.scheduler
    router = make_router(options.router, RouterConfig(
        block_size=config.cache.block_size, max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_seqs=scheduler.max_num_seqs))
    closers: list[Callable[[], None]] = []
    make = _client_factory(config, options, checkpoint, startup_timeout_s, closers)
    clients: list[Any] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=options.replicas) as pool:
            futures = [pool.submit(make, i) for i in range(options.replicas)]
            errors = []
            for future in futures:
                try:
                    clients.append(future.result())
                except BaseException as exc:  # noqa: BLE001 - stop the others, then raise the first
                    errors.append(exc)
            if errors:
                raise errors[0]
        block_size = clients[0].info.block_size
        tracker = LoadTracker(options.replicas, block_size,
                              max_loras=config.lora.max_loras if config.lora is not None else 4)
        replica_set = ReplicaSet(clients, router, tracker, failover=options.failover,
                                 restart=make if options.restart else None,
                                 prefill_replicas=options.prefill_replicas, lease_s=options.lease_s,
                                 precopy=options.precopy,
                                 rebalance_max_num_seqs=scheduler.max_num_seqs if options.rebalance else None)
    except BaseException:
        for client in clients:
            client.close(1.0)
        for close in closers:
            close()
        raise
    replica_set.on_close.extend(closers)
    return replica_set


def _client_factory(config: EngineConfig, options: ClusterOptions, checkpoint: Checkpoint | None,
                    startup_timeout_s: float, closers: list[Callable[[], None]]) -> Callable[[int], Any]:
    if options.cluster == "inprocess":
        from tokenloop.core.engine_core import EngineCore
        from tokenloop.serving.core_client import InProcessCoreClient

        def in_process(index: int) -> Any:
            return InProcessCoreClient(EngineCore(config, checkpoint), records_in_frames=True)

        return in_process
    if options.cluster == "ray":
        from tokenloop.cluster.ray_replica import RayCoreClient, start_ray

        # A local instance gets at least one CPU per replica (each actor asks for one): on a small machine
        # the replicas share the cores, as local processes would, instead of waiting to be placed.
        num_cpus = None if options.ray_address else max(os.cpu_count() or 1, options.replicas)
        ray_cluster = start_ray(options.ray_address, num_cpus)
        closers.append(ray_cluster.stop)  # stops only a Ray instance this process started

        def ray_actor(index: int) -> Any:
            return RayCoreClient(config, checkpoint, replica=index, startup_timeout_s=startup_timeout_s,
                                 hang_timeout_s=options.hang_timeout_s)

        return ray_actor
    from tokenloop.serving.core_client import CoreProcessClient

    def local_process(index: int) -> Any:
        return CoreProcessClient(config, checkpoint, startup_timeout_s=startup_timeout_s,
                                 hang_timeout_s=options.hang_timeout_s)

    return local_process
