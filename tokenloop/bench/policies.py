"""`bench policies`: the same trace under each scheduling policy, everything else fixed.

In-process, every policy gets a fresh `LLMEngine` over one loaded checkpoint with the same budgets,
KV blocks and seed, driven by the replay loop (`replay.py`). Against servers, a server runs one
policy, so each policy names its own server (`fcfs=http://127.0.0.1:8001`, ...); the client replays
the trace's arrival times and can see only client-side latencies (no queue wait, KV or preemptions).
An optional HF transformers static-batching baseline replays the same prompts in the same run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenloop.bench.replay import ReplayRecord, ReplayRun, StepCost, replay_engine, warm_up_engine
from tokenloop.bench.replay_hf import replay_hf_static
from tokenloop.bench.report import RunSummary, format_table, summarize_run, write_html
from tokenloop.bench.serve import ClientConfig, run_requests
from tokenloop.bench.trace import TraceRequest
from tokenloop.config import SCHEDULING_POLICIES, SchedulerConfig
from tokenloop.model.loader import DEFAULT_MODEL

BASELINES = ("hf",)


def parse_policies(text: str) -> tuple[str, ...]:
    """'fcfs,sjf' -> ('fcfs', 'sjf'); ValueError naming an unknown policy."""
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in names if p not in SCHEDULING_POLICIES]
    if unknown or not names:
        raise ValueError(f"unknown policy {unknown[0] if unknown else text!r} "
                         f"(valid: {', '.join(SCHEDULING_POLICIES)})")
    if len(set(names)) != len(names):
        raise ValueError(f"a policy is listed twice in {text!r}")
    return names


def parse_base_urls(values: Sequence[str], policies: Sequence[str]) -> dict[str, str]:
    """`["fcfs=http://a", "sjf=http://b"]`, or one bare URL for a single policy -> {policy: url}."""
    urls: dict[str, str] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if sep and name in SCHEDULING_POLICIES:
            urls[name] = url
        elif len(values) == 1 and len(policies) == 1:
            urls[policies[0]] = value
        else:
            raise ValueError("a server runs one policy: give --base-url POLICY=URL once per policy (one server "
                             f"started with each --policy), or one bare URL with a single policy; got {value!r}")
    missing = [p for p in policies if p not in urls]
    if missing:
        raise ValueError(f"no --base-url for policy {missing[0]!r}")
    return urls


def parse_step_cost(text: str) -> StepCost:
    """'10' or '10:0.05' -> StepCost(base_ms=10, per_token_ms=0.05)."""
    base, _, per_token = text.partition(":")
    try:
        cost = StepCost(float(base), float(per_token) if per_token else 0.0)
    except ValueError:
        raise ValueError(f"step cost {text!r} must be BASE_MS or BASE_MS:PER_TOKEN_MS") from None
    if cost.base_ms < 0 or cost.per_token_ms < 0 or cost.base_ms + cost.per_token_ms <= 0:
        raise ValueError(f"step cost {text!r} must be >= 0 and not all zero")
    return cost


@dataclass(frozen=True)
class PolicyBenchConfig:
    """One comparison: the trace, the policies, and everything held fixed across them."""

    policies: tuple[str, ...] = SCHEDULING_POLICIES
    model: str = DEFAULT_MODEL
    engine_options: dict[str, Any] = field(default_factory=dict)  # build_engine_config keywords, minus policy
    clock: str = "virtual"
    step_cost: StepCost | None = None
    time_scale: float = 1.0
    baseline: str | None = None
    hf_batch_size: int | None = None
    base_urls: dict[str, str] | None = None  # policy -> server; None: in-process
    endpoint: str = "/v1/completions"
    served_model: str | None = None
    max_concurrency: int | None = None
    slos_ms: dict[str, float] = field(default_factory=dict)
    progress: bool = True
    warmup: bool = True  # a throwaway engine runs a few requests first, so no policy pays the cold start

    def __post_init__(self) -> None:
        if self.baseline is not None and self.baseline not in BASELINES:
            raise ValueError(f"unknown baseline {self.baseline!r} (valid: {', '.join(BASELINES)})")
        if "policy" in self.engine_options:
            raise ValueError("the policy is what varies: leave it out of engine_options")

    @property
    def batch_size(self) -> int:
        """The HF baseline's batch: the engine's max_num_seqs unless set, so both hold as many requests."""
        return self.hf_batch_size or self.engine_options.get("max_num_seqs") or SchedulerConfig().max_num_seqs


@dataclass
class PolicyBenchResult:
    runs: list[ReplayRun]
    summaries: list[RunSummary]

    def table(self, with_goodput: bool = False) -> str:
        return format_table(self.summaries, with_goodput)


def run_in_process(trace: Sequence[TraceRequest], config: PolicyBenchConfig, checkpoint: Any | None = None,
                   ) -> list[ReplayRun]:
    """One engine replay per policy over one loaded checkpoint."""
    from tokenloop.engine import LLMEngine
    from tokenloop.llm import build_engine_config
    from tokenloop.model.loader import load_checkpoint

    checkpoint = checkpoint or load_checkpoint(config.model)
    if config.warmup:
        first = build_engine_config(config.model, policy=config.policies[0], **config.engine_options)
        warm_up_engine(LLMEngine(first, checkpoint=checkpoint), trace)
    runs = []
    for policy in config.policies:
        engine_config = build_engine_config(config.model, policy=policy, **config.engine_options)

        def make_engine(clock: Any, engine_config: Any = engine_config) -> LLMEngine:
            return LLMEngine(engine_config, checkpoint=checkpoint, clock=clock)

        runs.append(replay_engine(trace, make_engine, label=policy, clock_mode=config.clock,
                                  step_cost=config.step_cost, time_scale=config.time_scale,
                                  progress=config.progress))
    return runs


def run_against_servers(trace: Sequence[TraceRequest], config: PolicyBenchConfig) -> list[ReplayRun]:
    """Replay the trace's arrival times against one server per policy, client-side timing only."""
    assert config.base_urls is not None
    runs = []
    offsets = [r.arrival_s * config.time_scale for r in trace]
    for policy in config.policies:
        client = ClientConfig(base_url=config.base_urls[policy], endpoint=config.endpoint, model=config.served_model,
                              max_concurrency=config.max_concurrency)
        began = time.perf_counter()
        records, _ = asyncio.run(run_requests(trace, offsets, client, progress=config.progress, desc=policy))
        replay_records = []
        for request, record in zip(trace, records):
            replay = ReplayRecord(id=request.id, arrival_s=record.start_s, max_tokens=request.max_tokens,
                                  priority=request.priority, user=request.user, prefix_id=request.prefix_id,
                                  prompt_len=record.prompt_len, output_len=record.output_len,
                                  finish_reason="length" if record.success else "error", error=record.error)
            if record.success:
                replay.first_token_s = record.start_s + record.ttft_s
                replay.last_token_s = replay.finished_s = record.start_s + record.e2el_s
                replay.itls_s = list(record.itls_s)
            replay_records.append(replay)
        runs.append(ReplayRun(label=policy, kind="server", records=replay_records, wall_s=time.perf_counter() - began,
                              settings={"base_url": config.base_urls[policy]}))
    return runs


