"""KV blocks one long request holds with sliding groups that release what their window has passed (issue 29,
item 3), against full attention on every layer.

A tiny random model of Gemma 3 270M's layer shape (18 layers, one global layer in six, a window of 512 keys;
narrow hidden size and heads, which do not change how many blocks are held) serves one request of
`--tokens` prompt tokens (chunked prefill) plus a few decoded ones through the real engine core. After every
step it counts the blocks the request references in each KV group; a block of a group holds
`layers per group` x `block size` layer-token slots of K/V. Full attention on every layer would hold
18 x tokens of them. Two peaks: while decoding (the window plus the block being filled), and over the
prefill, where a sliding group also holds the whole chunk a step computes (`--chunk`).

    python scripts/bench_kv_groups.py [--tokens 8192] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer_dir
from tokenloop.config import build_engine_config
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.messages import CoreRequest
from tokenloop.model.loader import load_checkpoint
from tokenloop.request import SamplingParams

NUM_LAYERS, PATTERN, WINDOW = 18, 6, 512  # Gemma 3 270M


def write_model(path: Path, max_positions: int) -> None:
    """A random Gemma 3 text model of 270M's layer pattern, saved by HF transformers with a tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    build_tiny_tokenizer_dir(path)
    layer_types = ["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(NUM_LAYERS)]
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=max_positions, sliding_window=WINDOW, layer_types=layer_types,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="prompt tokens of the one request")
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (the prefill chunk)")
    parser.add_argument("--decode", type=int, default=16, help="tokens generated after the prompt")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    total = args.tokens + args.decode
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gemma3-270m-shape"
        write_model(path, max_positions=total + 64)
        config = build_engine_config(str(path), dtype="float32", block_size=args.block_size,
                                     max_num_batched_tokens=args.chunk, max_model_len=total + 64)
        core = EngineCore(config, checkpoint=load_checkpoint(str(path)))
    kv = core.kv_cache
    layers_per_group = len(kv.groups[0].layers)
    prompt = torch.randint(TINY_VOCAB_SIZE, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    core.add_requests([CoreRequest("long", prompt, SamplingParams(temperature=0.0, max_tokens=args.decode,
                                                                  ignore_eos=True), 0)])
    peaks = {"prefill": [0, 0], "decode": [0, 0]}  # phase -> [blocks over all groups, most in one sliding group]
    steps = generated = 0
    begin = time.perf_counter()
    while core.has_unfinished_requests():
        decoding = generated > 0  # the step after the one that finished the prompt (and sampled a token)
        generated += sum(len(out.new_token_ids) for out in core.step().outputs)
        steps += 1
        if not kv.holds_blocks("long"):
            continue
        held = [sum(1 for block in kv.get_block_ids("long", g) if block >= 0) for g in range(kv.num_groups)]
        peak = peaks["decode" if decoding else "prefill"]
        peak[0] = max(peak[0], sum(held))
        peak[1] = max(peak[1], max(n for n, g in zip(held, kv.groups) if g.kind == "sliding"))
    seconds = time.perf_counter() - begin
    full_slots = NUM_LAYERS * kv.num_blocks_for(total) * args.block_size
    report = {"groups": [f"{g.kind}{g.window or ''}:{list(g.layers)}" for g in kv.groups],
              "tokens": total, "block_size": args.block_size, "chunk": args.chunk, "steps": steps,
              "layer_token_slots_full_attention": full_slots, "seconds": round(seconds, 1)}
    for phase, (blocks, sliding) in peaks.items():
        slots = blocks * layers_per_group * args.block_size
        report[phase] = {"peak_blocks_held": blocks, "peak_blocks_per_sliding_group": sliding,
                         "layer_token_slots_held": slots, "ratio": round(slots / full_slots, 4)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
