"""Served vs offline loop, side by side in one run: what the HTTP front end and the engine-core boundary cost.

At each stream count N the same N chat requests (32 random token ids decoded to text, wrapped in the model's
chat template, greedy, ignore_eos, `--output-len` tokens each, all sent at once) run through:

- offline: `LLM(model, dtype, weight_dtype).engine`, the N requests added at once (the token ids the server's
  chat template gives, so prompts match token for token), stepped to completion; ITL from each finished
  request's `metrics.itls_s`, pooled;
- process / thread: `tokenloop serve --engine-core process|thread` on 127.0.0.1 (a free port), driven by
  `tokenloop bench serve` (the project's client; its saved JSON is parsed). Served ITL is the gap between
  streamed chunks that carry text, as vLLM's client measures it: a chunk may carry more than one token.

Every measurement gets a fresh engine (LLM or server) and a warm-up run of N requests on other prompts first,
so no measured prompt is in the prefix cache. With --repeats > 1 the modes take turns within each stream count
(the order rotates every repeat) so slow drift hits them alike; ITLs and TPOTs are pooled over the repeats.

Usage: python scripts/bench_served_vs_offline.py [--model M] [--dtype auto|float32|bfloat16]
           [--weight-dtype float32|bfloat16|quantized] [--streams 1 8 32] [--modes offline process thread]
           [--output-len 64] [--repeats 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenloop.bench.datasets import (
    DatasetConfig,
    as_text_prompts,
    build_requests,
    load_tokenizer,
)
from tokenloop.bench.metrics import LatencyStats
from tokenloop.bench.server_process import served
from tokenloop.model.loader import DEFAULT_MODEL

MODES = ("offline", "process", "thread")
INPUT_LEN = 32
MEASURE_SEED = 0
WARMUP_SEED = 1  # other prompts than the measured ones: the warm-up leaves them out of the prefix cache
WARMUP_OUTPUT_LEN = 16


# ---- the workload --------------------------------------------------------------------------------

def chat_prompts(tokenizer: Any, num: int, seed: int, output_len: int) -> list[str]:
    """The user messages `bench serve --endpoint /v1/chat/completions --dataset random` sends."""
    config = DatasetConfig(name="random", num_prompts=num, seed=seed, random_input_len=INPUT_LEN,
                           random_output_len=output_len)
    return [r.prompt or "" for r in as_text_prompts(build_requests(config), tokenizer)]


# ---- offline -------------------------------------------------------------------------------------

def _offline_batch(engine: Any, prompts: list[list[int]], output_len: int, tag: str) -> tuple[list[Any], float]:
    """Add every prompt at once, step to completion; the finished outputs and the wall time."""
    from tokenloop import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", None, params, prompt_token_ids=ids)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    return finished, time.perf_counter() - start


def run_offline(args: argparse.Namespace, client_tokenizer: Any, streams: int) -> dict[str, Any]:
    from tokenloop import LLM

    llm = LLM(args.model, **engine_options(args))
    try:
        engine = llm.engine

        def ids_of(texts: list[str]) -> list[list[int]]:  # as the server's chat endpoint tokenizes them
            return [engine.tokenizer.encode_chat([{"role": "user", "content": t}])[1] for t in texts]

        _offline_batch(engine, ids_of(chat_prompts(client_tokenizer, streams, WARMUP_SEED, WARMUP_OUTPUT_LEN)),
                       min(WARMUP_OUTPUT_LEN, args.output_len), "warmup")
        prompts = ids_of(chat_prompts(client_tokenizer, streams, MEASURE_SEED, args.output_len))
        outputs, duration = _offline_batch(engine, prompts, args.output_len, "run")
        dtype = engine.dtype_choice.describe()
    finally:
        del llm
        gc.collect()
    if len(outputs) != streams:
        raise RuntimeError(f"offline: {len(outputs)} of {streams} requests finished")
    metrics = [o.metrics for o in outputs]
    return {
        "duration_s": duration,
        "prompt_lens": [m.num_prompt_tokens for m in metrics],
        "output_lens": [m.num_generation_tokens for m in metrics],
        "ttfts_s": [m.ttft_s for m in metrics],
        "tpots_s": [m.tpot_s for m in metrics if m.tpot_s is not None],
        "itls_s": [list(m.itls_s) for m in metrics],
        "engine": dtype,
    }


# ---- served --------------------------------------------------------------------------------------

@contextlib.contextmanager
def server(args: argparse.Namespace, mode: str, workdir: Path) -> Iterator[str]:
    """`tokenloop serve --engine-core MODE` on a free local port, up and healthy; stopped on the way out."""
    serve_args = ["--model", args.model, "--engine-core", mode, "--no-trace", "--log-level", "warning"]
    for flag, value in engine_options(args).items():
        serve_args += [f"--{flag.replace('_', '-')}", value]
    with served(serve_args, workdir / f"serve-{mode}.log", name=f"{mode} server") as base_url:
        yield base_url


def bench_serve(args: argparse.Namespace, base_url: str, streams: int, output_len: int, seed: int,
                result_file: Path) -> dict[str, Any]:
    """One `tokenloop bench serve` run; its saved result."""
    cmd = [sys.executable, "-m", "tokenloop", "bench", "serve", "--base-url", base_url,
           "--endpoint", "/v1/chat/completions", "--tokenizer", args.model, "--dataset", "random",
           "--request-rate", "inf", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(output_len),
           "--num-prompts", str(streams), "--max-concurrency", str(streams), "--seed", str(seed),
           "--save-result", str(result_file), "--disable-tqdm"]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0 or not result_file.exists():
        raise RuntimeError(f"bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    result = json.loads(result_file.read_text(encoding="utf-8"))
    if result["failed"]:
        first = next((e for e in result["errors"] if e), "")
        raise RuntimeError(f"bench serve: {result['failed']} of {streams} requests failed: {first}")
    return result


def run_served(args: argparse.Namespace, mode: str, streams: int, workdir: Path) -> dict[str, Any]:
    with server(args, mode, workdir) as base_url:
        bench_serve(args, base_url, streams, min(WARMUP_OUTPUT_LEN, args.output_len), WARMUP_SEED,
                    workdir / f"warmup-{mode}-{streams}.json")
        result = bench_serve(args, base_url, streams, args.output_len, MEASURE_SEED,
                             workdir / f"run-{mode}-{streams}.json")
    tpots = [(e2el - ttft) / (n - 1) for e2el, ttft, n in zip(result["e2els"], result["ttfts"], result["output_lens"])
             if n > 1]
    return {
        "duration_s": result["duration"],
        "prompt_lens": result["input_lens"],  # the server's usage.prompt_tokens
        "output_lens": result["output_lens"],
        "ttfts_s": result["ttfts"],
        "tpots_s": tpots,
        "itls_s": result["itls"],
        "client": {k: result[k] for k in ("mean_itl_ms", "median_itl_ms", "mean_tpot_ms", "output_throughput")
                   if k in result},
    }


# ---- the comparison ------------------------------------------------------------------------------

def engine_options(args: argparse.Namespace) -> dict[str, str]:
    return {k: v for k, v in (("dtype", args.dtype), ("weight_dtype", args.weight_dtype)) if v is not None}


def summarize(streams: int, mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row: ITLs and TPOTs pooled over the repeats, throughput their mean."""
    itls = [gap for run in runs for request in run["itls_s"] for gap in request]
    itl = LatencyStats.of(itls, (99.0,))
    tpot = LatencyStats.of([t for run in runs for t in run["tpots_s"]], ())
    ttft = LatencyStats.of([t for run in runs for t in run["ttfts_s"] if t is not None], ())
    throughputs = [sum(run["output_lens"]) / run["duration_s"] for run in runs]
    prompt_lens = [n for run in runs for n in run["prompt_lens"]]
    output_lens = [n for run in runs for n in run["output_lens"]]
    return {
        "streams": streams, "mode": mode, "repeats": len(runs),
        "mean_itl_ms": itl.mean_ms, "median_itl_ms": itl.median_ms, "p99_itl_ms": itl.percentile(99.0),
        "mean_tpot_ms": tpot.mean_ms, "mean_ttft_ms": ttft.mean_ms,
        "output_throughput": statistics.fmean(throughputs), "output_throughputs": throughputs,
        "num_itls": len(itls), "tokens_after_first": sum(max(0, n - 1) for n in output_lens),
        "mean_prompt_tokens": statistics.fmean(prompt_lens), "mean_output_tokens": statistics.fmean(output_lens),
    }


