"""LoRA serving cost on the default model, side by side in one run (issue 32, performance).

    PYTHONPATH=. python scripts/bench_lora.py [--streams 8] [--tokens 64] [--rounds 2] [--many 32] [--max-loras 8]
        [--lora-dtype auto|int8]

1. Load time of one rank-16 adapter (PEFT directory, all seven projections): median of 5 loads (reading and
   checking it), and of copying it into a slot (over the previous adapter there).
2. `--streams` greedy streams, each with its own rank-16 adapter, against the same streams on the base model,
   alternated base / adapters for `--rounds` rounds on one engine: output tok/s (prefill included).
3. `--many` streams over `--many` adapters with `--max-loras` slots (0: skipped): throughput against as many
   base streams and against `--many` streams over `--max-loras` adapters (no swap), and the swaps' cost: slot
   loads, evictions, the time spent copying adapters into slots (per load, and its share of the run).
The adapters are random (PEFT's layout and names, written here), so their outputs are noise; only time counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokenloop import LLM, LoRARequest, SamplingParams
from tokenloop.model.loader import DEFAULT_MODEL, load_checkpoint
from tokenloop.model.lora import _MODULE_PREFIX, load_adapter, projection_shapes
from tokenloop.model.lora_slots import AdapterSlots

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def write_adapter(directory: Path, config, rank: int, seed: int, scale: float = 0.01) -> Path:
    """A PEFT LoRA directory of random rank-`rank` matrices (entries of std `scale`) on all seven projections
    of every layer."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (out_features, in_features) in projection_shapes(config).items():
            key = f"base_model.model.model.layers.{layer}.{_MODULE_PREFIX[module]}.{module}"
            tensors[key + ".lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * scale
            tensors[key + ".lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * scale
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(_MODULE_PREFIX)}))
    return directory


def throughput(llm: LLM, adapters: list[str | None], tokens: int) -> tuple[float, float, float]:
    """(output tok/s, seconds, output tokens per CPU second of this process) of one greedy stream per entry of
    `adapters` (None: the base model). The CPU rate is what a busy machine's descheduling disturbs least (at one
    thread: with two, a thread waiting for a descheduled one spins on its CPU)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    requests = [LoRARequest(name) if name else None for name in adapters]
    begin, begin_cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate([PROMPT] * len(adapters), params, lora_request=requests, use_tqdm=False)
    seconds, cpu = time.perf_counter() - begin, time.process_time() - begin_cpu
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return generated / seconds, seconds, generated / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="of the --streams run (0: skipped)")
    parser.add_argument("--many", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=8, help="slots in the --many run")
    parser.add_argument("--lora-dtype", default="auto", choices=["auto", "int8", "dense"], help="the adapters' slots")
    args = parser.parse_args()
    options = {} if args.lora_dtype == "auto" else {"lora_dtype": args.lora_dtype}  # trees before the option
    config = load_checkpoint(DEFAULT_MODEL).config
    with tempfile.TemporaryDirectory() as tmp:
        count = max(args.streams, args.many)
        dirs = {f"ad{i}": write_adapter(Path(tmp) / f"ad{i}", config, args.rank, i) for i in range(count)}
        loads, copies, registers = [], [], []
        slots = AdapterSlots(config, 1, args.rank, torch.bfloat16 if args.lora_dtype == "dense" else torch.int8)
        for index in range(5):
            adapter = load_adapter(f"x{index}", dirs["ad0"], config, args.rank, torch.bfloat16)
            loads.append(adapter.load_s * 1e3)
            begin = time.perf_counter()
            slots.register(adapter)  # int8 slots quantize the adapter here, once
            registers.append((time.perf_counter() - begin) * 1e3)
            begin = time.perf_counter()
            slots.slots_for([adapter.name])  # into the one slot, over the previous adapter
            copies.append((time.perf_counter() - begin) * 1e3)
        print(f"load one rank-{args.rank} adapter: median {statistics.median(loads):.1f} ms "
              f"(runs: {', '.join(f'{v:.1f}' for v in loads)}); into a slot: median "
              f"{statistics.median(copies):.1f} ms (runs: {', '.join(f'{v:.1f}' for v in copies)}); registering "
              f"it with the slots ({slots.dtype}): median {statistics.median(registers):.1f} ms")

        if args.rounds:
            streams_against_base(dirs, args.streams, args.rank, args.tokens, args.rounds, options)
        if args.many:
            swaps(dirs, args.many, args.max_loras, args.rank, args.tokens, options)


def streams_against_base(dirs: dict[str, Path], streams: int, rank: int, tokens: int, rounds: int,
                         options: dict[str, str]) -> None:
    """`streams` streams, each with its own adapter, against as many base streams, alternated on one engine."""
    names = [f"ad{i}" for i in range(streams)]
    llm = LLM(DEFAULT_MODEL, lora_modules={n: str(dirs[n]) for n in names}, max_loras=streams, max_lora_rank=rank,
              **options)
    throughput(llm, [None, names[0]], 4)  # warm both paths
    print(f"{streams} streams x {tokens} tokens, output tok/s (prefill included):")
    ratios, cpu_ratios = [], []
    for round_index in range(rounds):
        base, _, base_cpu = throughput(llm, [None] * streams, tokens)
        lora, _, lora_cpu = throughput(llm, names, tokens)
        ratios.append(lora / base)
        cpu_ratios.append(lora_cpu / base_cpu)
        print(f"  round {round_index + 1}: base {base:.1f}, {streams} adapters {lora:.1f} ({lora / base:.2f}x); "
              f"per CPU second {base_cpu:.1f} and {lora_cpu:.1f} ({lora_cpu / base_cpu:.2f}x)")
    print(f"  median ratio {statistics.median(ratios):.2f}x (per CPU second {statistics.median(cpu_ratios):.2f}x)")


def swaps(dirs: dict[str, Path], many: int, max_loras: int, rank: int, tokens: int, options: dict[str, str]) -> None:
    """`many` streams over `many` adapters with `max_loras` slots, against `many` base streams and `many`
    streams over `max_loras` adapters (resident, no swap): tok/s, and what the swaps cost."""
    names = [f"ad{i}" for i in range(many)]
    llm = LLM(DEFAULT_MODEL, lora_modules={n: str(dirs[n]) for n in names}, max_loras=max_loras,
              max_lora_rank=rank, max_num_seqs=many, **options)
    throughput(llm, [None, names[0]], 4)
    slots = llm.engine.core.adapters.slots
    base = throughput(llm, [None] * many, tokens)[0]
    resident = throughput(llm, [names[i % max_loras] for i in range(many)], tokens)[0]
    loads, evictions, spent = slots.num_loads, slots.num_evictions, getattr(slots, "load_seconds", 0.0)
    lora, seconds, _ = throughput(llm, names, tokens)
    loads, evictions = slots.num_loads - loads, slots.num_evictions - evictions
    spent = getattr(slots, "load_seconds", 0.0) - spent  # absent on trees before the swap timing
    print(f"{many} streams over {many} adapters, --max-loras {max_loras}: {lora:.1f} tok/s in {seconds:.2f} s; "
          f"base {base:.1f} tok/s ({lora / base:.2f}x); {many} streams over {max_loras} resident adapters "
          f"{resident:.1f} tok/s ({lora / resident:.2f}x); slot loads {loads}, evictions {evictions}, copying "
          f"into slots {spent * 1e3:.1f} ms ({spent * 1e3 / max(loads, 1):.2f} ms a load, "
          f"{spent / seconds:.1%} of the run)")

if __name__ == "__main__":
    main()
