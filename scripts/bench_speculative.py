"""n-gram speculative decoding vs plain decoding on the default model, side by side and interleaved in one run.

Two workloads of chat prompts: `edit` (repeat / correct / summarise a given paragraph: the answer repeats
text from the prompt, where prompt lookup finds drafts) and `chat` (open questions: little to look up).
Each runs at batch 1 (one request at a time) and batch 8 (eight at once), plain and speculative in
alternating order, `--repeats` times. Greedy; the outputs of both engines are compared (at dtype auto the
two forward paths round differently, so a rare near-tie may flip: the script counts mismatching requests).

Reports per cell: output tok/s (output tokens / wall time), mean per-request latency (arrival to finish),
the acceptance rate (accepted / proposed drafts) and the mean tokens per speculative-step row.

Usage: python scripts/bench_speculative.py [--repeats 2] [--max-tokens 96] [--k 4] [--dtype auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tokenloop import LLM, SamplingParams
from tokenloop.config import SpeculativeConfig
from tokenloop.model.loader import load_checkpoint
from tokenloop.observe.records import EngineObserver, StepRecord

PARAGRAPHS = [
    "The committee met on Tuesday to review the budget. It agreed to fund the new library, delay the road "
    "repairs until spring, and hire two more teachers for the primary school.",
    "Our train leaves the central station at nine in the morning and reaches the coast shortly after noon. "
    "Bring a warm coat, because the wind by the sea is strong even in summer.",
    "To reset the router, hold the small button on the back for ten seconds until the light turns orange, "
    "then wait two minutes before connecting your laptop again.",
    "The museum will be closed on Monday for cleaning. On Tuesday it opens at ten, and the new exhibition "
    "about ancient maps starts on the first floor.",
]
EDIT_ASKS = ["Repeat this text exactly: {}", "Correct any mistakes in this text and return it in full: {}",
             "Rewrite this text with every sentence on its own line: {}", "Summarise this text: {}"]
CHAT_ASKS = ["Write a short poem about the sea.", "Give me three tips for learning to cook.",
             "Why is the sky blue?", "Describe a cat to someone who has never seen one.",
             "What should I pack for a weekend hike?", "Explain what a computer does, simply.",
             "Tell me a fun fact about octopuses.", "How do plants grow?"]


def workloads(tokenizer) -> dict[str, list[str]]:  # the model's Tokenizer
    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}])

    edit = [chat(ask.format(p)) for ask in EDIT_ASKS for p in PARAGRAPHS][:8]
    return {"edit": edit, "chat": [chat(ask) for ask in CHAT_ASKS]}


class Drafts(EngineObserver):
    def __init__(self) -> None:
        self.proposed = self.accepted = self.rows = 0

    def on_step(self, record: StepRecord) -> None:
        self.proposed += record.num_draft_tokens
        self.accepted += record.num_accepted_tokens
        self.rows += sum(1 for c in record.scheduled if c.samples and c.num_tokens > 1 and
                         c.start >= c.num_prompt_tokens - 1)


def run(llm: LLM, prompts: list[str], batch: int, params: SamplingParams) -> tuple[list[list[int]], float, list[float]]:
    begin = time.perf_counter()
    outputs = []
    for start in range(0, len(prompts), batch):
        outputs += llm.generate(prompts[start:start + batch], params, use_tqdm=False)
    wall = time.perf_counter() - begin
    return [o.outputs[0].token_ids for o in outputs], wall, [o.metrics.e2e_s for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--disable-by-batch-size", type=int, help="no drafts while this many requests run")
    args = parser.parse_args()
    checkpoint = load_checkpoint("smollm2-135m-instruct", keep_quantized=True)
    options = dict(checkpoint=checkpoint, dtype=args.dtype, max_num_seqs=8, max_num_batched_tokens=512)
    engines = {"plain": LLM(**options),
               "spec": LLM(**options, speculative=SpeculativeConfig(
                   num_speculative_tokens=args.k, disable_by_batch_size=args.disable_by_batch_size))}
    drafts = Drafts()
    engines["spec"].engine.add_observer(drafts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prompts_by_name = workloads(engines["plain"].get_tokenizer())
    for llm in engines.values():  # warm-up: first-call costs out of the timings
        llm.generate(prompts_by_name["chat"][:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    print(f"dtype={args.dtype} k={args.k} max_tokens={args.max_tokens} repeats={args.repeats} "
          f"disable_by_batch_size={args.disable_by_batch_size}")
    print(f"{'workload':8} {'batch':>5} {'mode':5} {'out tok/s':>10} {'latency s':>10} {'accept':>7} "
          f"{'tok/row':>7} {'mismatch':>8}")
    for name, prompts in prompts_by_name.items():
        for batch in (int(b) for b in args.batches.split(",")):
            rates: dict[str, list[float]] = {"plain": [], "spec": []}
            latency: dict[str, list[float]] = {"plain": [], "spec": []}
            tokens: dict[str, list[list[int]]] = {}
            before = (drafts.proposed, drafts.accepted, drafts.rows)
            for repeat in range(args.repeats):
                order = ("plain", "spec") if repeat % 2 == 0 else ("spec", "plain")  # interleaved
                for mode in order:
                    out, wall, e2e = run(engines[mode], prompts, batch, params)
                    tokens[mode] = out
                    rates[mode].append(sum(len(t) for t in out) / wall)
                    latency[mode].append(statistics.mean(e2e))
            proposed, accepted, rows = (now - then for now, then in zip(
                (drafts.proposed, drafts.accepted, drafts.rows), before))
            mismatch = sum(a != b for a, b in zip(tokens["plain"], tokens["spec"]))
            for mode in ("plain", "spec"):
                accept = f"{accepted / proposed:.2f}" if mode == "spec" and proposed else ""
                per_row = f"{(accepted + rows) / rows:.2f}" if mode == "spec" and rows else ""
                print(f"{name:8} {batch:5d} {mode:5} {statistics.median(rates[mode]):10.1f} "
                      f"{statistics.median(latency[mode]):10.2f} {accept:>7} {per_row:>7} "
                      f"{mismatch if mode == 'spec' else '':>8}", flush=True)


if __name__ == "__main__":
    main()