def add_vs_offline(rows: list[dict[str, Any]]) -> None:
    """Each served row's mean ITL relative to the offline loop's at the same stream count (in %)."""
    offline = {r["streams"]: r["mean_itl_ms"] for r in rows if r["mode"] == "offline"}
    for r in rows:
        base = offline.get(r["streams"])
        served = r["mode"] != "offline" and base
        r["itl_vs_offline_pct"] = 100.0 * (r["mean_itl_ms"] / base - 1.0) if served else None


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| streams | mode | mean ITL ms | median ITL ms | TPOT ms | output tok/s | ITL vs offline (%) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = "-" if r["itl_vs_offline_pct"] is None else f"{r['itl_vs_offline_pct']:+.1f}"
        lines.append(f"| {r['streams']} | {r['mode']} | {r['mean_itl_ms']:.2f} | {r['median_itl_ms']:.2f} | "
                     f"{r['mean_tpot_ms']:.2f} | {r['output_throughput']:.1f} | {vs} |")
    return "\n".join(lines)


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """What the table does not say: prompt lengths after the template, and chunks carrying several tokens."""
    out = []
    prompt = sorted({round(r["mean_prompt_tokens"], 1) for r in rows})
    out.append(f"prompts: {INPUT_LEN} random token ids decoded to text, in the chat template: mean "
               f"{'/'.join(str(p) for p in prompt)} prompt tokens per request (offline gets the server's chat "
               "token ids)")
    for r in rows:
        if r["mode"] != "offline" and r["num_itls"] != r["tokens_after_first"]:
            out.append(f"{r['mode']} at {r['streams']} streams: {r['num_itls']} ITL gaps for "
                       f"{r['tokens_after_first']} tokens after the first (some chunks carried several tokens, "
                       "so its ITL is per chunk; TPOT is per token)")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="(default: %(default)s)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help="activations and KV cache "
                        "(default: the engine's, auto)")
    parser.add_argument("--weight-dtype", choices=["float32", "bfloat16", "quantized"],
                        help="projection weights (default: the engine's choice for --dtype)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", help="write every run and the summary here")
    args = parser.parse_args(argv)
    if min(args.streams) < 1 or args.output_len < 2 or args.repeats < 1:
        parser.error("--streams and --repeats must be >= 1, --output-len >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM unwinds like a Ctrl-C: every `finally` stops its server. SIGINT is handled even where a shell
    # started this in the background with it ignored, so the servers (which inherit it) can be stopped with it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    client_tokenizer = load_tokenizer(args.model)  # what `bench serve --tokenizer MODEL` decodes prompts with
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp:
        workdir = Path(tmp)
        for streams in args.streams:
            for repeat in range(args.repeats):
                shift = repeat % len(args.modes)
                for mode in args.modes[shift:] + args.modes[:shift]:
                    begin = time.perf_counter()
                    if mode == "offline":
                        run = run_offline(args, client_tokenizer, streams)
                    else:
                        run = run_served(args, mode, streams, workdir)
                    run.update(streams=streams, mode=mode, repeat=repeat)
                    runs.append(run)
                    itls = [g for r in run["itls_s"] for g in r]
                    print(f"streams={streams} repeat={repeat} {mode}: mean ITL "
                          f"{1000 * statistics.fmean(itls) if itls else 0:.2f} ms, "
                          f"{sum(run['output_lens']) / run['duration_s']:.1f} tok/s "
                          f"({time.perf_counter() - begin:.0f} s with load and warm-up)", file=sys.stderr, flush=True)
    rows = [summarize(s, m, [r for r in runs if r["streams"] == s and r["mode"] == m])
            for s in args.streams for m in args.modes]
    add_vs_offline(rows)
    engine = next((r["engine"] for r in runs if "engine" in r), None)
    print(f"\nmodel {args.model}, dtype {args.dtype or 'auto'}, weight dtype {args.weight_dtype or 'auto'}"
          + (f" (offline engine: {engine})" if engine else "") + f"; {args.output_len} output tokens, greedy, "
          f"ignore_eos; {args.repeats} repeat(s)")
    print(table(rows))
    for line in notes(rows):
        print(f"- {line}")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        config.update(input_len=INPUT_LEN, seed=MEASURE_SEED, warmup_seed=WARMUP_SEED, offline_engine=engine)
        Path(args.json).write_text(json.dumps({"config": config, "summary": rows, "notes": notes(rows),
                                               "runs": runs}, indent=1), encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted: every server started was stopped", file=sys.stderr)
        sys.exit(130)
