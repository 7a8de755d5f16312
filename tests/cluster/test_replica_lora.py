"""LoRA adapters loaded at run time on a replica set (`tokenloop serve --replicas N --lora-dir DIR`): on every
replica or none, summed answers, and again on a replica that was started again."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from tests.cluster.test_replica_set import OPTIONS, SLOW_REPLICA_STEP_S, _Killable
from tests.lora_adapters import ALL_TARGETS, write_peft_adapter
from tokenloop.cluster.launch import replica_config
from tokenloop.cluster.load import LoadTracker
from tokenloop.cluster.replica_set import ReplicaSet
from tokenloop.cluster.router import RouterConfig, make_router
from tokenloop.config import EngineConfig, LoRAConfig
from tokenloop.core.engine_core import EngineCore
from tokenloop.errors import AdapterLoadError, AdapterNotFoundError
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.request import SamplingParams
from tokenloop.serving.async_engine import AsyncEngine
from tokenloop.serving.core_client import InProcessCoreClient

PROMPT = [5, 9, 17, 3, 12, 40, 41]


@pytest.fixture(scope="module")
def allowed(tiny: Checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-allowed")
    write_peft_adapter(Path(tiny.path), root / "c", 8, 16, ALL_TARGETS, seed=3)
    return root


def _replica_set(tiny: Checkpoint, configs: list[EngineConfig]) -> tuple[AsyncEngine, list[_Killable]]:
    """Replicas of the given configs behind a round-robin router (requests alternate 0, 1, ...)."""
    def start(index: int) -> _Killable:
        return _Killable(InProcessCoreClient(EngineCore(configs[index], tiny), records_in_frames=True))

    clients = [start(i) for i in range(len(configs))]
    replica_set = ReplicaSet(clients, make_router("round-robin", RouterConfig(block_size=4)),
                             LoadTracker(len(configs), configs[0].cache.block_size), restart=start)
    return AsyncEngine(None, client=replica_set, config=configs[0], tokenizer=tiny.tokenizer), clients


def _config(tiny: Checkpoint, lora_dir: Path) -> EngineConfig:
    config = replica_config(build_engine_config(str(tiny.path), **OPTIONS))
    return dataclasses.replace(config, lora=LoRAConfig(max_loras=2, lora_dir=str(lora_dir)))


async def _tokens(engine: AsyncEngine, request_id: str, lora_name: str | None, max_tokens: int = 6) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind="delta")
    tokens: list[int] = []
    async for output in engine.generate(request_id, PROMPT, params, lora_name=lora_name):
        tokens.extend(output.outputs[0].token_ids_delta)
    return tokens


def _each_replica(engine: AsyncEngine, lora_name: str | None, count: int = 2) -> list[list[int]]:
    """One request after another: round-robin puts them on replicas 0, 1, ..."""
    async def main() -> list[list[int]]:
        return [await _tokens(engine, f"{lora_name}-{i}-{time.monotonic_ns()}", lora_name) for i in range(count)]

    return asyncio.run(main())


def test_load_serves_on_every_replica_and_unload_sums(tiny: Checkpoint, allowed: Path) -> None:
    config = _config(tiny, allowed)
    engine, clients = _replica_set(tiny, [config, config])
    try:
        assert engine.utility_blocking("load_lora", "c", str(allowed / "c"))["rank"] == 8
        base, adapted = _each_replica(engine, None), _each_replica(engine, "c")
        assert adapted[0] == adapted[1] and adapted[0] != base[0]  # both replicas serve it alike

        async def unload_under_load() -> tuple[int, int]:
            await engine.utility("inject_step_delay", SLOW_REPLICA_STEP_S)  # both still run when it lands
            tasks = [asyncio.create_task(_tokens(engine, f"long{i}", "c", 200)) for i in range(2)]
            deadline = time.monotonic() + 30
            while await engine.utility("lora_in_flight", "c") < 2:  # a replica's own count says 1 at most
                assert time.monotonic() < deadline, "the in-flight count is not summed over the replicas"
                await asyncio.sleep(0.005)
            failed = await engine.utility("unload_lora", "c")
            await engine.utility("inject_step_delay", 0.0)
            await asyncio.gather(*tasks, return_exceptions=True)
            return await engine.utility("lora_in_flight", "c"), failed

        assert asyncio.run(unload_under_load()) == (0, 2)  # one request on each replica, summed
        # A replica started again after a death serves what was loaded at run time before it.
        assert engine.utility_blocking("load_lora", "c", str(allowed / "c"))["rank"] == 8
        clients[0].dead = True
        deadline = time.monotonic() + 30
        while engine.utility_blocking("cluster_status")["replicas"][0]["restarts"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _each_replica(engine, "c") == adapted
    finally:
        engine.close()


def test_a_load_one_replica_refuses_is_undone_on_the_others(tiny: Checkpoint, allowed: Path,
                                                           tmp_path: Path) -> None:
    """Replica 1 allows another directory: the load fails there, and replica 0 drops what it loaded."""
    engine, _ = _replica_set(tiny, [_config(tiny, allowed), _config(tiny, tmp_path)])
    try:
        with pytest.raises(AdapterLoadError, match="not under the allowed"):
            engine.utility_blocking("load_lora", "c", str(allowed / "c"))
        for _ in range(2):  # on neither replica
            with pytest.raises(AdapterNotFoundError):
                _each_replica(engine, "c", 1)
        assert engine.utility_blocking("list_loras") == []
    finally:
        engine.close()
