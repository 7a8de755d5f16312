"""No starvation behind long prefills (issue 28, section 3), counted in steps with the real scheduler.

Four ~7.6k-token prompts are chunked through the default budget and KV pool of `tokenloop serve`; a
1-token request arriving at any point while they prefill must be scheduled, its whole prompt, in the very
next step, under every policy, and the long prompts must still fill whole steps.
"""

from __future__ import annotations

import math
import random

import pytest

from tokenloop.config import SCHEDULING_POLICIES, SchedulerConfig
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.scheduler import Scheduler
from tokenloop.core.scheduler_output import SchedulerOutput
from tokenloop.request import Request, RequestStatus, SamplingParams

LONG_LEN = 7600
NUM_LONG = 4
NEWCOMER_LEN = 40  # a short chat prompt after the template
# The default server's pool for the default model (1 GiB of bf16 KV, blocks of 16) and its context.
NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN = 2912, 16, 8192
STEP_NS = 50_000_000


class Engine:
    """The real Scheduler and KVCacheManager, with the engine's part done by hand: no model."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.now = 0
        self.sched = Scheduler(config, KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, True), MAX_MODEL_LEN,
                               lambda: self.now)
        self.rng = random.Random(0)
        self.steps: list[SchedulerOutput] = []
        self.requests: list[Request] = []

    def add(self, request_id: str, length: int) -> Request:
        prompt = [self.rng.randrange(10, 49_000) for _ in range(length)]
        request = Request(request_id, prompt, SamplingParams(max_tokens=1), self.now)
        self.sched.add_request(request)
        self.requests.append(request)
        return request

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.sched.update_from_output(out)
        for item in out.scheduled:
            if item.samples:  # max_tokens 1: the first sample finishes it
                item.request.append_output_token(7)
                self.sched.finish_request(item.request_id, RequestStatus.FINISHED_LENGTH)
        self.steps.append(out)
        self.now += STEP_NS
        return out


def long_prompts_then_newcomer(config: SchedulerConfig, arrives_after: int) -> tuple[Engine, int]:
    """Steps from the newcomer's arrival to the step that schedules its prompt (1: the next one)."""
    engine = Engine(config)
    for i in range(NUM_LONG):
        engine.add(f"long-{i}", LONG_LEN)
    for _ in range(arrives_after):
        engine.step()
    assert engine.sched.num_running >= 1 and engine.sched.has_unfinished_requests()
    newcomer = engine.add("newcomer", NEWCOMER_LEN)
    for waited in range(1, 500):  # noqa: B007 - returned: the step the newcomer was first scheduled in
        out = engine.step()
        row = next((item for item in out.scheduled if item.request is newcomer), None)
        if row is not None:
            assert row.num_tokens == NEWCOMER_LEN and row.samples  # its whole prompt, and its answer
            break
    else:
        raise AssertionError("the newcomer was never scheduled")
    while engine.sched.has_unfinished_requests():
        engine.step()
    return engine, waited


@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
@pytest.mark.parametrize("arrives_after", [1, 7, 14, 40])  # during the first, a middle, the last long prompt
def test_a_newcomer_is_scheduled_in_the_next_step_while_long_prompts_prefill(policy: str,
                                                                            arrives_after: int) -> None:
    config = SchedulerConfig(policy=policy)  # the defaults: 512 tokens a step, half of them for a long prefill
    engine, waited = long_prompts_then_newcomer(config, arrives_after)
    assert waited == 1
    # The long prompts lose nothing: every step but each one's last is a full budget.
    total = NUM_LONG * LONG_LEN + NEWCOMER_LEN
    assert len(engine.steps) <= math.ceil(total / config.max_num_batched_tokens) + NUM_LONG
    assert all(request.is_finished and request.num_output_tokens == 1 for request in engine.requests)
    assert engine.sched.kv_cache.num_free_blocks == NUM_BLOCKS  # nothing left behind


def test_without_long_prefill_limits_the_newcomer_waits_for_every_long_prompt() -> None:
    """The starvation the defaults prevent: threshold 0 lets the first long prompt take whole steps."""
    _, waited = long_prompts_then_newcomer(SchedulerConfig(long_prefill_token_threshold=0), arrives_after=1)
    assert waited > (NUM_LONG * LONG_LEN) // 512 - 2