def run_hf_baseline(trace: Sequence[TraceRequest], config: PolicyBenchConfig, checkpoint: Any | None = None,
                    hf_model: Any | None = None) -> ReplayRun:
    """The same prompts through HF transformers static batching, tokenized by our tokenizer."""
    from tokenloop.bench.datasets import load_tokenizer
    from tokenloop.bench.replay_hf import load_hf_model

    tokenizer = checkpoint.tokenizer if checkpoint is not None else load_tokenizer(config.model)
    model = hf_model if hf_model is not None else load_hf_model(config.model)
    # The cost clock models our engine's steps; HF runs on measured time either way.
    clock = "virtual" if config.clock == "cost" else config.clock
    return replay_hf_static(trace, model, tokenizer, batch_size=config.batch_size, label="hf-static",
                            clock_mode=clock, time_scale=config.time_scale, progress=config.progress)


def run_policy_benchmark(trace: Sequence[TraceRequest], config: PolicyBenchConfig, *, checkpoint: Any | None = None,
                         hf_model: Any | None = None) -> PolicyBenchResult:
    """Every policy (and the baseline, if asked) over the same trace, then their summaries."""
    if config.base_urls is not None:
        runs = run_against_servers(trace, config)
    else:
        if checkpoint is None:
            from tokenloop.model.loader import load_checkpoint

            checkpoint = load_checkpoint(config.model)
        runs = run_in_process(trace, config, checkpoint)
    if config.baseline == "hf":
        runs.append(run_hf_baseline(trace, config, checkpoint, hf_model))
    return PolicyBenchResult(runs, [summarize_run(run, config.slos_ms or None) for run in runs])


def result_document(result: PolicyBenchResult, config: PolicyBenchConfig, trace_path: str | None) -> dict[str, Any]:
    """Everything measured, as JSON: settings, each run's summary, per-request lifecycles and timeline."""
    def run_json(run: ReplayRun, summary: RunSummary) -> dict[str, Any]:
        return {
            "label": run.label, "kind": run.kind, "settings": run.settings, "duration": run.duration_s,
            "num_preemptions": run.num_preemptions, "prefix_cache_hit_rate": run.prefix_cache_hit_rate,
            "num_steps": run.num_steps, "wall_s": run.wall_s, "admission_order": run.admission_order,
            "summary": asdict(summary),
            "requests": [asdict(r) for r in run.records],
            "timeline": [asdict(p) for p in run.timeline],
        }

    return {
        "trace": trace_path,
        "settings": bench_settings(config),
        "runs": [run_json(run, summary) for run, summary in zip(result.runs, result.summaries)],
    }


def bench_settings(config: PolicyBenchConfig) -> dict[str, Any]:
    """What was held fixed, for the report's header."""
    settings: dict[str, Any] = {"model": config.model, "mode": "server" if config.base_urls else "in-process",
                                "clock": config.clock, "time_scale": config.time_scale, **config.engine_options}
    if config.step_cost is not None and config.clock == "cost":
        settings["step_cost_ms"] = [config.step_cost.base_ms, config.step_cost.per_token_ms]
    if config.baseline:
        settings["baseline"] = f"{config.baseline} (static batches of {config.batch_size})"
    if config.slos_ms:
        settings["goodput_slos_ms"] = config.slos_ms
    return settings


def save_outputs(result: PolicyBenchResult, config: PolicyBenchConfig, *, trace_path: str | None,
                 report_path: str | None = None, result_path: str | None = None) -> None:
    """Write the HTML report and/or the JSON results where asked."""
    if report_path:
        write_html(report_path, result.runs, result.summaries, settings={"trace": trace_path, **bench_settings(config)},
                   with_goodput=bool(config.slos_ms))
    if result_path:
        Path(result_path).write_text(json.dumps(result_document(result, config, trace_path), indent=1, default=str),
                                     encoding="utf-8")
