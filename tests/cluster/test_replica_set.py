"""N in-process engine cores behind one AsyncEngine: the same greedy outputs as one engine under every router,
no block left referenced anywhere, drain and migration without a broken stream, and failover."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import TINY_PROMPTS
from tokenloop.cluster.launch import ClusterOptions
from tokenloop.cluster.replica_set import ReplicaSet
from tokenloop.cluster.router import ROUTERS
from tokenloop.engine import LLMEngine
from tokenloop.errors import ClusterConflictError, ReplicaNotFoundError
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.request import SamplingParams
from tokenloop.serving.async_engine import AsyncEngine

# fp32: greedy tokens are exact whatever the batch (dtype auto may pick bf16 on this CPU, where the tiny
# random model has exact logit ties that batch composition breaks one way or the other).
OPTIONS: dict[str, Any] = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 4, "num_blocks": 256,
                           "dtype": "float32"}
# Tests that act on a request mid-stream (drain, migrate, kill) slow every step until they have acted, so
# the request is still running when the action lands however fast the machine (30 tokens: >= 0.6 s).
SLOW_REPLICA_STEP_S = 0.02
SHARED = "the system prompt every user of this tiny service shares before their own words: "
PROMPTS = [SHARED + p for p in TINY_PROMPTS] + TINY_PROMPTS


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _reference(tiny: Checkpoint, prompts: list[str], max_tokens: int = 12) -> list[list[int]]:
    engine = LLMEngine(build_engine_config(str(tiny.path), **OPTIONS), checkpoint=tiny)
    outputs = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, _greedy(max_tokens))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def _cluster(tiny: Checkpoint, **options: Any) -> AsyncEngine:
    config = build_engine_config(str(tiny.path), **OPTIONS)
    engine = AsyncEngine.with_replicas(config, ClusterOptions(cluster="inprocess", **options), checkpoint=tiny)
    engine.start()
    return engine


@pytest.fixture
def cluster(tiny: Checkpoint, request: pytest.FixtureRequest) -> Iterator[AsyncEngine]:
    engine = _cluster(tiny, **getattr(request, "param", {"replicas": 3}))
    yield engine
    engine.close()


async def _collect(engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams,
                   **options: Any) -> list[int]:
    return (await _collect_ended(engine, request_id, prompt, params, **options))[0]


async def _collect_ended(engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams,
                         **options: Any) -> tuple[list[int], str | None]:
    """Every token the stream delivered (deltas put together) and how it ended."""
    tokens: list[int] = []
    reason = None
    async for output in engine.generate(request_id, prompt, params, **options):
        tokens.extend(output.outputs[0].token_ids_delta)
        reason = output.outputs[0].finish_reason
    return tokens, reason


def _run_all(engine: AsyncEngine, prompts: list[str], max_tokens: int = 12) -> list[list[int]]:
    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(_collect(engine, f"r{i}", p, _greedy(max_tokens))
                                           for i, p in enumerate(prompts))))

    return asyncio.run(main())


def _assert_no_block_referenced(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 10
    while True:
        facts = engine.utility_blocking("kv_facts")
        if all(r["unfinished"] == 0 and r["free_blocks"] == r["num_blocks"] for r in facts["replicas"]):
            return
        assert time.monotonic() < deadline, facts
        time.sleep(0.02)


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_every_router_gives_the_single_engine_output_and_leaks_nothing(tiny: Checkpoint, router: str) -> None:
    expected = _reference(tiny, PROMPTS)
    engine = _cluster(tiny, replicas=3, router=router)
    try:
        assert _run_all(engine, PROMPTS) == expected
        _assert_no_block_referenced(engine)
        status = engine.utility_blocking("cluster_status")
        assert status["router"] == router
        assert len(status["replicas"]) == 3
    finally:
        engine.close()


def test_round_robin_spreads_and_records_the_route(tiny: Checkpoint) -> None:
    from tokenloop.observe.records import ArrivalRecord

    class Arrivals:
        def __init__(self) -> None:
            self.records: list[ArrivalRecord] = []

        def on_arrival(self, record: ArrivalRecord) -> None:
            self.records.append(record)

    arrivals = Arrivals()
    config = build_engine_config(str(tiny.path), **OPTIONS)
    engine = AsyncEngine.with_replicas(config, ClusterOptions(replicas=3, cluster="inprocess",
                                                              router="round-robin"),
                                       checkpoint=tiny, observers=[arrivals])
    try:
        async def main() -> None:
            for i in range(3):  # one after another: each sees the previous one routed
                await _collect(engine, f"r{i}", TINY_PROMPTS[i], _greedy(2))

        asyncio.run(main())
        assert sorted(r.replica for r in arrivals.records) == [0, 1, 2]
        assert all(r.route is not None and r.route["policy"] == "round-robin" for r in arrivals.records)
    finally:
        engine.close()


def test_merged_utilities_and_cluster_errors(cluster: AsyncEngine) -> None:
    assert cluster.utility_blocking("has_unfinished_requests") is False
    assert cluster.utility_blocking("num_unfinished_requests") == 0
    with pytest.raises(ReplicaNotFoundError, match=r"valid indices are 0\.\.2"):
        cluster.utility_blocking("cluster_drain", 7)
    cluster.utility_blocking("cluster_drain", 0)
    cluster.utility_blocking("cluster_drain", 1)
    with pytest.raises(ClusterConflictError, match="last replica that admits work"):
        cluster.utility_blocking("cluster_drain", 2)
    # Drained replicas admit nothing new: everything lands on replica 2.
    assert all(len(tokens) == 3 for tokens in _run_all(cluster, TINY_PROMPTS[:3], max_tokens=3))
    steps = [r["steps"] for r in cluster.utility_blocking("kv_facts")["replicas"]]
    assert steps[0] == steps[1] == 0 and steps[2] > 0, steps
    assert cluster.utility_blocking("cluster_undrain", 0)["admitting"] is True


def test_drain_moves_running_requests_and_their_streams_continue(tiny: Checkpoint) -> None:
    max_tokens = 40
    prompts = [SHARED + TINY_PROMPTS[0], SHARED + TINY_PROMPTS[2]]
    expected = _reference(tiny, prompts, max_tokens)
    engine = _cluster(tiny, replicas=2, router="round-robin")
    try:
        async def main() -> list[list[int]]:
            await engine.utility("inject_step_delay", SLOW_REPLICA_STEP_S)  # the action lands mid-stream
            tasks = [asyncio.create_task(_collect(engine, f"r{i}", p, _greedy(max_tokens)))
                     for i, p in enumerate(prompts)]
            while await engine.utility("num_steps") < 8:  # both decoding, some tokens out
                await asyncio.sleep(0.01)
            result = await engine.utility("cluster_drain", 0)
            await engine.utility("inject_step_delay", 0.0)
            assert len(result["moving"]) == 1
            return list(await asyncio.gather(*tasks))

        assert asyncio.run(main()) == expected
        status = engine.utility_blocking("cluster_status")
        assert status["handoffs"]["outcomes"].get("completed") == 1, status
        assert status["replicas"][0]["admitting"] is False
        _assert_no_block_referenced(engine)
    finally:
        engine.close()


class _Killable:
    """An in-process core client that can be made to die (as a crashed process would)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.info = inner.info
        self.dead = False

    def send(self, messages: list[Any]) -> None:
        if not self.dead:
            self.inner.send(messages)

    def receive(self) -> list[Any]:
        return [] if self.dead else self.inner.receive()

    def pollables(self) -> list[Any]:
        return []

    def poll_timeout_ms(self) -> int | None:
        return None if self.dead else self.inner.poll_timeout_ms()

    def death(self) -> str | None:
        return "killed by the test" if self.dead else None

    def close(self, timeout_s: float = 5.0) -> None:
        if not self.dead:
            self.inner.close(timeout_s)


