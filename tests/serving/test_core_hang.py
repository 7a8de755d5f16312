"""A core that hangs without exiting is found by its heartbeat, killed, and handled as a dead one; a step
that is merely long (a slow model, layer after layer) is not a hang; nothing is left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import write_tiny_llama
from tests.serving.conftest import SLOW_STEP_S, wait_for_health
from tests.serving.test_core_process import _alive, _core_pid, assert_health_503, fault_mid_stream, serve_process
from tokenloop.core.heartbeat import HangWatch
from tokenloop.core.messages import CoreHeartbeat
from tokenloop.core.private_dir import PrivateDir
from tokenloop.errors import ConfigError, EngineStoppedError, RequestFailedError
from tokenloop.llm import build_engine_config
from tokenloop.request import SamplingParams
from tokenloop.serving.async_engine import AsyncEngine
from tokenloop.serving.server import free_port

OPTIONS: dict[str, Any] = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "block_size": 4, "num_blocks": 256}
BOUND_S = 2.0  # the hang timeout of these tests
LAYERS = 8
# A slow model: each layer takes 0.4 s (a fifth of the bound), so one prefill step takes 3.2 s (1.6 times the
# bound) while its progress moves every 0.4 s; the watch looks every 0.5 s at a beat at most 0.25 s old.
LAYER_DELAY_S = 0.4
LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("deep-tiny-llama"), num_layers=LAYERS)


@pytest.fixture
def watched_engine(deep_model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.with_core_process(build_engine_config(str(deep_model_dir), **OPTIONS),
                                           hang_timeout_s=BOUND_S)
    directory = engine.client._sockets.directory.path  # type: ignore[attr-defined]
    yield engine
    engine.close()
    assert not _alive(engine.client.process.pid)  # type: ignore[attr-defined]
    assert not os.path.exists(directory)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_watch_judges_progress_not_beats() -> None:
    clock = _Clock()
    watch = HangWatch(2.0, clock)
    assert not watch.due() and watch.timeout_ms() is None  # not armed before the core is ready
    watch.arm()
    for step in range(20):  # a core that beats and moves: never hung, however long it runs
        clock.now += 0.5
        assert watch.due()
        assert watch.look(CoreHeartbeat(step)) is None
    for _ in range(4):  # beats, no progress: hung once the bound has passed, not before
        clock.now += 0.5
        assert watch.look(CoreHeartbeat(19)) is None
    clock.now += 0.5
    why = watch.look(CoreHeartbeat(19))
    assert why is not None and "stopped responding for 2.5 s" in why and "no progress" in why
    silent = HangWatch(2.0, clock)
    silent.arm()
    clock.now += 2.1
    assert "no heartbeat" in (silent.look(None) or "")
    off = HangWatch(0.0, clock)
    off.arm()
    clock.now += 1000
    assert not off.due() and off.timeout_ms() is None
    with pytest.raises(ConfigError):
        HangWatch(0.5)


async def _stream_until_first_token(engine: AsyncEngine, request_id: str) -> Any:
    stream = await engine.add_requests([_spec(request_id)])
    iterator = stream.__aiter__()
    while not (await iterator.__anext__()).outputs[0].token_ids_delta:
        pass
    return iterator


def _spec(request_id: str, params: SamplingParams = LONG) -> Any:
    from tokenloop.serving.async_engine import RequestSpec

    return RequestSpec(request_id, "hello world", params)


def test_a_long_step_with_progress_is_no_hang_and_the_same_step_without_is(watched_engine: AsyncEngine) -> None:
    engine = watched_engine
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def main() -> None:
        await engine.utility("inject_layer_delay", LAYER_DELAY_S)
        began = time.monotonic()
        outputs = [o async for o in await engine.add_requests([_spec("slow", one_token)])]
        took = time.monotonic() - began
        assert outputs[-1].outputs[0].finish_reason == "length"
        assert took >= LAYERS * LAYER_DELAY_S > BOUND_S  # one step, longer than the bound: no hang
        assert not engine.crashed and await engine.utility("ping") is True
        await engine.utility("inject_layer_delay", 0.0)
        # The control: a step just as long that shows no progress while it lasts (one opaque sleep).
        await engine.utility("inject_step_delay", LAYERS * LAYER_DELAY_S)
        began = time.monotonic()
        with pytest.raises(EngineStoppedError) as failed:  # hung before it was even accepted
            await engine.add_requests([_spec("opaque", one_token)])
        assert time.monotonic() - began >= BOUND_S * 0.6  # the bound, less what the watch saw before
        assert "the engine core stopped responding for" in str(failed.value)
        assert "no progress" in str(failed.value)

    asyncio.run(main())
    assert engine.crashed and engine.client.process.exitcode == -signal.SIGKILL  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["busy", "deadlock"])
def test_a_hung_main_thread_fails_streams_and_is_killed(watched_engine: AsyncEngine, kind: str) -> None:
    engine = watched_engine

    async def main() -> None:
        await engine.utility("inject_step_delay", SLOW_STEP_S)  # in flight when it hangs, on any machine
        iterator = await _stream_until_first_token(engine, "r")
        hung = asyncio.ensure_future(engine.utility("inject_hang", kind))
        hung_at = time.monotonic()
        with pytest.raises(RequestFailedError) as failed:
            while True:
                await iterator.__anext__()
        took = time.monotonic() - hung_at
        assert BOUND_S * 0.6 <= took < BOUND_S + 5.0, took  # at the bound: 1.25 x + a beat; 5 s for a slow host
        message = str(failed.value)
        assert "the engine core stopped responding for" in message and "no progress" in message, message
        with pytest.raises(EngineStoppedError):
            await hung  # the call that hung it is refused, not left waiting

    asyncio.run(main())
    assert engine.crashed and "stopped responding" in (engine.death or "")
    assert engine.client.process.exitcode == -signal.SIGKILL  # type: ignore[attr-defined]


def _server_dir(server_pid: int) -> Path:
    """The private socket directory whose lock file names `server_pid`."""
    import tempfile

    for lock in Path(tempfile.gettempdir()).glob("tokenloop-core-*/owner.lock"):
        try:
            if lock.read_text().split() == [str(server_pid)]:
                return lock.parent
        except OSError:
            continue
    raise AssertionError(f"no socket directory of server {server_pid}")


def test_a_stopped_core_fails_streams_answers_503_and_the_server_exits_non_zero(tiny_model_dir: Path) -> None:
    port = free_port()
    process = serve_process(tiny_model_dir, port, "--hang-timeout", str(BOUND_S))
    core = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, process)
        core = _core_pid(process.pid)
        directory = _server_dir(process.pid)
        payloads, took, plain = fault_mid_stream(url, tiny_model_dir, lambda: os.kill(core, signal.SIGSTOP))
        assert took < BOUND_S + 5.0, f"the stream took {took:.2f} s to end after the core stopped"
        assert payloads[-1] == "[DONE]"
        error = json.loads(payloads[-2])["error"]
        assert error["type"] == "server_error"
        assert "the engine core stopped responding for" in error["message"] and "no heartbeat" in error["message"]
        assert plain.status_code >= 500 and "stopped responding" in plain.json()["error"]["message"]
        assert_health_503(url)
        assert process.wait(timeout=30) == 3
        assert not _alive(core), "the stopped core was left behind"
        assert not directory.exists(), "the socket directory was left behind"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if core is not None and _alive(core):
            os.kill(core, signal.SIGKILL)


def test_a_killed_servers_socket_directory_is_reaped_by_the_next(tiny_model_dir: Path) -> None:
    port = free_port()
    process = serve_process(tiny_model_dir, port)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", process)
        core = _core_pid(process.pid)
        directory = _server_dir(process.pid)
        PrivateDir.create().remove()  # what the next server to start does first: a live server's stays
        assert directory.exists()
        process.kill()  # SIGKILL: nothing of the server's cleanup runs
        process.wait()
        deadline = time.monotonic() + 10
        while _alive(core):  # the core sees its parent gone and exits; its end frees the directory's lock
            assert time.monotonic() < deadline, "the core outlived its server"
            time.sleep(0.05)
        assert directory.exists()
        # Its main thread gone, the core's last threads may still hold the lock a moment: a later start reaps.
        while directory.exists():
            assert time.monotonic() < deadline, "the dead server's directory was never reaped"
            PrivateDir.create().remove()
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
