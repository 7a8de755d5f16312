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
from tokenloop.observe.records import ArrivalRecord, HandoffRecord, ReleaseInfo, StepGauges, StepRecord
from tokenloop.request import FinishReason

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


class _ReplicaSeries:
    """One engine replica's labelled children and the cumulative counters it reported last."""

    def __init__(self, m: EngineMetrics, replica: str) -> None:
        model = m.model_name
        labels = (model, replica)
        self.running = m.num_requests_running.labels(*labels)
        self.waiting = m.num_requests_waiting.labels(*labels)
        self.preempted = m.num_requests_preempted.labels(*labels)
        self.kv_usage = m.kv_cache_usage_perc.labels(*labels)
        self.queries, self.hits = m.prefix_cache_queries.labels(*labels), m.prefix_cache_hits.labels(*labels)
        self.preemptions = m.num_preemptions.labels(*labels)
        self.generation_tokens = m.generation_tokens.labels(*labels)
        self.draft_tokens = m.spec_decode_num_draft_tokens.labels(*labels)
        self.accepted_tokens = m.spec_decode_num_accepted_tokens.labels(*labels)
        self.iteration_tokens = m.iteration_tokens.labels(*labels)
        self.last = _Cumulative()
        self.now = LiveState()  # the gauges between steps (an abort on an idle engine takes no step)


