"""A replica's engine core as a Ray actor, behind the front end's `CoreClient` protocol.

Ray places the core and owns its life; the data path is the engine process's own: msgpack frames over two
ZMQ sockets the client binds (ipc:// in a private dir), so a step's frame never goes through Ray's object
store. The actor's long-running `serve` call is the core's life: a watcher thread waits on its ObjectRef and
writes to a pipe the front end's poller watches, so a dead actor (ray.kill, a crash, its node gone) wakes the
front end at once, as a dead engine process's sentinel does.

    cluster = start_ray(address=None, num_cpus=4)          # or address="head:6379" to join a cluster
    client = RayCoreClient(config, replica=0)               # returns once the core is ready
    engine = AsyncEngine(None, client=client, config=config, tokenizer=tokenizer)
    ...
    client.close(); cluster.stop()

Ray is an optional extra (`pip install 'tokenloop[ray]'`): it is imported inside functions only, so the
server runs without it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenloop.cluster.ray_actor import CoreActor
from tokenloop.core.heartbeat import DEFAULT_HANG_TIMEOUT_S
from tokenloop.core.private_dir import RAY_PREFIX, PrivateDir
from tokenloop.errors import ConfigError
from tokenloop.serving.core_client import CoreSockets

if TYPE_CHECKING:
    from tokenloop.config import EngineConfig
    from tokenloop.core.messages import CoreFrame, InputMessage
    from tokenloop.model.loader import Checkpoint

logger = logging.getLogger(__name__)

_INSTALL_HINT = "Ray is not installed: pip install 'tokenloop[ray]'"


def import_ray() -> Any:
    """The `ray` module, or ConfigError saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(_INSTALL_HINT) from exc
    return ray


@dataclass
class RayCluster:
    """The Ray this process is connected to; `stop` undoes only what `start_ray` did."""

    address: str | None  # the cluster joined, or None for a local instance
    initialized_here: bool  # False when Ray was already up in this process (a test's, a caller's)
    # A local instance's session (sockets, logs), in a dir this process keeps locked: a server killed with
    # SIGKILL takes Ray's processes with it (Ray shares their fate with ours), and the next server reaps it.
    directory: PrivateDir | None = None

    def stop(self) -> None:
        """Disconnect (a local instance we started stops with it; a joined cluster keeps running)."""
        ray = import_ray()
        if self.initialized_here and ray.is_initialized():
            ray.shutdown()
        if self.directory is not None:
            self.directory.remove()


def start_ray(address: str | None = None, num_cpus: int | None = None, *, connect_timeout_s: float = 5.0,
              log_to_driver: bool = True) -> RayCluster:
    """Join the Ray cluster at `address` (host:port of its head, or "auto"), or start a local instance
    with `num_cpus` CPUs when there is none. Reuses a Ray already initialized in this process.

    An address where nothing answers fails within `connect_timeout_s` with ConfigError naming it: Ray's
    own connect retries for minutes, so the head's port is probed first. A head that `ray.init` or
    `ray start` made on this Ray version uses token authentication: a joining server needs
    RAY_AUTH_MODE=token and the head's token (~/.ray/auth_token or RAY_AUTH_TOKEN), or Ray refuses it.
    """
    ray = import_ray()
    if address not in (None, "auto") and not address.startswith("ray://"):
        _probe(address, connect_timeout_s)  # even when Ray is up: a flag that names nowhere is an error
    if ray.is_initialized():
        return RayCluster(address, initialized_here=False)
    if address is None:
        directory = PrivateDir.create(RAY_PREFIX)
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
                     _temp_dir=directory.path)
        except BaseException:
            directory.remove()
            raise
        return RayCluster(None, initialized_here=True, directory=directory)
    try:
        ray.init(address=address, log_to_driver=log_to_driver)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError for a bad address
        raise ConfigError(f"cannot join the Ray cluster at --ray-address {address}: {_reasons(exc)}") from exc
    return RayCluster(address, initialized_here=True)


