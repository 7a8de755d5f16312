"""The GPU path's device check (issue 14): one command, a table, a few small result files.

    python scripts/device_check.py --device cuda --out $OUT      # on a GPU machine, a few minutes
    python scripts/device_check.py --device cpu --quick --out d  # tiny sizes on the CPU (CI runs this)

Sections:
1. parity: a tiny random fp32 model through the whole engine core on the device and on the CPU: the same
   greedy tokens for batched, chunked, prefix-hit and preempted runs.
2. attention: the Triton kernel (decode rows and prefill chunks over the paged cache) against the gather +
   SDPA reference, on SmolLM2-135M and Llama-3-8B head layouts; on the CPU under TRITON_INTERPRET=1.
3. decode: ms per step at each batch (eager; the CUDA-graphs column is pending until a device run proves
   capture), on SmolLM2-135M- and Llama-3-8B-shaped models with random weights, the memory bandwidth that
   implies (weights + KV read per step) against a device-to-device copy's, and prefill tok/s.
4. engine: the engine core on the SmolLM2-shaped model, the step split into forward and the rest, and a
   step-cost profile for the simulator fitted from its StepRecords (tokenloop/sim/profiles format).

Needs only torch (and triton for section 2; without it that section says so) besides tokenloop's own light
dependencies: numpy, tokenizers, jinja2, tqdm, pyyaml and gguf (imported by the model code; a wheel to carry
where it is missing). Model weights are random: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

# The Triton interpreter must be chosen before any kernel is decorated (that is, before triton is imported).
_early = argparse.ArgumentParser(add_help=False)
_early.add_argument("--device")
if _early.parse_known_args()[0].device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from tests.model.paged_harness import (
    random_paged_step,  # the attention tests' step generator
)
from tokenloop.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.messages import CoreRequest
from tokenloop.model.attention import (
    AttentionMetadata,
    paged_attention,
    triton_attention_kernels,
)
from tokenloop.model.loader import Checkpoint
from tokenloop.model.models.llama import LlamaModel
from tokenloop.observe.records import EngineObserver, StepRecord
from tokenloop.request import SamplingParams
from tokenloop.sim.cost import fit
from tokenloop.sim.profiles import fitted_profile

BLOCK_SIZE = 16
# Datasheet HBM bandwidths, bytes/s, for the table's "of peak" column (the measured copy is printed too).
DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


@dataclass(frozen=True)
class Shape:
    name: str
    config: ModelConfig


def _config(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int,
            tied: bool) -> ModelConfig:
    return ModelConfig("llama", vocab, hidden, inter, layers, heads, kv_heads, head_dim, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=tied)


def model_shapes(quick: bool) -> list[Shape]:
    """SmolLM2-135M and Llama-3-8B as published; --quick keeps their head layouts and shrinks the rest."""
    if quick:
        return [Shape("smollm2-135m-shaped (quick)", _config(1024, 576, 256, 2, 9, 3, 64, True)),
                Shape("llama3-8b-shaped (quick)", _config(1024, 256, 256, 1, 32, 8, 128, False))]
    return [Shape("smollm2-135m-shaped", _config(49152, 576, 1536, 30, 9, 3, 64, True)),
            Shape("llama3-8b-shaped", _config(128256, 4096, 14336, 32, 32, 8, 128, False))]


def random_weights(config: ModelConfig, device: str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """HF-named random weights, made on `device` in `dtype` (an 8B model never exists in fp32 on the host)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d = config.hidden_size, config.head_dim

    def randn(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    weights = {"model.embed_tokens.weight": randn(config.vocab_size, h, std=1.0), "model.norm.weight": ones(h)}
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = randn(config.vocab_size, h, std=h ** -0.5)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": randn(config.num_heads * d, h, std=h ** -0.5),
            p + "self_attn.k_proj.weight": randn(config.num_kv_heads * d, h, std=h ** -0.5),
            p + "self_attn.v_proj.weight": randn(config.num_kv_heads * d, h, std=h ** -0.5),
            p + "self_attn.o_proj.weight": randn(h, config.num_heads * d, std=(config.num_heads * d) ** -0.5),
            p + "mlp.gate_proj.weight": randn(config.intermediate_size, h, std=h ** -0.5),
            p + "mlp.up_proj.weight": randn(config.intermediate_size, h, std=h ** -0.5),
            p + "mlp.down_proj.weight": randn(h, config.intermediate_size, std=config.intermediate_size ** -0.5),
        }
    return weights


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- 1. parity -----------------------------------------------------------------------------------

