"""Engine cores as Ray actors (`RayCoreClient`) on a local Ray cluster: the in-process core's tokens, named
calls, a killed actor noticed at once while the other keeps serving, and an unreachable --ray-address."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'tokenloop[ray]'")

from tests.conftest import TINY_PROMPTS  # noqa: E402
from tests.serving.conftest import make_engine  # noqa: E402
from tests.serving.test_core_process import OPTIONS, _run  # noqa: E402
from tokenloop.cluster.ray_replica import RayCluster, RayCoreClient, start_ray  # noqa: E402
from tokenloop.errors import ConfigError, ModelLoadError, RequestFailedError  # noqa: E402
from tokenloop.llm import build_engine_config  # noqa: E402
from tokenloop.model.loader import Checkpoint  # noqa: E402
from tokenloop.request import SamplingParams  # noqa: E402
from tokenloop.serving.async_engine import AsyncEngine, RequestSpec  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    started = start_ray(None, num_cpus=2, log_to_driver=False)
    yield started
    started.stop()
    assert not ray.is_initialized() or not started.initialized_here


@pytest.fixture(scope="module")
def replicas(cluster: RayCluster, tiny_model_dir: Path, tiny: Checkpoint) -> Iterator[list[AsyncEngine]]:
    """Two actors: one loads the model from its path, the other gets the driver's checkpoint pickled."""
    config = build_engine_config(str(tiny_model_dir), **OPTIONS)
    engines = []
    try:
        for replica, checkpoint in enumerate([None, tiny]):
            client = RayCoreClient(config, checkpoint, replica=replica, startup_timeout_s=120)
            engines.append(AsyncEngine(None, client=client, config=config, tokenizer=tiny.tokenizer))
        yield engines
    finally:
        for engine in engines:
            engine.close()


def _tokens(engine: AsyncEngine, prompts: list[str]) -> dict[str, list[int]]:
    outputs = _run(engine, [RequestSpec(f"p{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)])
    return {rid: [t for _, _, completions in seen for c in completions for t in c[2]]
            for rid, seen in outputs.items()}


def test_an_unreachable_ray_address_fails_fast_naming_it() -> None:
    began = time.monotonic()
    with pytest.raises(ConfigError, match="127.0.0.1:1 "):
        start_ray("127.0.0.1:1", connect_timeout_s=1.0)
    assert time.monotonic() - began < 5.0
    with pytest.raises(ConfigError, match="not host:port"):
        start_ray("nowhere", connect_timeout_s=1.0)


def test_actors_give_the_in_process_cores_greedy_tokens(replicas: list[AsyncEngine],
                                                        tiny: Checkpoint) -> None:
    local = AsyncEngine(make_engine(tiny, **OPTIONS))
    try:
        expected = _tokens(local, TINY_PROMPTS)
    finally:
        local.close()
    assert all(len(tokens) == GREEDY.max_tokens for tokens in expected.values())
    assert replicas[0].client.info.pid != replicas[1].client.info.pid  # two actors, two processes
    for engine in replicas:
        assert _tokens(engine, TINY_PROMPTS) == expected


def test_utility_calls_reach_the_actor(replicas: list[AsyncEngine]) -> None:
    async def main(engine: AsyncEngine) -> None:
        stats = await engine.utility("stats")
        assert stats.num_running == 0 and stats.num_waiting == 0
        facts = await engine.utility("kv_facts")
        assert facts["free_blocks"] == facts["num_blocks"] == engine.client.info.num_blocks

    for engine in replicas:
        asyncio.run(main(engine))


def test_a_bad_model_fails_the_actor_start_with_the_reason(cluster: RayCluster, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="engine core failed to start"):
        RayCoreClient(build_engine_config(str(tmp_path), **OPTIONS), num_cpus=0, startup_timeout_s=60)


def test_killing_an_actor_mid_stream_is_noticed_at_once_and_the_other_serves_on(
        replicas: list[AsyncEngine]) -> None:
    doomed, survivor = replicas
    expected = _tokens(survivor, TINY_PROMPTS[:2])
    long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    async def main() -> float:
        stream = await doomed.add_requests([RequestSpec("long", "hello world", long)])
        with pytest.raises(RequestFailedError, match="replica 0") as failed:
            async for output in stream:
                if output.outputs[0].token_ids_delta and not ray_killed:
                    ray.kill(doomed.client.actor)  # type: ignore[attr-defined]
                    ray_killed.append(time.monotonic())
        assert "died" in str(failed.value)
        return time.monotonic() - ray_killed[0]

    ray_killed: list[float] = []
    took = asyncio.run(main())
    assert took < 1.0, f"the stream took {took:.2f} s to fail after the actor was killed"
    why = doomed.client.death()
    assert why is not None and "replica 0" in why and doomed.client.actor_name in why  # type: ignore[attr-defined]
    assert doomed.crashed and not doomed.accepting
    assert _tokens(survivor, TINY_PROMPTS[:2]) == expected
