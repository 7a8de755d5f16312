"""Real-size CPU speed and memory (issue 30): tokenloop and llama.cpp's server on the same Q4_K_M file.

For each shape (scripts/real_size_gguf.py: Llama 3.2 1B / 3B, Qwen3 1.7B) a random-weight Q4_K_M GGUF: random
F16 weights quantized by llama.cpp's `llama-quantize` where it is built (~/.cache/tokenloop/llama.cpp, by
scripts/baselines/llama_cpp.sh), else llama-quantize's type mix written directly as random blocks. Files are
cached outside the repo (~/.cache/tokenloop/real-size). Both servers as users start them (`tokenloop serve
--model FILE`; `llama-server -m FILE -t 2 -np 32 -c 16384 --kv-unified`), 127.0.0.1 only, alternated within each round,
the same client (`tokenloop bench serve`, chat: random prompts of 32 tokens, 64 output tokens, EOS
ignored) at 1, 8 and 32 streams; then one 2,048-token prompt (prefill tok/s = 2048 / TTFT) and the servers'
resident memory
(the process tree's RSS). The floor: this machine's read bandwidth (torch sums over 512 MB, both cores) and
one-stream decode as a fraction of `file bytes / bandwidth` tokens per second.
Usage: python scripts/bench_real_size.py [--shapes llama-1b llama-3b] [--streams 1 8 32] [--rounds 1]
                                         [--targets tokenloop llama.cpp] [--kind auto|llama-quantize|blocks]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_size_gguf  # beside this script

from tokenloop.bench.server_process import served_process, stop_server
from tokenloop.serving.server import free_port

CACHE = Path(os.environ.get("TOKENLOOP_CACHE_DIR", Path.home() / ".cache" / "tokenloop"))
LLAMA_BIN = Path.home() / ".cache" / "tokenloop" / "llama.cpp" / "build" / "bin"
ROOT = Path(__file__).resolve().parent.parent


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 7) -> float:
    """Best of `repeats` full reads of a float32 buffer (torch's sum on all threads): GB/s."""
    buffer = torch.ones(megabytes * (1 << 20) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best / 1e9


def model_file(shape: str, kind: str) -> Path:
    """The shape's Q4_K_M file, written (and quantized) once."""
    folder = CACHE / "real-size"
    folder.mkdir(parents=True, exist_ok=True)
    quantize = LLAMA_BIN / "llama-quantize"
    use_llama = kind == "llama-quantize" or (kind == "auto" and quantize.exists())
    out = folder / f"{shape}-q4_k_m{'' if use_llama else '-blocks'}.gguf"
    if out.exists():
        return out
    if not use_llama:
        return real_size_gguf.write(real_size_gguf.SHAPES[shape], out, "q4_k_m")
    f16 = folder / f"{shape}-f16.gguf"
    if not f16.exists():
        real_size_gguf.write(real_size_gguf.SHAPES[shape], f16, "f16")
    subprocess.run([str(quantize), str(f16), str(out), "Q4_K_M", "2"], check=True, stdout=subprocess.DEVNULL)
    f16.unlink()  # 2.5-6.4 GB: only the quantized file is kept
    return out


@contextlib.contextmanager
def server(target: str, path: Path, log: Path) -> Iterator[tuple[str, int]]:
    """The target serving `path` on 127.0.0.1: (base URL, pid) once healthy; stopped on exit."""
    if target == "tokenloop":
        with served_process(["--model", str(path), "--no-trace", "--log-level", "warning"], log,
                            health_timeout_s=1800) as (url, process):  # a 3B load on a loaded machine
            yield url, process.pid
        return
    port = free_port()
    # --kv-unified: the 32 slots share the 16k context (else each has 512 tokens and the 2k prompt is refused).
    command = [str(LLAMA_BIN / "llama-server"), "-m", str(path), "-t", "2", "-np", "32", "-c", "16384",
               "--kv-unified", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"llama-server did not become healthy (see {log})")
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        stop_server(process)


def tree_rss_mib(pid: int) -> float:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]) / (1 << 20)


def bench(url: str, streams: int, input_len: int, output_len: int, seed: int,
          prompts: int = 0) -> dict[str, float]:
    """One client run: `prompts` requests (default: 4 one after another at one stream, else one a stream)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        prompts = prompts or (4 if streams == 1 else streams)
        subprocess.run([sys.executable, "-m", "tokenloop", "bench", "serve", "--base-url", url,
                        "--endpoint", "/v1/chat/completions", "--dataset", "random", "--request-rate", "inf",
                        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
                        "--num-prompts", str(prompts), "--max-concurrency", str(streams), "--seed", str(seed),
                        "--save-result", result.name, "--disable-tqdm"],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        data = json.loads(Path(result.name).read_text())
    return {"tok_s": data["output_throughput"], "ttft_ms": data["mean_ttft_ms"],
            "itl_ms": data["mean_itl_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-3b"],
                        choices=sorted(real_size_gguf.SHAPES))
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--targets", nargs="+", default=["tokenloop", "llama.cpp"],
                        choices=["tokenloop", "llama.cpp"])
    parser.add_argument("--kind", choices=["auto", "llama-quantize", "blocks"], default="auto")
    args = parser.parse_args()
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth (torch sum, {torch.get_num_threads()} threads): {bandwidth:.1f} GB/s")
    targets = [t for t in args.targets if t != "llama.cpp" or (LLAMA_BIN / "llama-server").exists()]
    print("| shape | target | round | streams | out tok/s | TTFT ms | ITL ms | of floor | prefill 2k tok/s "
          "| RSS MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shapes:
        path = model_file(shape, args.kind)
        floor = bandwidth * 1e9 / path.stat().st_size  # tokens/s if each read the file once at full bandwidth
        print(f"<!-- {shape}: {path.name}, {path.stat().st_size / 1e6:.0f} MB, floor {floor:.1f} tok/s -->")
        for round_ in range(1, args.rounds + 1):
            for target in targets:
                with server(target, path, CACHE / "real-size" / f"{target}.log") as (url, pid):
                    bench(url, 2, 32, 8, seed=99)  # warm-up
                    prefill = bench(url, 1, 2048, 1, seed=round_, prompts=1)
                    for streams in args.streams:
                        row = bench(url, streams, 32, 64, seed=round_)
                        share = f"{row['tok_s'] / floor:.2f}" if streams == 1 else ""
                        print(f"| {shape} | {target} | {round_} | {streams} | {row['tok_s']:.1f} | "
                              f"{row['ttft_ms']:.0f} | {row['itl_ms']:.1f} | {share} | "
                              f"{2048 / (prefill['ttft_ms'] / 1e3):.0f} | {tree_rss_mib(pid):.0f} |",
                              flush=True)

if __name__ == "__main__":
    main()