def _scenarios(quick: bool) -> dict[str, tuple[dict[str, Any], list[list[list[int]]]]]:
    """name -> (engine options, waves of prompts: each wave runs to completion before the next is added)."""
    rng = random.Random(0)
    lengths = [5, 17, 33, 48, 70, 3] if not quick else [5, 17, 33, 3]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    shared = [rng.randrange(3, 500) for _ in range(3 * BLOCK_SIZE)]
    tails = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 20)]
    # 30-token prompts take 2 blocks and a third once they pass 32 tokens: 7 blocks hold three of them at
    # first, and as they grow one is preempted (by recompute) for the others.
    crowded = [[rng.randrange(3, 500) for _ in range(30)] for _ in range(4)]
    return {
        "batched": ({"max_num_batched_tokens": 512}, [prompts]),
        "chunked": ({"max_num_batched_tokens": 24}, [prompts]),
        "prefix-hit": ({"max_num_batched_tokens": 512}, [[shared + tails[0]], [shared + t for t in tails[1:]]]),
        "preempted": ({"max_num_batched_tokens": 512, "num_blocks": 7}, [crowded]),
    }


def run_scenario(checkpoint: Checkpoint, device: str, options: dict[str, Any], waves: list[list[list[int]]],
                 max_tokens: int) -> tuple[list[list[int]], int, int]:
    """Greedy tokens per request, and how many prompt tokens hit the prefix cache and how many preemptions."""
    config = EngineConfig(model="random-tiny", device=device, dtype="float32", seed=0,
                          cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=options.get("num_blocks", 256)),
                          scheduler=SchedulerConfig(max_num_seqs=16,
                                                    max_num_batched_tokens=options["max_num_batched_tokens"]))
    core = EngineCore(config, checkpoint=checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    cached = preemptions = 0
    count = 0
    for wave in waves:
        requests = [CoreRequest(f"r{count + i}", prompt, params, 0) for i, prompt in enumerate(wave)]
        count += len(wave)
        core.add_requests(requests)
        for r in requests:
            tokens[r.request_id] = []
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                if out.finish_reason == "error":
                    raise RuntimeError(f"{out.request_id} failed: {out.stop_reason}")
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finish_reason is not None:
                    cached += out.num_cached_tokens
                    preemptions += out.num_preemptions
    return [tokens[f"r{i}"] for i in range(count)], cached, preemptions


def check_parity(device: str, quick: bool) -> list[dict[str, Any]]:
    config = _config(512, 128, 256, 2, 4, 2, 32, False)
    checkpoint = Checkpoint("random-tiny", Path("."), config, random_weights(config, "cpu", torch.float32, 1),
                            None)  # type: ignore[arg-type]  # no tokenizer: token ids in, token ids out
    max_tokens = 8 if quick else 16
    rows = []
    for name, (options, waves) in _scenarios(quick).items():
        cpu_tokens, _, _ = run_scenario(checkpoint, "cpu", options, waves, max_tokens)
        device_tokens, cached, preemptions = run_scenario(checkpoint, device, options, waves, max_tokens)
        diverged = [i for i, (a, b) in enumerate(zip(cpu_tokens, device_tokens)) if a != b]
        # A scenario that did not do what it is named for proves nothing: it fails too.
        exercised = {"prefix-hit": cached > 0, "preempted": preemptions > 0}.get(name, True)
        rows.append({"scenario": name, "requests": len(cpu_tokens), "identical": not diverged,
                     "exercised": exercised, "diverged_requests": diverged, "prefix_hit_tokens": cached,
                     "preemptions": preemptions})
    return rows


# ---- 2. attention kernels against the reference ---------------------------------------------------

def _time(fn: Callable[[], object], device: str, repeats: int) -> float:
    """Seconds per call after one warm-up call, the device's queue drained before and after."""
    fn()
    _synchronize(device)
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    _synchronize(device)
    return (time.perf_counter() - begin) / repeats


def check_attention(device: str, quick: bool) -> list[dict[str, Any]]:
    kernels = triton_attention_kernels()
    if kernels is None:
        return [{"case": "triton", "status": "triton not importable here: section skipped"}]
    cases = {"decode": [(c, 1) for c in (15, 16, 17, 100, 300, 1000)],
             "mixed": [(0, 1), (40, 1), (0, 37), (16, 9), (33, 70), (200, 1)]}
    if not quick:
        cases["decode-b64-ctx2k"] = [(2047, 1)] * 64
        cases["prefill-2x1k-after-1k"] = [(1024, 1024), (1024, 1024)]
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
    rows = []
    for heads, kv_heads, head_dim in ((9, 3, 64), (32, 8, 128)):
        for case, lengths in cases.items():
            if quick and heads == 32 and case == "decode":
                continue  # the interpreter is slow: one Llama layout case is enough on the CPU
            for dtype in dtypes:
                st = random_paged_step(lengths, heads, kv_heads, head_dim, BLOCK_SIZE, dtype, device,
                                       seed=len(lengths) + head_dim)
                scale = head_dim ** -0.5
                reference_meta = AttentionMetadata.build(st.starts, st.seq_lens, st.block_table, st.slots, BLOCK_SIZE)
                kernel_meta = AttentionMetadata.build(st.starts, st.seq_lens, st.block_table, st.slots, BLOCK_SIZE,
                                                      kernels, kernels)
                inputs = (st.query, st.key, st.value, st.key_cache, st.value_cache)
                reference = paged_attention(*inputs, reference_meta, scale)
                kernel = paged_attention(*inputs, kernel_meta, scale)
                error = float((kernel.float() - reference.float()).abs().max())
                # bf16: outputs up to ~4 in size round at 2^-6, and the kernel rounds P to bf16 before P @ V.
                tolerance = 1e-4 if dtype == torch.float32 else 6e-2
                row = {"case": f"{case} {heads}/{kv_heads}x{head_dim} {str(dtype).removeprefix('torch.')}",
                       "max_abs_error": error, "ok": error <= tolerance}
                if device != "cpu":  # timings under the interpreter mean nothing
                    row["reference_ms"] = 1e3 * _time(
                        partial(paged_attention, *inputs, reference_meta, scale), device, 20)
                    row["triton_ms"] = 1e3 * _time(
                        partial(paged_attention, *inputs, kernel_meta, scale), device, 20)
                rows.append(row)
    return rows


# ---- 3. decode and prefill throughput -------------------------------------------------------------

def _decode_meta(batch: int, context: int, num_blocks: int, device: str, model: LlamaModel,
                 rng: random.Random) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """A decode step of `batch` requests with `context` tokens each (the new one included), blocks scattered."""
    per_request = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
    blocks = rng.sample(range(num_blocks), batch * per_request)
    table = torch.tensor(blocks, dtype=torch.long).view(batch, per_request)
    position = context - 1
    slots = table[:, position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
    meta = AttentionMetadata.build(list(range(batch + 1)), [context] * batch, table.to(device), slots.to(device),
                                   BLOCK_SIZE, model.decode_kernel, model.prefill_kernel)
    ids = torch.randint(3, model.config.vocab_size, (batch,), device=device)
    return meta, ids, torch.full((batch,), position, dtype=torch.long, device=device)


def weight_bytes(model: LlamaModel) -> int:
    """Bytes a decode step streams from the weights: every projection and the LM head once."""
    total = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    for layer in model.layers:
        for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            total += w.numel() * w.element_size()
    return total


def copy_bandwidth(device: str, quick: bool) -> float:
    """Bytes/s of a device-to-device copy, counting the bytes read and the bytes written."""
    n = (16 << 20) if quick else (2 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), device, 5 if quick else 20)
    return 2 * n / seconds


def measure_throughput(device: str, quick: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    batches = [1, 8] if quick else [1, 8, 32, 128, 256]
    context = 32 if quick else 1024
    steps = 2 if quick else 20
    prefill_tokens = 64 if quick else 2048
    decode_rows, prefill_rows = [], []
    for shape in model_shapes(quick):
        weights = random_weights(shape.config, device, dtype, seed=2)
        model = LlamaModel.from_weights(shape.config, weights, device=device, dtype=dtype, max_positions=4096)
        del weights
        per_request = (context + BLOCK_SIZE - 1) // BLOCK_SIZE
        prefill_blocks = (prefill_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE
        num_blocks = max(max(batches) * per_request, prefill_blocks) + 8
        kv = model.allocate_kv_cache(num_blocks, BLOCK_SIZE)
        kv_per_token = model.kv_bytes_per_block(BLOCK_SIZE) // BLOCK_SIZE
        rng = random.Random(3)
        with torch.inference_mode():
            for batch in batches:
                meta, ids, positions = _decode_meta(batch, context, num_blocks, device, model, rng)
                seconds = _time(partial(model.forward, ids, positions, meta, kv), device, steps)
                moved = weight_bytes(model) + batch * context * kv_per_token
                decode_rows.append({"model": shape.name, "dtype": str(dtype).removeprefix("torch."),
                                    "batch": batch, "context": context, "eager_ms": 1e3 * seconds,
                                    "graphs_ms": "pending", "tok_s": batch / seconds,
                                    "bytes_per_step": moved, "bandwidth_gb_s": moved / seconds / 1e9})
            ids = torch.randint(3, shape.config.vocab_size, (prefill_tokens,), device=device)
            positions = torch.arange(prefill_tokens, device=device)
            blocks = torch.arange(prefill_blocks)[None, :]
            meta = AttentionMetadata.build([0, prefill_tokens], [prefill_tokens], blocks.to(device), positions,
                                           BLOCK_SIZE, model.decode_kernel, model.prefill_kernel)
            last = torch.tensor([prefill_tokens - 1], device=device)
            seconds = _time(partial(model.forward, ids, positions, meta, kv, last), device, 1 if quick else 5)
            prefill_rows.append({"model": shape.name, "tokens": prefill_tokens, "ms": 1e3 * seconds,
                                 "tok_s": prefill_tokens / seconds})
        del model, kv
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return decode_rows, prefill_rows


# ---- 4. the engine: overhead split and a simulator profile ------------------------------------------

class _Keep(EngineObserver):
    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)


def engine_run(device: str, quick: bool, out: Path) -> dict[str, Any]:
    shape = model_shapes(quick)[0]
    dtype = "float32" if device == "cpu" else "bfloat16"
    weights = random_weights(shape.config, "cpu", torch.float32, seed=4)
    checkpoint = Checkpoint(shape.name, Path("."), shape.config, weights, None)  # type: ignore[arg-type]
    batches = [1, 4] if quick else [1, 8, 32, 128]
    contexts = [16, 48] if quick else [128, 1024]
    decode_tokens = 4 if quick else 32
    keep = _Keep()
    config = EngineConfig(model=shape.name, device=device, dtype=dtype, seed=0,
                          cache=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False,
                                            num_blocks=max(batches) * (max(contexts) + decode_tokens) // BLOCK_SIZE
                                            + max(batches) + 8),
                          scheduler=SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=2048))
    core = EngineCore(config, checkpoint=checkpoint, observers=[keep])
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    count = 0

    def run(batch: int, context: int) -> None:
        nonlocal count
        core.add_requests([CoreRequest(f"q{count + i}", [rng.randrange(3, 1000) for _ in range(context)], params, 0)
                           for i in range(batch)])
        count += batch
        while core.has_unfinished_requests():
            core.step()

    run(2, 16)  # warm-up: first launches, kernel compilation
    keep.records.clear()
    begin = time.perf_counter()
    for batch in batches:
        for context in contexts:
            run(batch, context)
    wall = time.perf_counter() - begin
    records = keep.records
    step_ns = sum(r.end_ns - r.start_ns for r in records)
    forward_ns = sum(r.forward_ns for r in records)
    stage = {name: sum(getattr(r, b) - getattr(r, a) for r in records) / max(1, step_ns) for name, a, b in (
        ("schedule", "start_ns", "schedule_end_ns"), ("execute", "schedule_end_ns", "execute_end_ns"),
        ("sample", "execute_end_ns", "sample_end_ns"), ("update", "sample_end_ns", "end_ns"))}
    report = fit(records)
    name = f"{'cpu' if device == 'cpu' else _device_slug()}-{shape.name.split()[0]}"
    command = f"python scripts/device_check.py --device {device}{' --quick' if quick else ''}"
    hardware = f"{_device_name(device)}, {core.dtype_choice.describe()}, random weights, eager (no CUDA graphs)"
    profile = fitted_profile(name, shape.name, hardware, core.max_model_len,
                             core.model.kv_bytes_per_block(1), BLOCK_SIZE, report, command,
                             time.strftime("%Y-%m-%d", time.gmtime()))
    (out / "profile.json").write_text(json.dumps(profile, indent=1) + "\n", encoding="utf-8")
    return {"model": shape.name, "dtype": dtype, "steps": len(records), "wall_s": wall,
            "mean_step_ms": step_ns / max(1, len(records)) / 1e6,
            "mean_forward_ms": forward_ns / max(1, len(records)) / 1e6,
            "forward_share": forward_ns / max(1, step_ns), "stage_shares": stage,
            "profile": profile["cost"]["coefficients"], "profile_fit_median_rel_error": report.median_abs_rel_error}


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({os.cpu_count()} cores)"


