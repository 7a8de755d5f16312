"""Prometheus collectors for the serving loop, named after vLLM's (`tokenloop:` instead of `vllm:`).

`EngineMetrics` owns one `CollectorRegistry` (never the process-wide default, so two apps in one
process do not collide). It is fed from two places:

- as an engine observer (`LLMEngine.add_observer(metrics)`), from the records alone: each `StepRecord`
  gives the queue gauges, KV usage, prefix-cache and preemption counters (the engine's cumulative
  counters turned into increments), tokens per step and generated tokens; arrivals and releases between
  steps keep the gauges current while the engine is idle.
- by the front end, when a user request produces its first token (`observe_first_output`) or ends
  (`observe_finished` with its `RequestMetrics`, `observe_aborted`): latencies are the front end's.

prometheus-client collectors are thread-safe, so the event loop may scrape while the engine writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tokenloop.observe.live import LiveState
from tokenloop.observe.records import ArrivalRecord, ReleaseInfo, StepGauges, StepRecord

if TYPE_CHECKING:  # annotations only: observers depend on records, not on the engine's rooms
    from tokenloop.outputs import RequestMetrics

PREFIX = "tokenloop:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket edges (seconds) chosen for a CPU engine: steps take tens to hundreds of milliseconds.
_TTFT_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class _Cumulative:
    """The engine's cumulative counters at the last step, to turn them into counter increments."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


class EngineMetrics:
    """The server's Prometheus collectors, in a registry of their own; an observer of engine records."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: Iterable[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_preempted = gauge("num_requests_preempted",
                                            "Preempted requests waiting to be scheduled again.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc",
                                         "Fraction of KV-cache blocks referenced by requests (1 = full).")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Preemptions (by recompute) since start.")
        self.prompt_tokens = counter("prompt_tokens",
                                     "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Requests that ended, by finish reason.",
                                       extra=["finished_reason"])
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.",
                                             _TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Gap between consecutive tokens.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to last token.",
                                             _REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                            _REQUEST_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "First scheduled to first token.", _REQUEST_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                             _REQUEST_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens", "Tokens computed per engine step.",
                                          _ITERATION_TOKEN_BUCKETS)
        self._last = _Cumulative()
        self._now = LiveState()  # the gauges between steps (an abort on an idle engine takes no step)
        # Labelled children resolved once: `.labels()` takes a lock and a dict lookup each call.
        m = model_name
        self._running = self.num_requests_running.labels(m)
        self._waiting = self.num_requests_waiting.labels(m)
        self._preempted = self.num_requests_preempted.labels(m)
        self._kv_usage = self.kv_cache_usage_perc.labels(m)
        self._queries, self._hits = self.prefix_cache_queries.labels(m), self.prefix_cache_hits.labels(m)
        self._preemptions = self.num_preemptions.labels(m)
        self._prompt_tokens = self.prompt_tokens.labels(m)
        self._generation_tokens = self.generation_tokens.labels(m)
        self._ttft, self._itl = self.time_to_first_token.labels(m), self.inter_token_latency.labels(m)
        self._e2e, self._queue = self.e2e_request_latency.labels(m), self.request_queue_time.labels(m)
        self._prefill, self._decode = self.request_prefill_time.labels(m), self.request_decode_time.labels(m)
        self._iteration_tokens = self.iteration_tokens.labels(m)

    # ---- the engine's records (on the thread that runs the loop or receives its records) ------------

    def on_arrival(self, record: ArrivalRecord) -> None:
        self._now.arrival(record)
        self._waiting.set(self._now.num_waiting())

    def on_step(self, record: StepRecord) -> None:
        """Gauges and counters from the step's gauges; tokens it computed and tokens it sampled."""
        self._now.step(record)
        self._observe_gauges(record.gauges)
        if record.num_batched_tokens > 0:
            self._iteration_tokens.observe(record.num_batched_tokens)
        if record.sampled_tokens:
            self._generation_tokens.inc(len(record.sampled_tokens))

    def on_release(self, records: list[ReleaseInfo]) -> None:
        """Requests that ended between steps: their queue slots and blocks are free now."""
        self._now.release(records)
        if self._now.gauges is not None:
            self._observe_gauges(self._now.gauges)
        else:
            self._waiting.set(self._now.num_waiting())

    def _observe_gauges(self, g: StepGauges) -> None:
        self._set(g.num_running, g.num_waiting, g.num_preempted_waiting, g.kv_usage,
                  _Cumulative(g.prefix_cache_queries, g.prefix_cache_hits, g.num_preemptions))

    def _set(self, running: int, waiting: int, preempted: int, kv_usage: float, now: _Cumulative) -> None:
        self._running.set(running)
        self._waiting.set(waiting)
        self._preempted.set(preempted)
        self._kv_usage.set(kv_usage)
        last = self._last
        # max(0, ...): a counter may only grow, even if the engine's own counters were ever reset.
        self._queries.inc(max(0, now.prefix_cache_queries - last.prefix_cache_queries))
        self._hits.inc(max(0, now.prefix_cache_hits - last.prefix_cache_hits))
        self._preemptions.inc(max(0, now.num_preemptions - last.num_preemptions))
        self._last = now

    # ---- fed by the front end ---------------------------------------------------------------------

    def observe_first_output(self, num_prompt_tokens: int) -> None:
        """A request produced its first token: its prompt has been computed."""
        self._prompt_tokens.inc(num_prompt_tokens)

    def observe_finished(self, finish_reason: str, metrics: RequestMetrics | None) -> None:
        """A request ended inside the engine (stop, length or error): record its latencies."""
        self.request_success.labels(self.model_name, finish_reason).inc()
        if metrics is None:
            return
        for histogram, value in ((self._ttft, metrics.ttft_s), (self._e2e, metrics.e2e_s),
                                 (self._queue, metrics.queue_wait_s), (self._prefill, metrics.prefill_s),
                                 (self._decode, metrics.decode_s)):
            if value is not None:
                histogram.observe(value)
        for gap in metrics.itls_s:
            self._itl.observe(gap)

    def observe_aborted(self) -> None:
        """A request was cancelled (client gone, or server shutting down)."""
        self.request_success.labels(self.model_name, "abort").inc()

    # ---- read by the API --------------------------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition format of every collector in this registry."""
        return generate_latest(self.registry)
