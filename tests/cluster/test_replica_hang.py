"""A replica that hangs (stopped, not dead) is found by its heartbeat, killed, and failed over like a dead one."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from typing import Any

import pytest

from tests.cluster.test_replica_set import OPTIONS, SLOW_REPLICA_STEP_S, _collect_ended, _greedy, _reference
from tests.conftest import TINY_PROMPTS
from tests.serving.test_core_process import _alive
from tokenloop.cluster.launch import ClusterOptions
from tokenloop.engine import LLMEngine
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.request import SamplingParams
from tokenloop.serving.async_engine import AsyncEngine
from tokenloop.structured.spec import StructuredOutputsParams as SO

BOUND_S = 2.0


def _two_replicas(tiny: Checkpoint) -> AsyncEngine:
    """Two local replicas, round-robin, failover by recompute, no restart, the heartbeat bound BOUND_S."""
    return AsyncEngine.with_replicas(build_engine_config(str(tiny.path), **OPTIONS), ClusterOptions(
        replicas=2, cluster="local", router="round-robin", failover="recompute", restart=False,
        hang_timeout_s=BOUND_S), checkpoint=tiny)


def _constrained_reference(tiny: Checkpoint, prompt: str, params: SamplingParams) -> list[int]:
    engine = LLMEngine(build_engine_config(str(tiny.path), **OPTIONS), checkpoint=tiny)
    engine.add_request("ref", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = list(output.outputs[0].token_ids)
    return tokens


@pytest.mark.parametrize("constrained", [False, True])
def test_a_stopped_replica_is_killed_and_its_requests_resume_elsewhere(tiny: Checkpoint,
                                                                       constrained: bool) -> None:
    # Constrained: the resumed request's grammar goes on from its output so far (not from the start).
    engine = _two_replicas(tiny)
    max_tokens = 30
    prompts = [TINY_PROMPTS[0], TINY_PROMPTS[2]]
    params = _greedy(max_tokens)
    if constrained:
        params = dataclasses.replace(params, structured_outputs=SO(regex="x[a-w]{300}"))
        expected = [_constrained_reference(tiny, p, params) for p in prompts]
    else:
        expected = _reference(tiny, prompts, max_tokens)
    replicas = engine.client.replicas  # type: ignore[attr-defined]
    try:
        async def main() -> list[Any]:
            await engine.utility("inject_step_delay", SLOW_REPLICA_STEP_S)  # mid-stream when it stops
            tasks = [asyncio.create_task(_collect_ended(engine, f"r{i}", p, params))
                     for i, p in enumerate(prompts)]
            while await engine.utility("num_steps") < 10:
                await asyncio.sleep(0.01)
            status = (await engine.utility("cluster_status"))["replicas"]
            assert [row["requests"] for row in status] == [1, 1]
            os.kill(status[0]["pid"], signal.SIGSTOP)  # alive, but it answers nothing more
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 60))  # a missed hang: fail, not wait

        stopped_pid = replicas[0].client.info.pid
        results = asyncio.run(main())
        assert results == [(expected[0], "length"), (expected[1], "length")]  # resumed, the same tokens
        assert replicas[0].alive is False and "stopped responding" in (replicas[0].death or "")
        assert "no heartbeat" in replicas[0].death
        assert not _alive(stopped_pid), "the stopped replica was left behind"
        assert engine.utility_blocking("ping") is True and not engine.crashed  # the front door stays up
    finally:
        engine.close()


def test_a_request_sent_to_a_replica_that_hangs_before_accepting_it_runs_elsewhere(tiny: Checkpoint) -> None:
    # The stopped replica never answers the submission: with failover recompute it is routed again.
    engine = _two_replicas(tiny)
    max_tokens = 8
    prompts = [TINY_PROMPTS[0], TINY_PROMPTS[2]]
    expected = _reference(tiny, prompts, max_tokens)
    try:
        async def main() -> list[Any]:
            status = (await engine.utility("cluster_status"))["replicas"]
            os.kill(status[0]["pid"], signal.SIGSTOP)  # before any request: round-robin sends one there
            tasks = [asyncio.create_task(_collect_ended(engine, f"r{i}", p, _greedy(max_tokens)))
                     for i, p in enumerate(prompts)]
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 60))

        assert asyncio.run(main()) == [(expected[0], "length"), (expected[1], "length")]
        status = engine.utility_blocking("cluster_status")["replicas"]
        assert [row["alive"] for row in status] == [False, True]
    finally:
        engine.close()
