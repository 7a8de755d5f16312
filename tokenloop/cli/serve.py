"""`tokenloop serve`: load an engine and serve the OpenAI-compatible API over HTTP.

    tokenloop serve --model smollm2-135m-instruct --port 8000 --policy fcfs --max-num-seqs 64
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from tokenloop.cli.options import LOG_LEVELS, _engine_options, add_engine_args, load_engine, parse_size
from tokenloop.core.heartbeat import DEFAULT_HANG_TIMEOUT_S

logger = logging.getLogger("tokenloop")


def add_serve_subparser(commands: Any) -> argparse.ArgumentParser:
    """Add `serve` to a `parser.add_subparsers()` object; the command runs `args.func(args)`."""
    serve = commands.add_parser("serve", help="serve an OpenAI-compatible API")
    # Also accepted after the command (`tokenloop serve --log-level warning`), as users type it.
    serve.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS)
    add_engine_args(serve)
    net = serve.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize "
                                       "(default: $TOKENLOOP_API_KEY; prefer that or --api-key-file: a flag "
                                       "shows in `ps`)")
    net.add_argument("--api-key-file", help="read the API key from this file")
    net.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    net.add_argument("--max-waiting", type=int, help="most queued requests; beyond it: 429 with Retry-After")
    net.add_argument("--shutdown-timeout", type=float, default=5.0,
                     help="seconds in-flight requests get to finish on shutdown before they are aborted")
    net.add_argument("--engine-core", choices=("process", "thread"), default="process",
                     help="run the engine core in its own process (default) or on a thread of the server's")
    net.add_argument("--hang-timeout", type=float, default=DEFAULT_HANG_TIMEOUT_S, metavar="SECONDS",
                     help="an engine core (or replica) whose heartbeat shows no progress this long is hung: "
                          "it is killed and handled as a dead one (the server exits 3; a replica fails "
                          "over). Progress is counted per model layer, so a long step is no hang "
                          f"(default {DEFAULT_HANG_TIMEOUT_S:g}; 0: never; at least 1)")
    _add_cluster_args(serve)
    _add_limit_args(serve)
    tracing = serve.add_argument_group("tracing")
    tracing.add_argument("--trace-sample-rate", type=float, default=0.1,
                         help="fraction of requests traced in detail for /v1/trace and the dashboard (default 0.1)")
    tracing.add_argument("--no-trace", action="store_true", help="record no trace at all (the dashboard stays empty)")
    serve.set_defaults(func=_serve)
    return serve


def _add_cluster_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas (several engine cores behind this one server)")
    group.add_argument("--replicas", type=int, default=1, help="engine cores behind the router (default 1)")
    group.add_argument("--cluster", choices=("local", "ray"), default="local",
                       help="run the replicas as local processes (default) or as Ray actors (tokenloop[ray])")
    group.add_argument("--ray-address", help="join this Ray cluster (default: start a local Ray instance and "
                                             "stop it with the server)")
    group.add_argument("--router", default="cost",
                       help="round-robin, least-load or cost (default: predicted time to first token from "
                            "exact prefix hits and measured step costs)")
    group.add_argument("--failover", choices=("fail", "recompute"), default="fail",
                       help="when a replica dies, fail its requests with a clear reason (default) or resume "
                            "them on another replica by recomputing from their token ids")
    group.add_argument("--no-restart", action="store_true", help="do not start a dead replica again")
    group.add_argument("--rebalance", action="store_true",
                       help="move requests queued behind a full replica to one with a free sequence slot "
                            "(a handoff: tokens unchanged)")
    group.add_argument("--prefill-replicas", type=int, default=0,
                       help="K > 0: the first K replicas prefill and hand each request off to the others, "
                            "which decode (prefill/decode disaggregation)")


def _cluster_options(args: argparse.Namespace):  # -> ClusterOptions (imported lazily)
    """The replica set to start, or None for one engine core (a bad cluster flag is an error either way)."""
    from tokenloop.config import ROUTER_NAMES  # not the router itself: nothing starts before the core
    from tokenloop.core.heartbeat import check_hang_timeout
    from tokenloop.errors import ConfigError

    if args.router not in ROUTER_NAMES:
        raise ConfigError(f"unknown router {args.router!r} (valid: {', '.join(ROUTER_NAMES)})")
    if args.ray_address and args.cluster != "ray":
        raise ConfigError("--ray-address needs --cluster ray")
    check_hang_timeout(args.hang_timeout)
    if args.replicas == 1 and args.cluster == "local" and not args.prefill_replicas:
        return None
    from tokenloop.cluster.launch import ClusterOptions

    return ClusterOptions(replicas=args.replicas, cluster=args.cluster, router=args.router,
                          failover=args.failover, restart=not args.no_restart, rebalance=args.rebalance,
                          prefill_replicas=args.prefill_replicas, ray_address=args.ray_address,
                          hang_timeout_s=args.hang_timeout)


def _start_core_process(args: argparse.Namespace, name: str, limits: Any,  # -> AsyncEngine
                        cluster: Any = None, config: Any = None, started: Any = None):
    """The engine core in its own process (or N of them behind a router); this one keeps only the
    tokenizer (and the records' observers). `started`: the core's process, already started for `config`."""
    from tokenloop.config import build_engine_config
    from tokenloop.observe.metrics import EngineMetrics
    from tokenloop.observe.tracer import Tracer
    from tokenloop.serving.async_engine import AsyncEngine
    from tokenloop.serving.core_client import CoreProcessClient

    config = config if config is not None else build_engine_config(args.model, **_engine_options(args))
    tracer = None if args.no_trace else Tracer(sample_rate=args.trace_sample_rate)
    begin = time.perf_counter()
    if cluster is not None:
        async_engine = AsyncEngine.with_replicas(config, cluster, EngineMetrics(name), tracer=tracer,
                                                 max_stream_backlog=limits.max_stream_backlog)
        logger.info("%d engine replicas (%s, router %s) ready in %.1f s", cluster.replicas, cluster.cluster,
                    cluster.router, time.perf_counter() - begin)
        return async_engine
    client = None if started is None else CoreProcessClient(config, started=started, wait=False,
                                                            hang_timeout_s=args.hang_timeout)
    async_engine = AsyncEngine.with_core_process(config, EngineMetrics(name), tracer=tracer, client=client,
                                                 max_stream_backlog=limits.max_stream_backlog,
                                                 hang_timeout_s=args.hang_timeout)
    info = async_engine.client.info
    if started is not None:
        begin = started.started_s
    logger.info("engine core (pid %d) ready in %.1f s: max_model_len=%d, %d KV blocks of %d tokens, "
                "policy=%s; %s", info.pid, time.perf_counter() - begin, info.max_model_len, info.num_blocks,
                info.block_size, config.scheduler.policy, info.dtype)
    return async_engine


def _serve(args: argparse.Namespace) -> int:
    name = args.served_model_name or args.model
    cluster = _cluster_options(args)  # validated here, before anything starts
    if args.engine_core == "thread" and cluster is not None:
        logger.error("--replicas, --cluster and --prefill-replicas need --engine-core process")
        return 2
    config = started = None
    if args.engine_core == "process" and cluster is None:
        # The core starts first (forked: nothing but the command line is imported yet, nor any thread
        # running); it imports the engine and loads the model while this process imports the server.
        from tokenloop.config import build_engine_config
        from tokenloop.core.core_launch import start_core_process
        from tokenloop.core.heartbeat import heartbeat_interval_s

        config = build_engine_config(args.model, **_engine_options(args))
        beat = heartbeat_interval_s(args.hang_timeout) if args.hang_timeout else None
        started = start_core_process(config, start_method="fork", heartbeat_interval_s=beat)
    from tokenloop.serving.app import create_app
    from tokenloop.serving.limits import resolve_api_key
    from tokenloop.serving.server import serve_forever

    # A bad limit or key file ends this process, and with it a core already started (a daemon child).
    api_key = resolve_api_key(args.api_key, args.api_key_file)
    limits = _server_limits(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning("serving on %s without an API key: anyone who can reach it may use it", args.host)
    if args.engine_core == "process":
        engine, async_engine = None, _start_core_process(args, name, limits, cluster, config, started)
    else:
        engine, async_engine = load_engine(args), None
    app = create_app(engine, served_model_name=name, api_key=api_key, shutdown_timeout_s=args.shutdown_timeout,
                     limits=limits, async_engine=async_engine)
    logger.info("serving %s on http://%s:%d", args.served_model_name or args.model, args.host, args.port)
    serve_forever(app, args.host, args.port, shutdown_timeout_s=args.shutdown_timeout, log_level=args.log_level)
    logger.info("shut down cleanly")
    return 0


# Server limits: flag -> (ServerLimits field, type, help). Defaults are ServerLimits' own.
_LIMIT_FLAGS = {
    "--max-body-bytes": ("max_body_bytes", parse_size, "largest request body (413 past it)"),
    "--header-read-timeout": ("header_read_timeout_s", float, "seconds a client has to send a request's headers"),
    "--body-read-timeout": ("body_read_timeout_s", float, "seconds a client has to send a request's body (408)"),
    "--max-concurrent-requests": ("max_concurrent_requests", int,
                                  "requests in flight; idle connections do not count (503 past it)"),
    "--max-connections": ("max_connections", int,
                          "open connections, lowered to what the open-file limit allows; past it the oldest "
                          "connection without a request in flight is closed"),
    "--max-n": ("max_n", int, "largest n (samples per prompt)"),
    "--max-stop-strings": ("max_stop_strings", int, "most stop strings per request"),
    "--max-stop-string-chars": ("max_stop_string_chars", int, "longest stop string"),
    "--max-logit-bias": ("max_logit_bias_entries", int, "most logit_bias entries per request"),
    "--max-stream-backlog": ("max_stream_backlog", int,
                             "outputs a slow reader may fall behind before its request is aborted"),
    "--grammar-compile-timeout": ("grammar_compile_timeout_s", float,
                                  "seconds a structured-output constraint may take to compile (400 past it)"),
    "--max-samples-per-request": ("max_samples_per_request", int, "prompts x n of one completions request"),
    "--max-tools": ("max_tools", int, "tool definitions per chat request"),
    "--max-tools-bytes": ("max_tools_bytes", parse_size, "size of a request's tool definitions as JSON"),
    "--max-user-chars": ("max_user_chars", int, "longest `user` string"),
}


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    from tokenloop.config import ServerLimits

    defaults = ServerLimits()
    group = parser.add_argument_group("limits (each bounds what one client may ask)")
    for flag, (field_name, kind, text) in _LIMIT_FLAGS.items():
        group.add_argument(flag, dest=field_name, type=kind, default=getattr(defaults, field_name),
                           help=f"{text} (default {getattr(defaults, field_name)})")


def _server_limits(args: argparse.Namespace):  # -> ServerLimits (imported lazily)
    from tokenloop.config import ServerLimits

    return ServerLimits(**{field_name: getattr(args, field_name) for field_name, _, _ in _LIMIT_FLAGS.values()})
