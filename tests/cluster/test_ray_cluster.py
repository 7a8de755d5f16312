"""Replicas as Ray actors behind the front door: a killed actor's requests resume on the other one by
recompute (or fail with the replica named), and the front door keeps serving."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'tokenloop[ray]'")

from tests.cluster.test_replica_set import OPTIONS, _collect_ended, _reference  # noqa: E402
from tests.conftest import TINY_PROMPTS  # noqa: E402
from tokenloop.cluster.launch import ClusterOptions  # noqa: E402
from tokenloop.cluster.ray_replica import start_ray  # noqa: E402
from tokenloop.cluster.replica_set import ReplicaSet  # noqa: E402
from tokenloop.llm import build_engine_config  # noqa: E402
from tokenloop.model.loader import Checkpoint  # noqa: E402
from tokenloop.request import SamplingParams  # noqa: E402
from tokenloop.serving.async_engine import AsyncEngine  # noqa: E402


@pytest.mark.parametrize("failover", ["recompute", "fail"])
def test_killing_a_ray_replica_mid_stream(tiny: Checkpoint, failover: str) -> None:
    cluster = start_ray(None, num_cpus=2, log_to_driver=False)
    engine = None
    try:
        config = build_engine_config(str(tiny.path), **OPTIONS)
        engine = AsyncEngine.with_replicas(config, ClusterOptions(replicas=2, cluster="ray", router="round-robin",
                                                                  failover=failover, restart=False),
                                           checkpoint=tiny, startup_timeout_s=120)
        replica_set = engine.client
        assert isinstance(replica_set, ReplicaSet)
        # ray.kill must land mid-stream: at 40 tokens the tiny model's replica could finish its last ~30 steps
        # before the kill reached it, and the "fail" request ended with "length" (seen in CI). Slowed steps
        # make its remaining 288 take >= 5.7 s on any machine; the survivors run at full speed again after.
        max_tokens = 300
        prompts = [TINY_PROMPTS[0], TINY_PROMPTS[2]]
        expected = _reference(tiny, prompts, max_tokens)
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind="delta")

        async def main() -> list[Any]:
            await engine.utility("inject_step_delay", 0.02)  # every replica
            tasks = [asyncio.create_task(_collect_ended(engine, f"r{i}", p, greedy)) for i, p in enumerate(prompts)]
            while await engine.utility("num_steps") < 12:
                await asyncio.sleep(0.005)
            ray.kill(replica_set.replicas[0].client.actor)
            await engine.utility("inject_step_delay", 0.0)  # the live ones
            return list(await asyncio.gather(*tasks))

        results = asyncio.run(main())
        assert results[1] == (expected[1], "length")
        if failover == "recompute":
            assert results[0] == (expected[0], "length")
        else:
            tokens, reason = results[0]
            assert reason == "error" and tokens == expected[0][:len(tokens)]
        assert replica_set.replicas[0].alive is False and "replica 0" in (replica_set.replicas[0].death or "")
        assert engine.utility_blocking("ping") is True  # the front door keeps serving on the survivor
        after = asyncio.run(_collect_ended(engine, "after", prompts[0], greedy))
        assert after == (expected[0], "length")
    finally:
        if engine is not None:
            engine.close()
        cluster.stop()