def _probe(address: str, timeout_s: float) -> None:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ConfigError(f"--ray-address {address} is not host:port (the Ray head's GCS address)")
    if host in ("localhost", "127.0.0.1", "::1"):
        host = import_ray().util.get_node_ip_address()  # where Ray itself connects for a loopback address
    try:
        check_head(host, int(port), timeout_s)
    except OSError as exc:
        raise ConfigError(f"cannot reach the Ray cluster at --ray-address {address} ({host}:{port}: {exc}): "
                          "is `ray start --head` running there?") from exc


# An HTTP/2 client's preface and an empty SETTINGS frame: a gRPC server (Ray's GCS) answers with SETTINGS.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_HTTP2_SETTINGS = 4


def check_head(host: str, port: int, timeout_s: float) -> None:
    """OSError unless a gRPC server (a Ray head's GCS) answers at host:port within `timeout_s`.

    Ray's own connect retries for minutes where nothing answers, and as long where something that is not
    Ray does (the dashboard's port is a common slip). With TLS on (RAY_USE_TLS) only the port is checked.
    """
    with socket.create_connection((host, port), timeout=timeout_s) as connection:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return
        connection.settimeout(timeout_s)
        connection.sendall(_HTTP2_PREFACE)
        header = b""
        while len(header) < 9:
            chunk = connection.recv(9 - len(header))
            if not chunk:
                break
            header += chunk
    if len(header) < 9 or header[3] != _HTTP2_SETTINGS:
        raise OSError("something answers there, but not a Ray head (no gRPC): the head's GCS port "
                      "(6379 by default), not the dashboard's?")


