"""Engine cores as Ray actors (`RayCoreClient`) on a local Ray cluster: the in-process core's tokens, named
calls, a killed actor noticed at once while the other keeps serving, and an unreachable --ray-address."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'tokenloop[ray]'")

from tests.conftest import TINY_PROMPTS
from tests.serving.conftest import SLOW_STEP_S, make_engine
from tests.serving.test_core_process import OPTIONS, _run
from tokenloop.cluster.ray_replica import (
    RayCluster,
    RayCoreClient,
    check_head,
    start_ray,
)
from tokenloop.errors import ConfigError, ModelLoadError, RequestFailedError
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.request import SamplingParams
from tokenloop.serving.async_engine import AsyncEngine, RequestSpec

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.parametrize("answer", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"], ids=["silent", "http1"])
def test_a_port_that_answers_but_not_as_a_ray_head_is_refused_fast(answer: bytes | None) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def serve() -> None:
            connection, _ = listener.accept()
            with connection:
                if answer is not None:
                    connection.sendall(answer)
                else:
                    connection.recv(100)
                    time.sleep(1.5)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        began = time.monotonic()
        with pytest.raises(OSError):
            check_head("127.0.0.1", listener.getsockname()[1], timeout_s=0.5)
        assert time.monotonic() - began < 2.0
        thread.join(5)


_HEAD = """
import sys, ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
print(ray.get_runtime_context().gcs_address.rsplit(":", 1)[1], flush=True)
sys.stdin.read()  # until the test closes it
ray.shutdown()
"""

_JOINER = """
import json, sys
from tests.cluster.test_ray_replica import OPTIONS, _tokens
from tokenloop.cluster.ray_replica import RayCoreClient, start_ray
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import load_model_info
from tokenloop.serving.async_engine import AsyncEngine
cluster = start_ray(sys.argv[1])
config = build_engine_config(sys.argv[2], **OPTIONS)
client = RayCoreClient(config, replica=7, startup_timeout_s=120)
engine = AsyncEngine(None, client=client, config=config, tokenizer=load_model_info(sys.argv[2]).tokenizer)
print(json.dumps([cluster.initialized_here, _tokens(engine, sys.argv[3:])]), flush=True)
engine.close()
cluster.stop()
"""


def test_a_server_joins_a_running_cluster_by_its_address(tiny_model_dir: Path, tiny: Checkpoint) -> None:
    """A head started elsewhere (its own process, as `ray start --head` would be) and a driver that joins it
    by the address a user would type on this host."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    head = subprocess.Popen([sys.executable, "-c", _HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        port = int(head.stdout.readline())  # type: ignore[union-attr]
        command = [sys.executable, "-c", _JOINER, f"127.0.0.1:{port}", str(tiny_model_dir), *TINY_PROMPTS[:2]]
        joined = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
                                env={**env, "RAY_AUTH_MODE": "token"})  # the head made a token: use it
        assert joined.returncode == 0, joined.stderr[-2000:]
        initialized_here, tokens = json.loads(joined.stdout.splitlines()[-1])
    finally:
        head.stdin.close()  # type: ignore[union-attr]
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
    local = AsyncEngine(make_engine(tiny, **OPTIONS))
    try:
        assert initialized_here and tokens == _tokens(local, TINY_PROMPTS[:2])
    finally:
        local.close()


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


def test_an_actor_the_node_cannot_fit_is_refused_at_once(cluster: RayCluster, tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="asks for 3 CPUs; this Ray node has 2"):
        RayCoreClient(build_engine_config(str(tiny_model_dir), **OPTIONS), num_cpus=3)


def test_an_actor_whose_cpus_are_taken_is_refused(replicas: list[AsyncEngine], tiny_model_dir: Path) -> None:
    """The node has 2 CPUs, so 2 fit it, but the replicas hold at least one of them."""
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"placed in 2 s: it asks for 2 CPUs and Ray has [01] of 2 free"):
        RayCoreClient(build_engine_config(str(tiny_model_dir), **OPTIONS), num_cpus=2, placement_timeout_s=2)
    assert time.monotonic() - began < 10


def test_killing_an_actor_mid_stream_is_noticed_at_once_and_the_other_serves_on(
        replicas: list[AsyncEngine]) -> None:
    doomed, survivor = replicas
    client: RayCoreClient = doomed.client  # type: ignore[assignment]
    steady = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    expected = _run(survivor, [RequestSpec("steady", TINY_PROMPTS[0], steady)])["steady"]
    killed: list[float] = []

    async def doomed_stream() -> None:
        long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
        stream = await doomed.add_requests([RequestSpec("long", "hello world", long)])
        with pytest.raises(RequestFailedError, match="replica 0") as failed:
            async for output in stream:
                if output.outputs[0].token_ids_delta and not killed:
                    ray.kill(client.actor)
                    killed.append(time.monotonic())
        killed.append(time.monotonic())
        assert "died" in str(failed.value)

    async def main() -> list[Any]:
        steady_stream = await survivor.add_requests([RequestSpec("steady", TINY_PROMPTS[0], steady)])
        await doomed_stream()
        return [output async for output in steady_stream]

    doomed.utility_blocking("inject_step_delay", SLOW_STEP_S)  # still streaming when the kill lands
    steady_outputs = asyncio.run(main())
    took = killed[1] - killed[0]
    assert took < 1.0, f"the stream took {took:.2f} s to fail after the actor was killed"
    why = client.death()
    assert why is not None and "replica 0" in why and client.actor_name in why
    assert doomed.crashed and not doomed.accepting
    tokens = [t for output in steady_outputs for c in output.outputs for t in c.token_ids_delta]
    assert tokens == [t for _, _, completions in expected for c in completions for t in c[2]]
    assert survivor.accepting and _tokens(survivor, TINY_PROMPTS[:2])  # and it takes new work
