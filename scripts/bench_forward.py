"""Forward throughput of the default model: decode at batch 1, 8, 32 and a 512-token prefill.

tokenloop's forms side by side in one run, since this machine is noisy: fp32, bf16 weights, and the
default `auto` (on a quantized GGUF and a CPU with AVX512-BF16: the packed int4 / Q8_0 weights for small
batches, bf16 for large ones), with HF transformers (same GGUF, fp32) as a baseline. Each form's time to
ready (load, pack, KV pool) and resident memory are measured in a fresh process.
Usage: python scripts/bench_forward.py [--forms fp32,bf16,auto] [--context 128] [--steps 8] [--no-hf]
  [--kv-cache-dtype bfloat16] [--clock thread --threads 1]
An A/B against another checkout: run this script with PYTHONPATH=<that tree> (`--kv-cache-dtype` needs a tree
that has the option); `--clock thread` times CPU seconds of this thread, which a shared machine disturbs less.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from tokenloop.model.attention import AttentionMetadata
from tokenloop.model.dtypes import CpuFeatures, build_model, resolve_dtype
from tokenloop.model.loader import load_checkpoint, resolve_model_path
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.quantized import PackThresholds

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def _best_of(fn, repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def tokenloop_decode(model: LlamaModel, batch: int, context: int, steps: int, repeats: int,
                     clock: Callable[[], float] = time.perf_counter) -> float:
    return batch * steps / _best_of(make_decode_run(model, batch, context, steps), repeats, clock)


def make_decode_run(model: LlamaModel, batch: int, context: int, steps: int) -> Callable[[], None]:
    """Cache `context` tokens for `batch` sequences (untimed); return a run of `steps` decode steps."""
    block_size = 16
    blocks_per_seq = (context + steps + block_size) // block_size
    kv = model.allocate_kv_cache(batch * blocks_per_seq + 1, block_size)
    table = torch.arange(batch * blocks_per_seq).view(batch, blocks_per_seq)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    # Fill the context with one ragged-free prefill per sequence (not timed).
    for row in range(batch):
        ids = torch.randint(vocab, (context,), generator=generator)
        pos = torch.arange(context)
        slots = table[row, pos // block_size] * block_size + pos % block_size
        meta = AttentionMetadata.build([0, context], [context], table[row:row + 1], slots, block_size)
        model.forward(ids, pos, meta, kv, torch.tensor([context - 1]))

    def run() -> None:
        for step in range(steps):
            length = context + step
            pos = torch.full((batch,), length)
            slots = table[:, length // block_size] * block_size + length % block_size
            meta = AttentionMetadata.build(list(range(batch + 1)), [length + 1] * batch, table, slots, block_size,
                                           model.decode_kernel)
            model.forward(torch.randint(vocab, (batch,), generator=generator), pos, meta, kv,
                          torch.arange(batch))

    return run


def tokenloop_prefill(model: LlamaModel, length: int, repeats: int,
                      clock: Callable[[], float] = time.perf_counter) -> float:
    block_size = 16
    kv = model.allocate_kv_cache(length // block_size + 1, block_size)
    table = torch.arange(length // block_size + 1).view(1, -1)
    ids = torch.randint(model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(length)
    meta = AttentionMetadata.build([0, length], [length], table, pos.clone(), block_size)
    return length / _best_of(lambda: model.forward(ids, pos, meta, kv, torch.tensor([length - 1])), repeats, clock)


def hf_decode(hf, batch: int, context: int, steps: int, repeats: int) -> float:
    from transformers import DynamicCache

    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab, (batch, context), generator=generator)

    def run() -> None:
        cache = DynamicCache()
        hf(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        for _ in range(steps):
            hf(torch.randint(vocab, (batch, 1), generator=generator), past_key_values=cache, use_cache=True)
        run.decode_time = time.perf_counter() - start  # type: ignore[attr-defined]

    best = float("inf")
    run()
    for _ in range(repeats):
        run()
        best = min(best, run.decode_time)  # type: ignore[attr-defined]
    return batch * steps / best


def hf_prefill(hf, length: int, repeats: int) -> float:
    ids = torch.randint(hf.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    return length / _best_of(lambda: hf(ids, use_cache=False, logits_to_keep=1), repeats)


FORMS = {  # name -> (activations, weights) as EngineConfig spells them
    "fp32": ("float32", "float32"),
    "bf16": ("float32", "bfloat16"),
    "auto": ("auto", None),
    "packed": ("float32", "quantized"),  # the packed kernels at every batch size (no dense copy)
    "auto-ops": ("auto", None),  # auto without the fused layer kernels: one PyTorch op per stage
}


def build_form(checkpoint, form: str, kv_cache_dtype: str = "auto") -> tuple[LlamaModel, str]:
    """The model as the engine would build it for `form` (from a Checkpoint), and the resolved choice in words."""
    dtype, weight_dtype = FORMS[form]
    kv = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}  # a tree before the option: auto
    choice = resolve_dtype(dtype, weight_dtype, "cpu", checkpoint.is_quantized, CpuFeatures.detect(), **kv)
    if form == "auto-ops":
        model = build_model(checkpoint.config, checkpoint.weights, choice, "cpu", 4096)
        model.fused_ops = None
        return model, choice.describe() + ", op by op (no fused layer kernels)"
    if form == "packed":
        model = LlamaModel.from_weights(checkpoint.config, checkpoint.weights, max_positions=4096,
                                        quantized=True, thresholds=PackThresholds.always_packed())
        return model, "activations and KV cache float32, weights packed int4 / Q8_0 at every batch size"
    return build_model(checkpoint.config, checkpoint.weights, choice, "cpu", 4096), choice.describe()


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def ready_probe(model_name: str, form: str, kv_bytes: int, kv_cache_dtype: str = "auto") -> None:
    """In a fresh process: load, build, allocate the KV pool as the engine does; print JSON."""
    start = time.perf_counter()
    checkpoint = load_checkpoint(model_name, keep_quantized=True)
    model, _ = build_form(checkpoint, form, kv_cache_dtype)
    kv = model.allocate_kv_cache(max(1, kv_bytes // model.kv_bytes_per_block(16)), 16)
    ready = time.perf_counter() - start
    kv_mb = sum(k.nbytes + v.nbytes for k, v in kv) / 2**20
    # The pool's pages are committed as blocks are first written: RSS is read with all of them written, as
    # in a server that has used its whole pool (the goal's "file + KV pool").
    for key, value in kv:
        key.fill_(0)
        value.fill_(0)
    # The engine keeps its checkpoint (the file stays mapped), so the probe does too.
    print(json.dumps({"ready_s": ready, "rss_mb": rss_mb(), "kv_mb": kv_mb,
                      "weights": len(checkpoint.weights)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per decode sequence")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--forms", default="fp32,bf16,auto",
                        help="tokenloop forms, side by side: fp32, bf16 (weights), auto (the default dtype), "
                             "packed (int4 / Q8_0 at every batch size), "
                             "auto-ops (auto without the fused layer kernels)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--no-ready", action="store_true", help="skip the time-to-ready / RSS probes")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="KV pool of the ready probes")
    parser.add_argument("--ready-probe", choices=list(FORMS), help=argparse.SUPPRESS)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="the KV cache of every form (default: as the engine resolves it)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall seconds, or this thread's CPU seconds (with --threads 1)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.ready_probe:
        ready_probe(args.model, args.ready_probe, args.kv_cache_memory, args.kv_cache_dtype)
        return
    torch.manual_seed(0)
    forms = args.forms.split(",")

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {CpuFeatures.detect()}")
    path = resolve_model_path(args.model)
    print(f"model file: {path.name}, {path.stat().st_size / 2**20:.1f} MiB")
    if not args.no_ready:  # each in a fresh process, so that RSS is the form's own
        for form in forms:
            probe = subprocess.run([sys.executable, __file__, "--model", args.model, "--ready-probe", form,
                                    "--kv-cache-memory", str(args.kv_cache_memory),
                                    "--kv-cache-dtype", args.kv_cache_dtype],
                                   capture_output=True, text=True, check=True)
            result = json.loads(probe.stdout.strip().splitlines()[-1])
            print(f"{form}: ready {result['ready_s']:.2f} s (load + pack + {result['kv_mb']:.0f} MiB KV "
                  f"pool), RSS {result['rss_mb']:.0f} MiB")
    checkpoint = load_checkpoint(args.model, keep_quantized=True)
    models = {}
    for form in forms:
        models[form], described = build_form(checkpoint, form, args.kv_cache_dtype)
        print(f"{form}: {described}")
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        hf.eval()

    header = "".join(f"{form + ' tok/s':>14}" for form in forms)
    print(f"{'case':<20}{header}{'HF tok/s':>12}  forms that ran")
    with torch.inference_mode():
        cases = [(f"decode batch {b}", int(b)) for b in args.batches.split(",")]
        cases.append((f"prefill {args.prefill}", 0))
        for name, batch in cases:
            speeds, ran = [], []
            for form in forms:  # interleaved per case: the machine's noise hits every form alike
                model = models[form]
                if batch:
                    speeds.append(tokenloop_decode(model, batch, args.context, args.steps, args.repeats, clock))
                else:
                    speeds.append(tokenloop_prefill(model, args.prefill, args.repeats, clock))
                ran.append(model.last_weight_form)
            if hf is None:
                theirs = float("nan")
            elif batch:
                theirs = hf_decode(hf, batch, args.context, args.steps, args.repeats)
            else:
                theirs = hf_prefill(hf, args.prefill, args.repeats)
            row = "".join(f"{speed:>14.1f}" for speed in speeds)
            print(f"{name:<20}{row}{theirs:>12.1f}  {' / '.join(ran)}", flush=True)


if __name__ == "__main__":
    main()