@pytest.mark.parametrize("failover", ["fail", "recompute"])
def test_a_dead_replica_fails_or_resumes_its_requests(tiny: Checkpoint, failover: str) -> None:
    from tokenloop.cluster.launch import replica_config
    from tokenloop.cluster.load import LoadTracker
    from tokenloop.cluster.router import RouterConfig, make_router
    from tokenloop.core.engine_core import EngineCore
    from tokenloop.serving.core_client import InProcessCoreClient

    config = replica_config(build_engine_config(str(tiny.path), **OPTIONS))
    clients = [_Killable(InProcessCoreClient(EngineCore(config, tiny), records_in_frames=True)) for _ in range(2)]
    replica_set = ReplicaSet(clients, make_router("round-robin", RouterConfig()),
                             LoadTracker(2, config.cache.block_size), failover=failover)
    engine = AsyncEngine(None, client=replica_set, config=config, tokenizer=tiny.tokenizer)
    max_tokens = 30
    prompts = [TINY_PROMPTS[0], TINY_PROMPTS[2]]
    expected = _reference(tiny, prompts, max_tokens)
    try:
        async def main() -> list[Any]:
            await engine.utility("inject_step_delay", SLOW_REPLICA_STEP_S)  # the action lands mid-stream
            tasks = [asyncio.create_task(_collect_ended(engine, f"r{i}", p, _greedy(max_tokens)))
                     for i, p in enumerate(prompts)]
            while await engine.utility("num_steps") < 10:
                await asyncio.sleep(0.01)
            clients[0].dead = True
            await engine.utility("inject_step_delay", 0.0)
            return list(await asyncio.gather(*tasks))

        results = asyncio.run(main())
        assert results[1] == (expected[1], "length")  # the other replica's request is untouched
        if failover == "recompute":
            assert results[0] == (expected[0], "length")
        else:
            tokens, reason = results[0]
            assert reason == "error" and tokens == expected[0][:len(tokens)] and len(tokens) < max_tokens
        assert engine.utility_blocking("ping") is True  # the front door stays healthy
        assert replica_set.replicas[0].alive is False
    finally:
        engine.close()


