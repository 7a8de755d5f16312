"""Request lifecycle timestamps and the latencies derived from them."""

from __future__ import annotations

import pytest

from tokenloop.errors import InvalidRequestError
from tokenloop.request import Request, RequestStatus, RequestTimes, SamplingParams

MS = 1_000_000


def test_seed_002_worked_example_is_exact() -> None:
    """Arrival 0 ms, admitted 30 ms, first token 80 ms, then 100 gaps of 5 ms (seed 002)."""
    times = RequestTimes(arrival=0)
    times.first_scheduled = 30 * MS
    times.record_token(80 * MS)
    for i in range(1, 101):
        times.record_token(80 * MS + i * 5 * MS)
    assert times.queue_wait_ns == 30 * MS
    assert times.ttft_ns == 80 * MS
    assert times.last_token == 580 * MS
    assert times.itls_ns == [5 * MS] * 100
    assert times.e2e_ns == 580 * MS
    assert times.e2e_ns == times.ttft_ns + sum(times.itls_ns)
    assert times.tpot_ns == 5 * MS
    assert times.prefill_ns == 50 * MS
    assert times.decode_ns == 500 * MS


def test_times_before_events_are_none() -> None:
    times = RequestTimes(arrival=10)
    assert times.queue_wait_ns is None and times.ttft_ns is None and times.e2e_ns is None
    assert times.itls_ns == [] and times.tpot_ns is None
    times.finished = 25
    assert times.e2e_ns == 15  # an aborted request that produced nothing ends at its finish time


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 0}, "n"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"min_p": 2.0}, "min_p"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"), ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
])
def test_sampling_params_reject_bad_values(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_request_status_and_empty_prompt() -> None:
    request = Request("a", [1, 2, 3], SamplingParams(), arrival_ns=0)
    assert request.status is RequestStatus.WAITING and not request.is_finished
    request.append_output_token(7)
    assert request.all_token_ids == [1, 2, 3, 7] and request.num_output_tokens == 1
    request.status = RequestStatus.FINISHED_LENGTH
    assert request.finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        Request("b", [], SamplingParams(), arrival_ns=0)
