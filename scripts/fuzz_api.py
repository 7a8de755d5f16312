"""The long schemathesis fuzz run of issue 34 item 6 (tests/serving/api_fuzzer.py), figures for BENCHMARKS.md.

Starts a keyed tiny-model server on 127.0.0.1 (the engine core in its own process, as `tokenloop serve`
runs it, or on a thread with `--core thread`) with the same small limits as the CI run, a greedy
bystander beside it, and sends `--cases` widened schemathesis cases over every route of its /openapi.json.
Unlike the CI run it does not stop at a failure: it counts every 5xx, slow answer, malformed error body and
death, and prints each failing call. It stops early only if the engine or the server died.

    python scripts/fuzz_api.py --cases 3000 --seed 1 --json /tmp/fuzz.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import write_tiny_llama
from tests.serving.api_fuzzer import FuzzBounds, FuzzRun, GreedyBystander, call_strategy, warm_up
from tests.serving.conftest import MODEL, LiveServer
from tests.serving.hostile_util import KEY, engine_quiet, keyed_server
from tests.serving.test_schema_fuzz import SERVER_LIMITS, SERVER_OPTIONS
from tokenloop.config import build_engine_config
from tokenloop.model.loader import load_checkpoint
from tokenloop.serving.app import create_app
from tokenloop.serving.async_engine import AsyncEngine
from tokenloop.serving.server import ServerThread


@contextmanager
def process_server(model_dir: Path) -> Iterator[LiveServer]:
    """The keyed server of the CI run, with its engine core in its own process (msgpack over ZMQ)."""
    config = build_engine_config(str(model_dir), max_waiting=8, policy="priority", block_size=4,
                                 num_blocks=512, max_num_batched_tokens=256, **SERVER_OPTIONS)
    async_engine = AsyncEngine.with_core_process(config)
    app = create_app(None, served_model_name=MODEL, api_key=KEY, shutdown_timeout_s=1.0,
                     async_engine=async_engine, limits=SERVER_LIMITS)
    with ServerThread(app, shutdown_timeout_s=1.0) as thread, \
            httpx.Client(base_url=thread.url, timeout=60.0) as client:
        yield LiveServer(thread, client, None, async_engine)  # type: ignore[arg-type]


class Died(Exception):
    """The engine or the server died: the run stops there."""


def fuzz(live: LiveServer, bounds: FuzzBounds, cases: int,
         seed_value: int) -> tuple[FuzzRun, GreedyBystander]:
    """`cases` calls with the bystander beside them; stops early only at a death."""
    warm_up(live)
    run = FuzzRun(live, bounds)
    calls = call_strategy(live.url, bounds)
    bystander = GreedyBystander(live.url, timeout_s=bounds.answer_s)
    bystander.start()

    @seed(seed_value)
    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one_case(data: st.DataObject) -> None:
        problem = run.exchange(data.draw(calls))
        if problem is not None:
            print(f"case {run.cases}: {run.failures[-1] if run.failures else run.known[-1]}", flush=True)
        if run.deaths:
            raise Died(problem)
        if run.cases % 250 == 0:
            print(f"{run.cases} cases, statuses {dict(sorted(run.statuses.items()))}", flush=True)

    try:
        one_case()
    except Died:
        pass
    finally:
        bystander.stop()
    return run, bystander


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--core", choices=["process", "thread"], default="process")
    parser.add_argument("--max-chars", type=int, default=1_000_000)
    parser.add_argument("--max-depth", type=int, default=100_000)
    parser.add_argument("--answer-s", type=float, default=20.0)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    bounds = FuzzBounds(max_chars=args.max_chars, max_depth=args.max_depth, answer_s=args.answer_s)
    begin = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tokenloop-fuzz-") as tmp:
        model_dir = write_tiny_llama(Path(tmp) / "tiny")
        server = (process_server(model_dir) if args.core == "process"
                  else keyed_server(load_checkpoint(str(model_dir)), app_options={"limits": SERVER_LIMITS},
                                    **SERVER_OPTIONS))
        with server as live:
            run, bystander = fuzz(live, bounds, args.cases, args.seed)
            quiet = None
            if not run.deaths:
                try:
                    if live.engine is not None:
                        engine_quiet(live)  # the pool's invariants too: the engine is in this process
                    else:
                        live.wait_idle()
                except AssertionError as exc:
                    quiet = str(exc)
    figures = {
        "cases": run.cases, "seed": args.seed, "core": args.core,
        "statuses": dict(sorted(run.statuses.items())),
        "server_errors_5xx": sum(n for status, n in run.statuses.items() if status >= 500),
        "failures": len(run.failures), "known_issue_failures": len(run.known), "deaths": run.deaths,
        "slowest_answer_s": round(run.slowest_s, 2), "slowest_call": run.slowest_call[:400],
        "bystander_compared": bystander.compared,
        "bystander_mismatches": len(bystander.mismatches), "not_quiet_after": quiet,
        "wall_s": round(time.monotonic() - begin, 1), "failing_calls": run.failures, "known_calls": run.known,
    }
    print(json.dumps({k: v for k, v in figures.items() if not k.endswith("_calls")}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
