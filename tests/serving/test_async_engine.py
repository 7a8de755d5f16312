"""AsyncEngine without HTTP: streams, errors into the caller, aborts, idling, failures, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import pytest

from tests.serving.conftest import make_engine
from tokenloop.errors import CapacityError, EngineStoppedError, InvalidRequestError, RequestFailedError
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.metrics import EngineMetrics
from tokenloop.request import SamplingParams
from tokenloop.serving.async_engine import AsyncEngine, RequestSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)


@pytest.fixture
def async_engine(tiny_checkpoint: Checkpoint) -> Any:
    engine = AsyncEngine(make_engine(tiny_checkpoint), EngineMetrics("tiny"))
    yield engine
    engine.close()


async def _collect(async_engine: AsyncEngine, request_id: str, prompt: str, params: SamplingParams) -> list[Any]:
    return [out async for out in async_engine.generate(request_id, prompt, params)]


def test_streams_deltas_that_add_up(async_engine: AsyncEngine, tiny_checkpoint: Checkpoint) -> None:
    async def main() -> list[list[Any]]:
        return await asyncio.gather(*(_collect(async_engine, f"r{i}", p, GREEDY)
                                      for i, p in enumerate(["hello world", "the cat", "x"])))

    results = asyncio.run(main())
    offline = make_engine(tiny_checkpoint)
    for i, (outputs, prompt) in enumerate(zip(results, ["hello world", "the cat", "x"])):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        tokens = [t for o in outputs for t in o.outputs[0].token_ids_delta]
        assert tokens == outputs[-1].outputs[0].token_ids and len(tokens) == 8
        offline.add_request(f"o{i}", prompt, GREEDY)
    finals = {}
    while offline.has_unfinished_requests():
        finals.update({o.request_id: o for o in offline.step() if o.finished})
    assert [finals[f"o{i}"].outputs[0].token_ids for i in range(3)] == \
        [r[-1].outputs[0].token_ids for r in results]


def test_add_errors_reach_the_caller(async_engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(InvalidRequestError) as info:
            await async_engine.add_requests([RequestSpec("bad", "x" * 5000, GREEDY)])
        assert info.value.param == "prompt"
        with pytest.raises(InvalidRequestError):
            await async_engine.add_requests([RequestSpec("ok", "hello", GREEDY), RequestSpec("bad", [10**9], GREEDY)])
        # All or none: the good half of a rejected submission is not left running.
        assert not await async_engine.utility("has_unfinished_requests")

    asyncio.run(main())


def test_capacity_error(tiny_checkpoint: Checkpoint) -> None:
    engine = AsyncEngine(make_engine(tiny_checkpoint, max_num_seqs=1, max_waiting=1))
    engine.utility_blocking("inject_step_delay", 0.05)  # the first two stay in flight on any machine

    async def main() -> None:
        streams = [await engine.add_requests([RequestSpec(f"r{i}", "hello", LONG)]) for i in range(2)]
        with pytest.raises(CapacityError):
            await engine.add_requests([RequestSpec("r2", "hello", LONG)])
        for stream in streams:
            stream.abort()

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_abort_releases_blocks_within_a_step(async_engine: AsyncEngine) -> None:
    async_engine.utility_blocking("inject_step_delay", 0.05)  # both still running when aborted, on any machine

    async def main() -> None:
        keep = await async_engine.add_requests([RequestSpec("keep", "hello world", LONG)])
        drop = await async_engine.add_requests([RequestSpec("drop", "the cat sat on the mat", LONG)])
        await keep.__anext__()
        await drop.__anext__()
        drop.abort()
        # Commands apply in order between steps: the first call after the abort already sees it applied
        # (counting steps since an earlier call instead races with the event loop on a loaded machine).
        holds = await async_engine.call(lambda e: e.kv_cache.holds_blocks("drop"))
        assert not holds
        keep.abort()
        usage = await async_engine.utility("idle")
        assert usage == (False, 0.0)
        assert async_engine.counts().finished.get("abort") == 2

    asyncio.run(main())


def test_leaving_generate_early_aborts(async_engine: AsyncEngine) -> None:
    async def main() -> None:
        async with contextlib.aclosing(async_engine.generate("r", "hello", LONG)) as outputs:
            async for _ in outputs:
                break
        assert not await async_engine.utility("has_unfinished_requests")

    asyncio.run(main())


def test_idle_thread_blocks_instead_of_spinning(async_engine: AsyncEngine) -> None:
    asyncio.run(_collect(async_engine, "r", "hello", GREEDY))
    wakeups = async_engine.num_wakeups
    time.sleep(0.3)
    assert async_engine.num_wakeups == wakeups
    assert async_engine.is_running


def test_step_failure_fails_in_flight_and_keeps_serving(async_engine: AsyncEngine) -> None:
    def break_schedule_once(engine: Any) -> None:
        original = engine.scheduler.schedule

        def broken() -> Any:
            engine.scheduler.schedule = original
            raise RuntimeError("injected")

        engine.scheduler.schedule = broken

    async def main() -> None:
        await async_engine.call(break_schedule_once)
        with pytest.raises(RequestFailedError):
            await _collect(async_engine, "r1", "hello", GREEDY)
        outputs = await _collect(async_engine, "r2", "hello", GREEDY)
        assert outputs[-1].outputs[0].finish_reason == "length"
        assert async_engine.counts().step_failures == 1

    asyncio.run(main())


def test_shutdown_finishes_short_requests_and_aborts_long_ones(tiny_checkpoint: Checkpoint) -> None:
    engine = AsyncEngine(make_engine(tiny_checkpoint))
    # 600 tokens at >= 20 ms a step outlast the 2 s grace on any machine; 8 tokens take ~0.2 s of it.
    engine.utility_blocking("inject_step_delay", 0.02)

    async def main() -> None:
        short = await engine.add_requests([RequestSpec("short", "hello", GREEDY)])
        long = await engine.add_requests([RequestSpec("long", "hello", LONG)])
        begin = time.monotonic()
        await engine.shutdown(timeout_s=2.0)
        assert time.monotonic() - begin < 6.0
        short_outputs = [o async for o in short]
        long_outputs = [o async for o in long]
        assert short_outputs[-1].outputs[0].finish_reason == "length"
        assert long_outputs[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineStoppedError):
            await engine.add_requests([RequestSpec("late", "hello", GREEDY)])

    asyncio.run(main())
    assert not engine.is_running
    assert not engine.engine.has_unfinished_requests() and engine.engine.kv_cache.usage == 0.0


def test_streams_on_several_event_loops(async_engine: AsyncEngine) -> None:
    """Each stream is fed through its own loop, so callers on different threads can share the engine."""
    results: dict[int, list[Any]] = {}

    def worker(i: int) -> None:
        results[i] = asyncio.run(_collect(async_engine, f"t{i}", "hello", GREEDY))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [0, 1, 2]
    assert all(r[-1].finished for r in results.values())