def test_prefill_replicas_hand_every_request_to_the_decode_group(tiny: Checkpoint) -> None:
    prompts = [SHARED + TINY_PROMPTS[0], TINY_PROMPTS[2], SHARED + TINY_PROMPTS[4]]
    expected = _reference(tiny, prompts, 16)
    engine = _cluster(tiny, replicas=3, prefill_replicas=1, router="cost")
    try:
        assert _run_all(engine, prompts, max_tokens=16) == expected
        status = engine.utility_blocking("cluster_status")
        assert status["handoffs"]["outcomes"].get("completed") == len(prompts), status
        assert [r["role"] for r in status["replicas"]] == ["prefill", "decode", "decode"]
        _assert_no_block_referenced(engine)
    finally:
        engine.close()


def test_a_migrated_seeded_request_draws_the_same_tokens(tiny: Checkpoint) -> None:
    from tokenloop.observe.records import HandoffRecord

    class Handoffs:
        def __init__(self) -> None:
            self.records: list[HandoffRecord] = []

        def on_handoff(self, record: HandoffRecord) -> None:
            self.records.append(record)

    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=48, ignore_eos=True,
                            output_kind="delta")
    prompt = SHARED + TINY_PROMPTS[2]
    alone = _cluster(tiny, replicas=1)
    try:
        expected = asyncio.run(_collect(alone, "solo", prompt, seeded))
    finally:
        alone.close()
    seen = Handoffs()
    config = build_engine_config(str(tiny.path), **OPTIONS)
    engine = AsyncEngine.with_replicas(config, ClusterOptions(replicas=2, cluster="inprocess",
                                                              router="round-robin"),
                                       checkpoint=tiny, observers=[seen])
    try:
        async def main() -> list[int]:
            await engine.utility("inject_step_delay", SLOW_REPLICA_STEP_S)  # the action lands mid-stream
            task = asyncio.create_task(_collect(engine, "moving", prompt, seeded))
            while await engine.utility("num_steps") < 12:
                await asyncio.sleep(0.005)
            await engine.utility("cluster_migrate", "moving", 1)
            await engine.utility("inject_step_delay", 0.0)
            return await task

        assert asyncio.run(main()) == expected
        events = [r.event for r in seen.records]
        assert events[0] == "exporting" and events[-1] == "completed", events
        imported = next(r for r in seen.records if r.event == "imported")
        assert (imported.source, imported.destination) == (0, 1)
        precopied = [r for r in seen.records if r.event == "precopied"]
        # Pre-copy moved the full blocks while it decoded; the pause moved only what was left.
        assert precopied and precopied[0].blocks_copied >= 1
        assert imported.blocks_copied <= 2, seen.records
        _assert_no_block_referenced(engine)
    finally:
        engine.close()


