"""Fault injection: a stage that raises for one request of a running batch fails that request alone.

For each stage of the loop (schedule, KV lookup, KV allocate, forward, sample, update, detokenize) one
request of a batch is made to fail; it ends with finish_reason "error", every other request's greedy
output equals the fault-free run's, and no block stays referenced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import TINY_PROMPTS
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.outputs import RequestOutput
from tokenloop.request import Request, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
VICTIM = "r2"


def make_engine(tiny: Checkpoint, **options: Any) -> LLMEngine:
    options.setdefault("block_size", 4)
    options.setdefault("num_blocks", 256)
    options.setdefault("max_num_batched_tokens", 64)
    return LLMEngine(build_engine_config(str(tiny.path), **options), checkpoint=tiny)


def drain(engine: LLMEngine, finals: dict[str, RequestOutput]) -> dict[str, RequestOutput]:
    """Step until every request ended; `finals` gains each one's final output."""
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert not engine.has_unfinished_requests()
    return finals


def run(engine: LLMEngine, prompts: list[str]) -> dict[str, RequestOutput]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    return drain(engine, {})


def _raise_for(request_of: Callable[..., Request | None], original: Callable[..., Any],
               after: int = 1) -> Callable[..., Any]:
    """Wrap `original`: raise whenever it is called for the victim, once it has been called `after` times."""
    calls = {"n": 0}

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        request = request_of(*args, **kwargs)
        if request is not None and request.request_id == VICTIM:
            calls["n"] += 1
            if calls["n"] > after:  # let it start, so it fails mid-flight in a running batch
                raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    return wrapped


def _has_victim(schedule: Any) -> Request | None:
    return next((item.request for item in schedule.scheduled if item.request_id == VICTIM), None)


def _victim_row(logits: Any, requests: list[Request]) -> Request | None:
    return next((r for r in requests if r.request_id == VICTIM), None)


def inject(engine: LLMEngine, stage: str) -> None:
    kv = engine.kv_cache
    if stage == "schedule":  # the policy's bookkeeping raises for the victim
        policy = engine.scheduler.policy
        policy.on_scheduled = _raise_for(lambda request, *_: request, policy.on_scheduled)
    elif stage == "kv_lookup":  # looked up at admission only: it fails while the others are admitted
        kv.get_computed_blocks = _raise_for(lambda request: request, kv.get_computed_blocks, after=0)
    elif stage == "kv_allocate":
        kv.allocate = _raise_for(lambda request, *a, **k: request, kv.allocate)
    elif stage == "forward":  # fails for every batch holding the victim: the engine isolates it
        runner = engine.runner
        original = runner.execute

        def execute(schedule: Any) -> Any:
            if _has_victim(schedule) is not None and engine.num_steps > 2:
                raise RuntimeError("injected fault")
            return original(schedule)

        runner.execute = execute
    elif stage == "sample":
        sampler = engine.sampler
        original_sample = sampler.sample

        def sample(logits: Any, requests: list[Request]) -> Any:
            if _victim_row(logits, requests) is not None and engine.num_steps > 2:
                raise RuntimeError("injected fault")
            return original_sample(logits, requests)

        sampler.sample = sample
    elif stage in ("update", "detokenize"):
        request = engine.core._requests[VICTIM]  # the test reaches the victim's own state
        if stage == "update":  # the core's update: append and stop checks
            request.append_output_token = _raise_for(lambda token: request, request.append_output_token)
        else:  # the front end's update: text and stop strings
            _, sample = engine.outputs._samples[VICTIM]
            sample.detokenizer.update = _raise_for(lambda *a, **k: request, sample.detokenizer.update)
    else:
        raise AssertionError(stage)


@pytest.fixture(scope="module")
def reference(tiny: Checkpoint) -> dict[str, list[int]]:
    finals = run(make_engine(tiny), TINY_PROMPTS)
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


STAGES = ["schedule", "kv_lookup", "kv_allocate", "forward", "sample", "update", "detokenize"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_failing_for_one_request_fails_it_alone(tiny: Checkpoint, reference: dict[str, list[int]],
                                                          stage: str) -> None:
    engine = make_engine(tiny)
    for i, prompt in enumerate(TINY_PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    if stage == "kv_lookup":
        inject(engine, stage)
    finals = {o.request_id: o for o in engine.step() if o.finished}  # the batch runs before other faults
    if stage != "kv_lookup":
        inject(engine, stage)
    drain(engine, finals)
    assert set(finals) == set(reference)
    victim = finals[VICTIM].outputs[0]
    assert victim.finish_reason == "error", victim
    assert victim.error and "r0" not in victim.error and "r1" not in victim.error
    for rid, tokens in reference.items():
        if rid != VICTIM:
            assert finals[rid].outputs[0].finish_reason == "length"
            assert finals[rid].outputs[0].token_ids == tokens, rid
    assert engine.kv_cache.usage == 0.0
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0


def test_a_policy_whose_ranking_raises_for_one_request_fails_only_that_one(
        tiny: Checkpoint, reference: dict[str, list[int]]) -> None:
    """The whole-queue sort raises (one unrankable key): the scheduler finds the culprit by probing."""
    engine = make_engine(tiny)
    policy = engine.scheduler.policy
    original = policy.order

    def order(requests: Any, now: int) -> Any:
        requests = list(requests)
        if any(r.request_id == VICTIM for r in requests):
            raise OverflowError("injected: a priority too large to rank")
        return original(requests, now)

    policy.order = order
    finals = run(engine, TINY_PROMPTS)
    assert finals[VICTIM].outputs[0].finish_reason == "error"
    for rid, tokens in reference.items():
        if rid != VICTIM:
            assert finals[rid].outputs[0].token_ids == tokens, rid
    assert engine.kv_cache.usage == 0.0
