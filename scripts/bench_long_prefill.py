"""Short requests beside long prefills, against a real `tokenloop serve` (issue 28, section 3).

Two measurements against one server (started here on 127.0.0.1 with SERVE_ARGS, none by default: the
defaults; or an already running one with --base-url):

- newcomer: four ~7.6k-token prompts (max_tokens 1) sent at once, then a 1-token chat request 0.5-1 s
  later; the newcomer's latency (for one token its TTFT is its whole answer). The long prompts are then
  dropped (the server aborts them), and the next round sends fresh random ones (no prefix-cache hit).
- mix: 1-token short requests (--short-len tokens) at a Poisson --short-rate for --duration seconds,
  alone, then again beside a long prompt (--long-len tokens) every --long-every seconds; p50 / p99 TTFT of
  the short ones in both runs.

    python scripts/bench_long_prefill.py                      # both, default server
    python scripts/bench_long_prefill.py --only newcomer -- --long-prefill-token-threshold 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenloop.bench.serve import ClientConfig, send_offsets, send_request
from tokenloop.bench.server_process import served
from tokenloop.bench.trace import TraceRequest

TOKEN_IDS = (10, 380)  # ordinary vocabulary ids of the default model (as `bench serve --dataset random`)
NEWCOMER_PROMPT = "Say hi."


def _random_prompt(rng: random.Random, length: int) -> tuple[int, ...]:
    return tuple(rng.randrange(*TOKEN_IDS) for _ in range(length))


class Client:
    """Streams requests to one server and times them to the end of their stream.

    The end of the stream, not the first text: a single random-id token may decode to no text at all
    (a partial UTF-8 sequence), and for a 1-token request the two are the same moment.
    """

    def __init__(self, http: httpx.AsyncClient, base_url: str) -> None:
        self.http = http
        self.configs = {endpoint: ClientConfig(base_url=base_url, endpoint=endpoint, request_timeout_s=3600.0)
                        for endpoint in ("/v1/completions", "/v1/chat/completions")}

    async def timed(self, request: TraceRequest, at: float = 0.0) -> float:
        """Send `request` at perf_counter time `at` (now if past); seconds from its send to its end."""
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        endpoint = "/v1/completions" if request.prompt_tokens is not None else "/v1/chat/completions"
        sent = time.perf_counter()
        record = await send_request(self.http, request, self.configs[endpoint])
        if not record.success and record.error != "the stream carried no token":
            raise RuntimeError(f"request {request.id} failed: {record.error}")
        return time.perf_counter() - sent

    async def cancel(self, tasks: Sequence[asyncio.Task]) -> None:
        """Drop the streams still open (the server aborts their requests), and wait until it has: a
        1-token probe sent after the disconnects is answered only once they are processed."""
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.timed(TraceRequest(id="probe", arrival_s=0.0, max_tokens=1, prompt_tokens=(11, 12, 13)))


async def newcomer_round(client: Client, rng: random.Random, args: argparse.Namespace,
                         delay_s: float) -> dict[str, Any]:
    """Four long prompts at once, the 1-token chat newcomer `delay_s` later; the long ones are dropped
    once the newcomer has its answer (or after --newcomer-timeout seconds)."""
    now = time.perf_counter()
    longs = [asyncio.create_task(client.timed(
        TraceRequest(id=f"long-{i}", arrival_s=0.0, max_tokens=1, prompt_tokens=_random_prompt(rng, args.long_len)),
        now)) for i in range(args.num_long)]
    newcomer = TraceRequest(id="newcomer", arrival_s=delay_s, max_tokens=1, prompt=NEWCOMER_PROMPT)
    try:
        newcomer_s: float | None = await asyncio.wait_for(client.timed(newcomer, now + delay_s),
                                                          delay_s + args.newcomer_timeout)
    except TimeoutError:
        newcomer_s = None
    num_long_done = sum(1 for task in longs if task.done())
    await client.cancel(longs)
    return {"delay_s": delay_s, "newcomer_s": newcomer_s, "num_long_done": num_long_done}


async def mix_run(client: Client, rng: random.Random, args: argparse.Namespace, with_long: bool) -> list[float]:
    """1-token short requests at a Poisson rate for --duration s, optionally beside a long prompt every
    --long-every s (dropped when the short ones are done); the short ones' TTFTs (s)."""
    offsets = [t for t in send_offsets(100_000, args.short_rate, seed=rng.randrange(1 << 30)) if t < args.duration]
    now = time.perf_counter()
    longs = []
    if with_long:
        longs = [asyncio.create_task(client.timed(
            TraceRequest(id=f"long-{i}", arrival_s=t, max_tokens=1, prompt_tokens=_random_prompt(rng, args.long_len)),
            now + t)) for i, t in enumerate(np.arange(0.0, args.duration, args.long_every))]
    shorts = [client.timed(TraceRequest(id=f"short-{i}", arrival_s=t, max_tokens=1,
                                        prompt_tokens=_random_prompt(rng, args.short_len)), now + t)
              for i, t in enumerate(offsets)]
    ttfts = list(await asyncio.gather(*shorts))
    await client.cancel(longs)
    return ttfts


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if math.isfinite(seconds) else "inf"