def test_the_trace_shows_the_route_and_the_handoff(tiny: Checkpoint) -> None:
    from tokenloop.observe.tracer import Tracer

    tracer = Tracer(sample_rate=1.0)
    config = build_engine_config(str(tiny.path), **OPTIONS)
    engine = AsyncEngine.with_replicas(config, ClusterOptions(replicas=2, cluster="inprocess", router="cost"),
                                       checkpoint=tiny, tracer=tracer)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, output_kind="delta")
    try:
        async def main() -> list[int]:
            await engine.utility("inject_step_delay", SLOW_REPLICA_STEP_S)  # the action lands mid-stream
            task = asyncio.create_task(_collect(engine, "traced", SHARED + TINY_PROMPTS[0], params))
            while await engine.utility("num_steps") < 6:
                await asyncio.sleep(0.005)
            await engine.utility("cluster_migrate", "traced")
            await engine.utility("inject_step_delay", 0.0)
            return await task

        assert len(asyncio.run(main())) == 30
        trace = tracer.get("traced")
        assert trace is not None
        names = [e.name for e in trace.sorted_events()]
        assert "routed" in names and "handoff_imported" in names and "handoff_completed" in names, names
        assert names.index("handoff_released") < names.index("finished"), names
        routed = next(e for e in trace.events if e.name == "routed")
        assert routed.args["policy"] == "cost"
        state = tracer.dashboard_state()
        assert [r["index"] for r in state["replicas"]] == [0, 1]
        assert state["counters"]["finished"] == 1  # a handoff is not an end
        assert state["counters"]["handoffs"] == 1
    finally:
        engine.close()


def test_a_dead_replica_is_started_again_and_takes_work(tiny: Checkpoint) -> None:
    from tokenloop.cluster.launch import replica_config
    from tokenloop.cluster.load import LoadTracker
    from tokenloop.cluster.router import RouterConfig, make_router
    from tokenloop.core.engine_core import EngineCore
    from tokenloop.serving.core_client import InProcessCoreClient

    config = replica_config(build_engine_config(str(tiny.path), **OPTIONS))

    def start(index: int) -> _Killable:
        return _Killable(InProcessCoreClient(EngineCore(config, tiny), records_in_frames=True))

    clients = [start(0), start(1)]
    replica_set = ReplicaSet(clients, make_router("round-robin", RouterConfig(block_size=4)),
                             LoadTracker(2, config.cache.block_size), restart=start)
    engine = AsyncEngine(None, client=replica_set, config=config, tokenizer=tiny.tokenizer)
    try:
        clients[0].dead = True
        deadline = time.monotonic() + 30
        while True:
            status = engine.utility_blocking("cluster_status")["replicas"]
            if status[0]["alive"] and status[0]["restarts"] == 1:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert replica_set.replicas[0].client is not clients[0]
        expected = _reference(tiny, TINY_PROMPTS[:4], 6)
        assert _run_all(engine, TINY_PROMPTS[:4], max_tokens=6) == expected
        facts = engine.utility_blocking("kv_facts")["replicas"]
        assert all(f["steps"] > 0 for f in facts)  # the restarted replica took its share
    finally:
        engine.close()


def test_rebalance_moves_queued_requests_to_a_replica_with_room(tiny: Checkpoint) -> None:
    from tokenloop.observe.records import HandoffRecord

    class Handoffs:
        def __init__(self) -> None:
            self.records: list[HandoffRecord] = []

        def on_handoff(self, record: HandoffRecord) -> None:
            self.records.append(record)

    options = {**OPTIONS, "max_num_seqs": 2}
    prompts = [p + " again" * i for i, p in enumerate(TINY_PROMPTS)] + [TINY_PROMPTS[0]]
    max_tokens = 24
    engine_config = build_engine_config(str(tiny.path), **options)
    seen = Handoffs()
    engine = AsyncEngine.with_replicas(engine_config, ClusterOptions(replicas=2, cluster="inprocess",
                                                                     router="round-robin", rebalance=True),
                                       checkpoint=tiny, observers=[seen])
    try:
        expected = _reference(tiny, prompts, max_tokens)
        assert isinstance(engine.client, ReplicaSet)
        engine.client.handoffs.rebalance_interval_ns = 0  # look at every turn: the tiny model is quick
        engine.utility_blocking("cluster_drain", 1)  # everything queues on replica 0 ...

        async def main() -> list[list[int]]:
            await engine.utility("inject_step_delay", SLOW_REPLICA_STEP_S)  # the action lands mid-stream
            tasks = [asyncio.create_task(_collect(engine, f"r{i}", p, _greedy(max_tokens)))
                     for i, p in enumerate(prompts)]
            while await engine.utility("num_unfinished_requests") < len(prompts):
                await asyncio.sleep(0.005)
            await engine.utility("cluster_undrain", 1)  # ... until replica 1 has room: rebalance moves them
            await engine.utility("inject_step_delay", 0.0)
            return list(await asyncio.gather(*tasks))

        assert asyncio.run(main()) == expected
        moved = [r for r in seen.records if r.event == "completed"]
        assert moved and all(r.reason == "rebalance" and (r.source, r.destination) == (0, 1) for r in moved)
        _assert_no_block_referenced(engine)
    finally:
        engine.close()