def _device_slug() -> str:
    name = torch.cuda.get_device_name()
    for known in DATASHEET_BANDWIDTH:
        if known in name:
            return known.lower()
    return "cuda"


# ---- the table -------------------------------------------------------------------------------------

def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    cells = [[cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [title, "  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU run CI does)")
    parser.add_argument("--out", required=True, help="folder for results.json, profile.json and table.txt")
    parser.add_argument("--sections", default="parity,attention,throughput,engine",
                        help="comma-separated subset of parity,attention,throughput,engine")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"error: --device cuda, but torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    results: dict[str, Any] = {
        "device": _device_name(args.device), "torch": torch.__version__, "quick": args.quick,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cuda_graphs": "pending: no capture yet"}
    try:
        import triton
        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    tables = []
    begin = time.perf_counter()
    if "parity" in sections:
        results["parity"] = check_parity(args.device, args.quick)
        tables.append(_table("parity (greedy tokens, device vs CPU, fp32)", results["parity"],
                             ["scenario", "requests", "identical", "exercised", "prefix_hit_tokens",
                              "preemptions"]))
    if "attention" in sections:
        results["attention"] = check_attention(args.device, args.quick)
        tables.append(_table("attention: Triton kernel vs gather + SDPA reference", results["attention"],
                             ["case", "max_abs_error", "ok", "reference_ms", "triton_ms", "status"]))
    if "throughput" in sections:
        peak = copy_bandwidth(args.device, args.quick)
        datasheet = next((v for k, v in DATASHEET_BANDWIDTH.items() if k in results["device"]), None)
        results["copy_bandwidth_gb_s"] = peak / 1e9
        results["datasheet_bandwidth_gb_s"] = datasheet / 1e9 if datasheet else None
        decode, prefill = measure_throughput(args.device, args.quick)
        for row in decode:
            row["of_copy_bw"] = row["bandwidth_gb_s"] * 1e9 / peak
            if datasheet:
                row["of_datasheet_bw"] = row["bandwidth_gb_s"] * 1e9 / datasheet
        results["decode"], results["prefill"] = decode, prefill
        tables.append(_table(f"decode (copy bandwidth {peak / 1e9:.0f} GB/s"
                             + (f", datasheet {datasheet / 1e9:.0f} GB/s)" if datasheet else ")"), decode,
                             ["model", "dtype", "batch", "context", "eager_ms", "graphs_ms", "tok_s",
                              "bandwidth_gb_s", "of_copy_bw", "of_datasheet_bw"]))
        tables.append(_table("prefill (one request)", prefill, ["model", "tokens", "ms", "tok_s"]))
    if "engine" in sections:
        results["engine"] = engine_run(args.device, args.quick, out)
        e = results["engine"]
        row = {"model": e["model"], "steps": e["steps"], "mean_step_ms": e["mean_step_ms"],
               "mean_forward_ms": e["mean_forward_ms"], "forward_share": e["forward_share"],
               **{f"{k}_share": v for k, v in e["stage_shares"].items()}}
        tables.append(_table("engine (step = schedule + execute + sample + update; forward timed on the device)",
                             [row], list(row)))
    results["elapsed_s"] = time.perf_counter() - begin
    text = "\n\n".join(tables) + f"\n\ncuda graphs: {results['cuda_graphs']}; {results['elapsed_s']:.0f} s\n"
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    (out / "table.txt").write_text(text, encoding="utf-8")
    print(text)
    failed = [r["scenario"] for r in results.get("parity", []) if not (r["identical"] and r["exercised"])]
    failed += [r["case"] for r in results.get("attention", []) if r.get("ok") is False]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
