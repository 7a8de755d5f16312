"""The engine core as a Ray actor vs as a local process: startup time and one-stream decode ITL.

    PYTHONPATH=. python scripts/bench_ray_replica.py [--model PATH|NAME] [--tokens 256] [--num-cpus 2]

Without --model a tiny random Llama (the tests' model) is written to a temp dir. Each client is measured
through the front end a server uses (`AsyncEngine` with that client): one greedy request of `--tokens`
tokens, the gaps between its streamed outputs after the first one. Ray starts a local instance first
(timed apart); the actor asks for `--num-cpus` CPUs (Ray sets its torch threads to that). Last, how soon
a client sees its actor killed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path

from tokenloop.cluster.ray_replica import RayCoreClient, start_ray
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import load_model_info
from tokenloop.request import SamplingParams
from tokenloop.serving.async_engine import AsyncEngine, RequestSpec
from tokenloop.serving.core_client import CoreClient, CoreProcessClient


def gaps_ms(engine: AsyncEngine, tokens: int) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind="delta")

    async def main() -> list[float]:
        stream = await engine.add_requests([RequestSpec("itl", "the quick brown fox", params)])
        times = []
        async for output in stream:
            times.extend([time.perf_counter()] * len(output.outputs[0].token_ids_delta))
        return [(b - a) * 1e3 for a, b in itertools.pairwise(times[1:])]  # from the second token on

    return asyncio.run(main())


def measure(name: str, make_client, config, tokenizer, tokens: int) -> None:
    began = time.perf_counter()
    client: CoreClient = make_client()
    startup_s = time.perf_counter() - began
    engine = AsyncEngine(None, client=client, config=config, tokenizer=tokenizer)
    try:
        gaps_ms(engine, 16)  # warm-up
        gaps = sorted(gaps_ms(engine, tokens))
    finally:
        engine.close()
    print(f"{name:>22}: startup {startup_s:6.2f} s; ITL median {statistics.median(gaps):.2f} ms, "
          f"p90 {gaps[int(len(gaps) * 0.9)]:.2f} ms, mean {statistics.fmean(gaps):.2f} ms "
          f"over {len(gaps)} gaps")


def death_notice_ms(config, num_cpus: float) -> float:
    """ray.kill on an idle actor -> its client's pollables wake and death() names it."""
    import ray
    import zmq

    client = RayCoreClient(config, num_cpus=num_cpus)
    poller = zmq.Poller()
    for pollable in client.pollables():
        poller.register(pollable, zmq.POLLIN)
    began = time.perf_counter()
    ray.kill(client.actor)
    while client.death() is None:
        poller.poll(5000)
        client.receive()
    took = (time.perf_counter() - began) * 1e3
    print(f"{'death after ray.kill':>22}: {took:6.0f} ms: {client.death()}")
    client.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--num-cpus", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenloop-bench-") as folder:
        model = args.model
        if model is None:
            from tests.conftest import write_tiny_llama

            model = str(write_tiny_llama(Path(folder)))
        config = build_engine_config(model, block_size=16, num_blocks=512)
        tokenizer = load_model_info(model).tokenizer
        measure("local process", lambda: CoreProcessClient(config), config, tokenizer, args.tokens)
        began = time.perf_counter()
        cluster = start_ray(None, num_cpus=max(2, int(args.num_cpus)), log_to_driver=False)
        print(f"{'ray.init (local)':>22}: {time.perf_counter() - began:6.2f} s")
        try:
            for attempt in ("first", "second"):
                measure(f"Ray actor ({attempt})", lambda: RayCoreClient(config, num_cpus=args.num_cpus),
                        config, tokenizer, args.tokens)
            death_notice_ms(config, args.num_cpus)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
