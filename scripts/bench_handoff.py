"""Handoff cost vs recompute, and live-migration downtime vs context length, per kind of replica.

For each replica kind (in this process, local processes, Ray actors) two replicas of the model start
behind a ReplicaSet; for each context length:

- recompute: a fresh prompt of that many tokens on an idle replica, max_tokens=1: its TTFT is what a
  handoff saves (the destination would otherwise prefill the whole context again);
- migrate: a request of that context decodes a few tokens on replica 0, then `cluster_migrate` moves it
  to replica 1 while it streams. Measured: the pause (the export sent -> the destination's import answered,
  from the handoff records), the largest gap in its token stream vs its median inter-token gap, the KV
  bytes moved, and whether its tokens equal an unmigrated run's.

With pre-copy (the default) only the last partial block moves in the pause, so the pause should stay flat
as the context grows; `--no-precopy` shows the alternative.

    python scripts/bench_handoff.py --contexts 256,1024,2048 --kinds inprocess,local,ray
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

from tokenloop.cluster.launch import ClusterOptions
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import DEFAULT_MODEL
from tokenloop.observe.records import HandoffRecord
from tokenloop.request import SamplingParams
from tokenloop.serving.async_engine import AsyncEngine


class HandoffLog:
    def __init__(self) -> None:
        self.records: list[HandoffRecord] = []

    def on_handoff(self, record: HandoffRecord) -> None:
        self.records.append(record)


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(length)]


async def _stream(engine: AsyncEngine, request_id: str, ids: list[int], params: SamplingParams,
                  migrate_after: int | None = None, cache_salt: str | None = None,
                  ) -> tuple[list[int], list[float], float | None]:
    """Tokens, their arrival times (s), and when the migration was asked for."""
    tokens: list[int] = []
    times: list[float] = []
    asked = None
    async for output in engine.generate(request_id, ids, params, cache_salt=cache_salt):
        delta = output.outputs[0].token_ids_delta
        now = time.perf_counter()
        tokens.extend(delta)
        times.extend([now] * len(delta))
        if migrate_after is not None and asked is None and len(tokens) >= migrate_after:
            asked = time.perf_counter()
            await engine.utility("cluster_migrate", request_id)
    return tokens, times, asked


def run_kind(args: argparse.Namespace, kind: str, precopy: bool) -> list[dict[str, Any]]:
    config = build_engine_config(args.model, max_num_seqs=4, max_num_batched_tokens=512,
                                 **({"weight_dtype": args.weight_dtype} if args.weight_dtype else {}))
    log = HandoffLog()
    begin = time.perf_counter()
    engine = AsyncEngine.with_replicas(config, ClusterOptions(replicas=2, cluster=kind, router="round-robin",
                                                              restart=False, precopy=precopy), observers=[log])
    print(f"[{kind}] two replicas ready in {time.perf_counter() - begin:.1f} s", file=sys.stderr, flush=True)
    rng = random.Random(0)
    rows = []
    try:
        for length in args.contexts:
            greedy = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True,
                                    output_kind="delta")
            one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_kind="delta")

            async def measure() -> dict[str, Any]:
                ttfts = []
                for i in range(args.repeats):
                    ids = _prompt(rng, length, engine.vocab_size)
                    sent = time.perf_counter()
                    await _stream(engine, f"recompute-{length}-{i}-{precopy}", ids, one)
                    ttfts.append(time.perf_counter() - sent)
                ids = _prompt(rng, length, engine.vocab_size)
                # Salted: the reference leaves no blocks the migration's destination could match by hash.
                reference, _, _ = await _stream(engine, f"ref-{length}-{precopy}", ids, greedy, cache_salt="ref")
                del log.records[:]
                rid = f"move-{length}-{precopy}"
                tokens, times, asked = await _stream(engine, rid, ids, greedy, migrate_after=args.migrate_after)
                gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
                events = {r.event: r for r in log.records if r.request_id == rid}
                paused, imported = events.get("paused"), events.get("imported")
                moved = sum(r.bytes_moved for r in log.records if r.request_id == rid)
                return {
                    "kind": kind, "precopy": precopy, "context": length,
                    "recompute_ms": 1000 * statistics.median(ttfts),
                    "pause_ms": (imported.ts_ns - paused.ts_ns) / 1e6 if paused and imported else None,
                    "max_gap_ms": 1000 * max(gaps) if gaps else None,
                    "median_itl_ms": 1000 * statistics.median(gaps) if gaps else None,
                    "kv_bytes_moved": moved, "outcome": "completed" if "completed" in events else str(events),
                    "same_tokens": tokens == reference,
                    "blocks_precopied": sum(r.blocks_copied for r in log.records
                                            if r.request_id == rid and r.event == "precopied"),
                    "blocks_in_pause": imported.blocks_copied if imported else None,
                }

            row = asyncio.run(measure())
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        engine.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--weight-dtype", choices=("float32", "bfloat16", "quantized"))
    parser.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",")], default=[256, 1024, 2048])
    parser.add_argument("--kinds", default="inprocess,local,ray")
    parser.add_argument("--no-precopy", action="store_true", help="also measure migrations without pre-copy")
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--migrate-after", type=int, default=8, help="tokens decoded before the migration")
    parser.add_argument("--repeats", type=int, default=2, help="recompute measurements per context")
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    rows = []
    for kind in args.kinds.split(","):
        for precopy in ([True, False] if args.no_precopy else [True]):
            rows.extend(run_kind(args, kind, precopy))
    print(f"{'kind':<10} {'precopy':>7} {'context':>7} {'recompute ms':>12} {'pause ms':>9} {'max gap ms':>10} "
          f"{'median ITL':>10} {'KV MB':>7} {'same':>5}")
    for r in rows:
        pause = f"{r['pause_ms']:.1f}" if r["pause_ms"] is not None else "-"
        print(f"{r['kind']:<10} {str(r['precopy']):>7} {r['context']:>7} {r['recompute_ms']:>12.1f} {pause:>9} "
              f"{r['max_gap_ms'] or 0:>10.1f} {r['median_itl_ms'] or 0:>10.1f} {r['kv_bytes_moved'] / 1e6:>7.2f} "
              f"{str(r['same_tokens']):>5}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