class EngineMetrics:
    """The server's Prometheus collectors, in a registry of their own; an observer of engine records.

    Every series fed by engine records carries a `replica` label (0 for a single engine core), so a
    server with several replicas shows each one; the request latencies are the front door's.
    """

    # long: the collectors' declarations, one per series, read as one table.
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        engine_labels = ["model_name", "replica"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, engine_labels, registry=r)

        def counter(name: str, doc: str, extra: Iterable[str] = (), per_replica: bool = True) -> Counter:
            return Counter(PREFIX + name, doc, [*(engine_labels if per_replica else labels), *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], per_replica: bool = False) -> Histogram:
            return Histogram(PREFIX + name, doc, engine_labels if per_replica else labels, buckets=buckets,
                             registry=r)

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
                                     "Prompt tokens of requests that produced a first token.", per_replica=False)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                                    "Speculative draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Speculative draft tokens the model agreed with.")
        self.request_success = counter("request_success", "Requests that ended, by finish reason.",
                                       extra=["finished_reason"], per_replica=False)
        self.lora_requests = counter("lora_requests", "Requests run with a LoRA adapter that ended, by "
                                     "adapter and finish reason.", extra=["lora_adapter", "finished_reason"],
                                     per_replica=False)
        self.handoffs = counter("handoffs", "Request handoffs between replicas, by outcome.",
                                extra=["outcome"], per_replica=False)
        self.handoff_kv_bytes = counter("handoff_kv_bytes", "KV-cache bytes moved by handoffs.",
                                        per_replica=False)
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
                                          _ITERATION_TOKEN_BUCKETS, per_replica=True)
        self._replicas: dict[int, _ReplicaSeries] = {}
        # Labelled children resolved once: `.labels()` takes a lock and a dict lookup each call.
        m = model_name
        self._prompt_tokens = self.prompt_tokens.labels(m)
        self._ttft, self._itl = self.time_to_first_token.labels(m), self.inter_token_latency.labels(m)
        self._e2e, self._queue = self.e2e_request_latency.labels(m), self.request_queue_time.labels(m)
        self._prefill, self._decode = self.request_prefill_time.labels(m), self.request_decode_time.labels(m)
        self._handoff_bytes = self.handoff_kv_bytes.labels(m)
        self._series(0)  # a single engine's series exist (at zero) before its first record

    def _series(self, replica: int) -> _ReplicaSeries:
        series = self._replicas.get(replica)
        if series is None:
            series = self._replicas[replica] = _ReplicaSeries(self, str(replica))
        return series

    # ---- the engine's records (on the thread that runs the loop or receives its records) ------------

    def on_arrival(self, record: ArrivalRecord) -> None:
        series = self._series(record.replica)
        series.now.arrival(record)
        series.waiting.set(series.now.num_waiting())

    def on_step(self, record: StepRecord) -> None:
        """Gauges and counters from the step's gauges; tokens it computed and tokens it sampled."""
        series = self._series(record.replica)
        series.now.step(record)
        self._observe_gauges(series, record.gauges)
        if record.num_batched_tokens > 0:
            series.iteration_tokens.observe(record.num_batched_tokens)
        if record.sampled_tokens:
            series.generation_tokens.inc(len(record.sampled_tokens))
        if record.num_draft_tokens:
            series.draft_tokens.inc(record.num_draft_tokens)
            series.accepted_tokens.inc(record.num_accepted_tokens)

    def on_release(self, records: list[ReleaseInfo]) -> None:
        """Requests that ended between steps: their queue slots and blocks are free now."""
        by_replica: dict[int, list[ReleaseInfo]] = {}
        for record in records:
            by_replica.setdefault(record.replica, []).append(record)
        for replica, group in by_replica.items():
            series = self._series(replica)
            series.now.release(group)
            if series.now.gauges is not None:
                self._observe_gauges(series, series.now.gauges)
            else:
                series.waiting.set(series.now.num_waiting())

    def on_handoff(self, record: HandoffRecord) -> None:
        """A handoff between replicas: its outcome counted, the KV bytes it moved added."""
        if record.event in ("completed", "refused", "cancelled", "failed"):
            self.handoffs.labels(self.model_name, record.event).inc()
        if record.bytes_moved:
            self._handoff_bytes.inc(record.bytes_moved)

    @staticmethod
    def _observe_gauges(series: _ReplicaSeries, g: StepGauges) -> None:
        series.running.set(g.num_running)
        series.waiting.set(g.num_waiting)
        series.preempted.set(g.num_preempted_waiting)
        series.kv_usage.set(g.kv_usage)
        last = series.last
        # max(0, ...): a counter may only grow, even if the engine's own counters were ever reset.
        series.queries.inc(max(0, g.prefix_cache_queries - last.prefix_cache_queries))
        series.hits.inc(max(0, g.prefix_cache_hits - last.prefix_cache_hits))
        series.preemptions.inc(max(0, g.num_preemptions - last.num_preemptions))
        series.last = _Cumulative(g.prefix_cache_queries, g.prefix_cache_hits, g.num_preemptions)

    # ---- fed by the front end ---------------------------------------------------------------------

    def observe_first_output(self, num_prompt_tokens: int) -> None:
        """A request produced its first token: its prompt has been computed."""
        self._prompt_tokens.inc(num_prompt_tokens)

    def observe_finished(self, finish_reason: str, metrics: RequestMetrics | None,
                         lora_name: str | None = None) -> None:
        """A request ended inside the engine (stop, length or error): record its latencies (and
        adapter)."""
        self.request_success.labels(self.model_name, finish_reason).inc()
        if lora_name is not None:
            self.lora_requests.labels(self.model_name, lora_name, finish_reason).inc()
        if metrics is None:
            return
        for histogram, value in ((self._ttft, metrics.ttft_s), (self._e2e, metrics.e2e_s),
                                 (self._queue, metrics.queue_wait_s), (self._prefill, metrics.prefill_s),
                                 (self._decode, metrics.decode_s)):
            if value is not None:
                histogram.observe(value)
        for gap in metrics.itls_s:
            self._itl.observe(gap)

    def observe_aborted(self, lora_name: str | None = None) -> None:
        """A request was cancelled (client gone, or server shutting down); `lora_name`: its adapter."""
        self.request_success.labels(self.model_name, FinishReason.ABORT).inc()
        if lora_name is not None:
            self.lora_requests.labels(self.model_name, lora_name, FinishReason.ABORT).inc()

    # ---- read by the API --------------------------------------------------------------------------

    def render(self) -> bytes:
        """The text exposition format of every collector in this registry."""
        return generate_latest(self.registry)