class RayCoreClient:
    """One replica's engine core in a Ray actor; the same `CoreClient` as `CoreProcessClient`.

    Placement: the actor asks for `num_cpus` CPUs (its torch threads follow: Ray sets OMP_NUM_THREADS to
    it) and is pinned to this process's node, because the frames travel over ipc:// sockets on this host.
    Ray must be initialized (`start_ray`). The constructor returns once the core is ready, or raises
    ConfigError if the actor cannot be placed (in `placement_timeout_s`), ModelLoadError with the core's
    reason, or EngineStoppedError if the actor died or stayed silent for `startup_timeout_s`.
    """

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None, *, replica: int = 0,
                 num_cpus: float = 1.0, startup_timeout_s: float = 300.0, placement_timeout_s: float = 60.0,
                 log_level: int | None = None, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            raise ConfigError("RayCoreClient needs Ray initialized first (start_ray)")
        self.replica = replica
        self.actor_name = f"tokenloop-replica-{replica}-{uuid.uuid4().hex[:8]}"
        self.name = f"the engine core actor of replica {replica} ({self.actor_name})"
        self._ray = ray
        self._sockets = CoreSockets(hang_timeout_s=hang_timeout_s)
        self._death: str | None = None
        self._hang: str | None = None  # why it was killed as hung
        self._died = threading.Event()
        self._lock = threading.Lock()  # the pipe's write end is closed only once the watcher cannot write
        self._death_read, self._death_write = os.pipe()
        self._closed = False
        self.actor: Any = None
        self._serve_ref: Any = None
        self._watcher: threading.Thread | None = None
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        try:
            node_id = ray.get_runtime_context().get_node_id()
            _check_fits(ray, node_id, num_cpus)
            here = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            self.actor = ray.remote(CoreActor).options(
                name=self.actor_name, num_cpus=num_cpus, max_restarts=0, scheduling_strategy=here).remote()
            self._wait_placed(num_cpus, placement_timeout_s)
            sockets = self._sockets
            heartbeat = (sockets.heartbeat_address, sockets.heartbeat_interval_s)
            self._serve_ref = self.actor.serve.remote(config, checkpoint, sockets.input_address,
                                                      sockets.output_address, level, heartbeat)
            self._watcher = threading.Thread(target=self._watch, name=f"{self.actor_name}-watcher",
                                             daemon=True)
            self._watcher.start()
            self.info = self._sockets.wait_ready(startup_timeout_s, self.name, self._death_read, self.death)
        except BaseException:
            self.close(timeout_s=1.0)
            raise

    def _wait_placed(self, num_cpus: float, timeout_s: float) -> None:
        """ConfigError if the actor is not running within `timeout_s`: Ray holds an actor whose CPUs are
        all taken (more replicas than the node has CPUs) pending without a word."""
        ray = self._ray
        ready, _ = ray.wait([self.actor.pid.remote()], timeout=timeout_s)
        if not ready:
            free = ray.available_resources().get("CPU", 0.0)
            total = ray.cluster_resources().get("CPU", 0.0)
            raise ConfigError(f"{self.name} was not placed in {timeout_s:g} s: it asks for {num_cpus:g} "
                              f"CPUs and Ray has {free:g} of {total:g} free (other actors hold the rest): "
                              "give Ray more CPUs or ask for fewer per replica")

    def _watch(self) -> None:
        """Wait for `serve` to end, however it ends; record why and wake the front end's poller."""
        ray = self._ray
        try:
            ray.wait([self._serve_ref], num_returns=1, timeout=None)
            status = ray.get(self._serve_ref, timeout=0)
            why = f"{self.name} stopped (status {status})"
        except ray.exceptions.RayActorError as exc:
            why = f"{self.name} died: {_first_line(exc)}"
        except Exception as exc:  # noqa: BLE001 - the core's step raised (the actor lives), or Ray went away
            why = f"{self.name} failed: {type(exc).__name__}: {_first_line(exc)}"
        self._death = why
        self._died.set()
        with self._lock:
            if not self._closed:
                os.write(self._death_write, b"x")

    def send(self, messages: list[InputMessage]) -> None:
        self._sockets.send(messages)

    def receive(self) -> list[CoreFrame]:
        """Every frame that has arrived, without waiting."""
        return self._sockets.receive()

    def pollables(self) -> list[Any]:
        # The pipe becomes readable the moment the watcher sees the actor's end: death is seen at once.
        return [self._sockets.outputs, self._death_read]

    def poll_timeout_ms(self) -> int | None:
        # The core steps on its own; its frames and its death both wake the poller, its hang the timeout.
        return self._sockets.watch.timeout_ms()

    def death(self) -> str | None:
        if self._hang is not None or self._death is not None:
            return self._hang or self._death
        hang = self._sockets.hang()
        if hang is not None:  # a stuck actor is killed, as a dead one's is on close
            self._hang = f"{self.name}: {hang}; it was killed"
            try:
                self._ray.kill(self.actor, no_restart=True)
            except Exception:  # Ray itself is gone: so is the actor
                logger.debug("could not kill %s", self.actor_name, exc_info=True)
        return self._hang

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask the core to shut down, wait for it, kill the actor, and remove the sockets (idempotent)."""
        if self._closed:
            return
        watched = self._watcher is not None
        if watched and self._death is None:
            self._sockets.send_shutdown()
            if not self._died.wait(timeout_s):
                logger.warning("%s did not stop in %.1f s; killing it", self.name, timeout_s)
        if self.actor is not None:
            try:
                self._ray.kill(self.actor, no_restart=True)  # a stopped core's actor is still a process
            except Exception:  # Ray already shut down: the actor went with it
                logger.debug("could not kill %s", self.actor_name, exc_info=True)
        if watched:
            self._died.wait(timeout_s)
        with self._lock:
            self._closed = True
            os.close(self._death_read)
            os.close(self._death_write)
        self._sockets.close()


def _check_fits(ray: Any, node_id: str, num_cpus: float) -> None:
    """ConfigError now, rather than a silent wait for the startup timeout, when this node can never fit
    the actor (it may be busy with other actors: that one waits)."""
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    has = node["Resources"].get("CPU", 0.0) if node is not None else 0.0
    if num_cpus > has:
        raise ConfigError(f"an engine core actor asks for {num_cpus:g} CPUs; this Ray node has {has:g}")


def _reasons(exc: BaseException) -> str:
    """The first line of an exception and of each cause under it: Ray's own reason (a missing auth token:
    set RAY_AUTH_MODE=token) hides below a generic "Failed to connect"."""
    lines: list[str] = []
    cause: BaseException | None = exc
    while cause is not None and len(lines) < 4:
        line = _first_line(cause)
        if line not in lines:
            lines.append(line)
        cause = cause.__cause__
    return "; ".join(reversed(lines))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
