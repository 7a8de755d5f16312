"""EngineMetrics: a registry per instance, counters advanced by the engine's cumulative numbers."""

from __future__ import annotations

from tests.serving.conftest import metric_value
from tokenloop.observe.metrics import EngineMetrics
from tokenloop.observe.records import StepGauges, StepRecord
from tokenloop.outputs import RequestMetrics


def _gauges(queries: int, hits: int, preemptions: int, running: int = 2) -> StepGauges:
    """One waiting (preempted) request, a quarter of 8 blocks referenced."""
    return StepGauges(num_running=running, num_waiting=1, num_preempted_waiting=1, num_blocks=8, block_size=4,
                      num_free_blocks=6, num_cached_free_blocks=0, prefix_cache_queries=queries,
                      prefix_cache_hits=hits, evictions=0, num_preemptions=preemptions)


def _step(num_batched_tokens: int, sampled: int, gauges: StepGauges | None = None) -> StepRecord:
    gauges = gauges or StepGauges(num_running=sampled, num_waiting=0, num_preempted_waiting=0, num_blocks=8,
                                  block_size=4, num_free_blocks=8, num_cached_free_blocks=0,
                                  prefix_cache_queries=0, prefix_cache_hits=0, evictions=0, num_preemptions=0)
    return StepRecord(1, 0, 1, 2, 3, 4, 0, 0, 0, num_batched_tokens, [], [], [f"r{i}" for i in range(sampled)],
                      list(range(sampled)), [], gauges)


def test_each_instance_has_its_own_registry() -> None:
    a, b = EngineMetrics("m"), EngineMetrics("m")  # would raise "Duplicated timeseries" on a shared registry
    a.on_step(_step(0, 0, _gauges(10, 4, 1)))
    assert metric_value(a.render().decode(), "tokenloop:prefix_cache_queries_total") == 10
    assert metric_value(b.render().decode(), "tokenloop:prefix_cache_queries_total") == 0


def test_stats_become_gauges_and_counter_increments() -> None:
    m = EngineMetrics("m")
    m.on_step(_step(0, 0, _gauges(10, 4, 1)))
    m.on_step(_step(0, 0, _gauges(25, 9, 3, running=0)))
    text = m.render().decode()
    assert metric_value(text, "tokenloop:prefix_cache_queries_total", model_name="m") == 25
    assert metric_value(text, "tokenloop:prefix_cache_hits_total") == 9
    assert metric_value(text, "tokenloop:num_preemptions_total") == 3
    assert metric_value(text, "tokenloop:num_requests_running") == 0
    assert metric_value(text, "tokenloop:num_requests_waiting") == 1
    assert metric_value(text, "tokenloop:num_requests_preempted") == 1
    assert metric_value(text, "tokenloop:kv_cache_usage_perc") == 0.25


def test_finished_request_latencies() -> None:
    m = EngineMetrics("m")
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.03, first_token_time=0.08,
                             last_token_time=0.58, finished_time=0.58, queue_wait_s=0.03, ttft_s=0.08,
                             itls_s=[0.005] * 100, tpot_s=0.005, e2e_s=0.58, prefill_s=0.05, decode_s=0.5,
                             num_prompt_tokens=10, num_generation_tokens=101, num_cached_tokens=0, num_preemptions=0)
    m.observe_finished("stop", metrics)
    m.observe_aborted()
    m.on_step(_step(num_batched_tokens=42, sampled=3))
    m.observe_first_output(10)
    text = m.render().decode()
    assert metric_value(text, "tokenloop:request_success_total", finished_reason="stop") == 1
    assert metric_value(text, "tokenloop:request_success_total", finished_reason="abort") == 1
    assert metric_value(text, "tokenloop:inter_token_latency_seconds_count") == 100
    assert abs(metric_value(text, "tokenloop:e2e_request_latency_seconds_sum") - 0.58) < 1e-9
    assert metric_value(text, "tokenloop:time_to_first_token_seconds_bucket", le="0.1") == 1
    assert metric_value(text, "tokenloop:request_queue_time_seconds_count") == 1
    assert metric_value(text, "tokenloop:iteration_tokens_sum") == 42
    assert metric_value(text, "tokenloop:generation_tokens_total") == 3
    assert metric_value(text, "tokenloop:prompt_tokens_total") == 10


def test_requests_are_counted_by_adapter() -> None:
    """Every request that ran with a LoRA adapter is counted under its name, however it ended (aborts
    included); the base model's requests are not."""
    m = EngineMetrics("m")
    m.observe_finished("stop", None, "a")
    m.observe_finished("length", None, "a")
    m.observe_finished("stop", None, "b")
    m.observe_finished("stop", None)
    m.observe_aborted("b")
    m.observe_aborted()
    text = m.render().decode()
    for adapter, reason, count in (("a", "stop", 1), ("a", "length", 1), ("b", "stop", 1), ("b", "abort", 1)):
        assert metric_value(text, "tokenloop:lora_requests_total", lora_adapter=adapter,
                            finished_reason=reason) == count
    assert metric_value(text, "tokenloop:request_success_total", finished_reason="stop") == 3
    assert metric_value(text, "tokenloop:request_success_total", finished_reason="abort") == 2