def _ms(values_s: Sequence[float], p: float) -> float:
    return float(np.percentile(np.asarray(values_s) * 1000.0, p))


async def run(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    result: dict[str, Any] = {}
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as http:
        client = Client(http, base_url)
        # Warm-up: the first requests pay for lazy initialisation, which is not what is measured.
        await client.timed(TraceRequest(id="warm", arrival_s=0.0, max_tokens=2, prompt_tokens=_random_prompt(rng, 600)))
        if args.only in (None, "newcomer"):
            rounds = []
            for i in range(args.rounds):
                delay = 0.5 + 0.5 * i / max(1, args.rounds - 1)  # spread over 0.5-1 s
                found = await newcomer_round(client, rng, args, delay)
                answered = (f"answered in {found['newcomer_s']:.2f} s" if found["newcomer_s"] is not None
                            else f"not answered within {args.newcomer_timeout:.0f} s")
                print(f"round {i}: newcomer sent {delay:.2f} s after the long prompts, {answered} "
                      f"({found['num_long_done']} of {args.num_long} long prompts done by then)", flush=True)
                rounds.append(found)
            result["newcomer"] = rounds
            latencies = [r["newcomer_s"] if r["newcomer_s"] is not None else math.inf for r in rounds]
            print(f"newcomer latency: max {_s(max(latencies))}, median {_s(float(np.median(latencies)))} "
                  f"over {len(latencies)} rounds (inf: not answered within {args.newcomer_timeout:.0f} s)",
                  flush=True)
        if args.only in (None, "mix"):
            for name, with_long in (("short only", False), ("with long", True)):
                ttfts = await mix_run(client, rng, args, with_long)
                result[name] = ttfts
                print(f"mix {name}: {len(ttfts)} short requests, TTFT p50 {_ms(ttfts, 50):.0f} ms, "
                      f"p99 {_ms(ttfts, 99):.0f} ms, max {_ms(ttfts, 100):.0f} ms", flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an already running server (default: start one with SERVE_ARGS)")
    parser.add_argument("--only", choices=["newcomer", "mix"], help="run one of the two measurements")
    parser.add_argument("--rounds", type=int, default=5, help="newcomer rounds (default %(default)s)")
    parser.add_argument("--num-long", type=int, default=4, help="long prompts per round (default %(default)s)")
    parser.add_argument("--newcomer-timeout", type=float, default=60.0,
                        help="seconds to wait for the newcomer before the round ends (default %(default)s)")
    parser.add_argument("--long-len", type=int, default=7600, help="long prompt tokens (default %(default)s)")
    parser.add_argument("--short-len", type=int, default=64, help="short prompt tokens (default %(default)s)")
    parser.add_argument("--short-rate", type=float, default=2.0, help="short requests/s (default %(default)s)")
    parser.add_argument("--long-every", type=float, default=15.0,
                        help="seconds between long prompts in the mix (default %(default)s)")
    parser.add_argument("--duration", type=float, default=60.0, help="mix run seconds (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-result", type=Path, help="write the raw numbers as JSON")
    parser.add_argument("serve_args", nargs="*", help="after --: options for `tokenloop serve`")
    args = parser.parse_args(argv)
    # A `timeout` or kill -TERM still stops the server this script started (the context manager's exit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.base_url:
        result = asyncio.run(run(args.base_url, args))
    else:
        with tempfile.TemporaryDirectory(prefix="bench-long-prefill-") as tmp:
            with served([*args.serve_args, "--log-level", "warning"], Path(tmp) / "server.log") as base_url:
                result = asyncio.run(run(base_url, args))
    if args.save_result:
        args.save_result.write_text(json.dumps({"serve_args": args.serve_args, **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
