"""What KV events cost: KVCacheManager allocate/free with no event log vs with one, interleaved in one run.

A workload of R requests x T prompt tokens (a shared system prefix, then distinct tokens) is prefilled in
chunks, one chunk per request per "step" (the log is flushed once per step, as the engine core will),
then freed. A second round of new prompts on the same pool (sized to hold one round) evicts the first
round's cached blocks, so BlockStored, BlockRemoved and the flushes are all on the timed path. Runs with
events off and on alternate, so both see the same machine noise; the best and median of the repeats are
reported. With --prehash the requests' block hashes are computed before the clock starts, isolating the
bookkeeping from SHA-256 (which both modes pay the same). Each run starts after a full `gc.collect()`;
a collection of the older generations can still land inside one run and double it (the medians show
it), so --gc-off times with the collector disabled, for the work alone.

Usage (from the repository root):
    PYTHONPATH=. python scripts/bench_kv_events.py [--requests 256] [--tokens 2048] [--block-size 16]
        [--chunk 512] [--shared 256] [--repeats 5] [--prehash] [--gc-off]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass

from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.kv_events import KVEventLog
from tokenloop.request import Request, SamplingParams


@dataclass(frozen=True)
class RunResult:
    seconds: float
    num_batches: int
    num_events: int


def make_round(rng: random.Random, round_id: int, args: argparse.Namespace,
               shared: list[int]) -> list[Request]:
    params = SamplingParams(max_tokens=1)
    num_own = args.tokens - len(shared)
    return [Request(f"q{round_id}-{i}", shared + [rng.randrange(49152) for _ in range(num_own)], params, 0)
            for i in range(args.requests)]


def run_once(args: argparse.Namespace, with_events: bool, seed: int) -> RunResult:
    rng = random.Random(seed)
    shared = [rng.randrange(49152) for _ in range(args.shared)]
    rounds = [make_round(rng, r, args, shared) for r in range(2)]
    num_blocks = args.requests * -(-args.tokens // args.block_size)
    log = KVEventLog() if with_events else None
    kv = KVCacheManager(num_blocks, args.block_size, events=log)
    if args.prehash:
        for request in (r for rnd in rounds for r in rnd):
            kv._update_block_hashes(request)
    num_batches = num_events = 0
    step = 0
    gc.collect()
    if args.gc_off:
        gc.disable()
    begin = time.perf_counter()
    for requests in rounds:
        for request in requests:  # admission: prefix lookup plus the first chunk
            hits, num_hit = kv.get_computed_blocks(request)
            n = min(args.chunk, request.num_tokens - num_hit)
            assert kv.allocate(request, n, hits, num_hit) is not None
            request.num_computed_tokens = num_hit + n
        while True:  # one step: every unfinished request gets its next chunk; then the log is flushed
            step += 1
            if log is not None and (batch := log.flush(step)) is not None:
                num_batches += 1
                num_events += len(batch.events)
            pending = [r for r in requests if r.num_computed_tokens < r.num_tokens]
            if not pending:
                break
            for request in pending:
                n = min(args.chunk, request.num_tokens - request.num_computed_tokens)
                assert kv.allocate(request, n) is not None
                request.num_computed_tokens += n
        for request in requests:
            kv.free(request)
        if log is not None and (batch := log.flush(step)) is not None:
            num_batches += 1
            num_events += len(batch.events)
    elapsed = time.perf_counter() - begin
    gc.enable()
    kv.check_invariants([])
    return RunResult(elapsed, num_batches, num_events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--shared", type=int, default=256, help="system-prefix tokens every prompt shares")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prehash", action="store_true", help="hash the blocks before the clock starts")
    parser.add_argument("--gc-off", action="store_true", help="disable the garbage collector while timing")
    args = parser.parse_args()

    times: dict[bool, list[float]] = {False: [], True: []}
    last: RunResult | None = None
    for repeat in range(args.repeats):
        for with_events in ((False, True) if repeat % 2 == 0 else (True, False)):
            result = run_once(args, with_events, seed=repeat)
            times[with_events].append(result.seconds)
            if with_events:
                last = result
    assert last is not None
    print(f"{args.requests} requests x {args.tokens} tokens, block {args.block_size}, chunk {args.chunk}, "
          f"shared prefix {args.shared}, 2 rounds (the second evicts the first), "
          f"prehash={args.prehash}, gc_off={args.gc_off}")
    for with_events in (False, True):
        label = "events on " if with_events else "events off"
        print(f"{label}: best {min(times[with_events]) * 1e3:8.1f} ms   "
              f"median {statistics.median(times[with_events]) * 1e3:8.1f} ms")
    best_off, best_on = min(times[False]), min(times[True])
    print(f"overhead: {(best_on - best_off) * 1e3:+.1f} ms best-to-best "
          f"({(best_on / best_off - 1) * 100:+.1f}%); "
          f"{last.num_batches} batches, {last.num_events} events per run")


if __name__ == "__main__":
    main()
