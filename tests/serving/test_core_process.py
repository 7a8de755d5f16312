"""The engine core in its own process: the same outputs as in-process, and a clear end when it dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving.conftest import SLOW_STEP_S, make_engine, wait_for_health
from tokenloop.core.core_loop import STEP_DELAY_ENV
from tokenloop.errors import (
    EngineStoppedError,
    InvalidRequestError,
    ModelLoadError,
)
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.request import SamplingParams
from tokenloop.serving.async_engine import AsyncEngine, RequestSpec
from tokenloop.serving.core_client import CoreProcessClient
from tokenloop.serving.server import free_port

REPO = Path(__file__).resolve().parents[2]
OPTIONS: dict[str, Any] = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 4, "num_blocks": 512}


@pytest.fixture(scope="module")
def process_engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.with_core_process(build_engine_config(str(tiny_model_dir), **OPTIONS))
    yield engine
    engine.close()
    assert engine.client.process.exitcode == 0  # type: ignore[attr-defined]


@pytest.fixture
def thread_engine(tiny_checkpoint: Checkpoint) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(make_engine(tiny_checkpoint, **OPTIONS))
    yield engine
    engine.close()


def _run(engine: AsyncEngine, specs: list[RequestSpec]) -> dict[str, list[tuple[Any, ...]]]:
    """Submit `specs` as one unit (so both modes schedule them alike); every output as comparable data."""

    async def main() -> dict[str, list[tuple[Any, ...]]]:
        stream = await engine.add_requests(specs)
        seen: dict[str, list[tuple[Any, ...]]] = {s.request_id: [] for s in specs}
        async for output in stream:
            seen[output.request_id].append((output.finished, output.prompt_logprobs if output.finished else None, [
                (c.index, c.text_delta, c.token_ids_delta, c.logprobs_delta, c.finish_reason, c.stop_reason)
                for c in output.outputs]))
        return seen

    return asyncio.run(main())


def _texts(outputs: list[tuple[Any, ...]]) -> str:
    return "".join(c[1] for _, _, completions in outputs for c in completions)


def test_outputs_over_the_socket_equal_in_process(process_engine: AsyncEngine, thread_engine: AsyncEngine) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind="delta")
    probe = _run(thread_engine, [RequestSpec("probe", "the cat sat", greedy)])["probe"]
    text = _texts(probe)
    stop = text[5:9]  # inside the output, spanning token boundaries: held back across a delta
    assert len(stop) == 4 and text.find(stop) == 5
    specs = [
        RequestSpec("greedy", "the cat sat", greedy),
        RequestSpec("seeded", "hello world", SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)),
        RequestSpec("n3", "a b c", SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)),
        RequestSpec("logprobs", "x y", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                                                      prompt_logprobs=2)),
        RequestSpec("stop", "the cat sat", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                          stop=[stop], output_kind="delta")),
        RequestSpec("ids", None, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                    prompt_token_ids=[5, 6, 7, 8, 9]),
    ]
    expected = _run(thread_engine, specs)
    got = _run(process_engine, specs)
    assert got == expected
    stopped = got["stop"][-1][2][0]
    assert stopped[4:] == ("stop", stop) and _texts(got["stop"]) == text[:5]
    assert len(got["n3"][-1][2]) == 3 and got["logprobs"][-1][1] is not None


def test_abort_and_errors_over_the_socket(process_engine: AsyncEngine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def main() -> None:
        await process_engine.utility("inject_step_delay", SLOW_STEP_S)  # in flight when aborted, on any machine
        stream = await process_engine.add_requests([RequestSpec("long", "hello", long)])
        async for output in stream:
            if output.outputs[0].token_ids_delta:
                break
        stream.abort()
        with pytest.raises(InvalidRequestError) as bad:  # raised in the core, raised again here
            await process_engine.add_requests([RequestSpec("bad", None, long, prompt_token_ids=[10 ** 6])])
        assert bad.value.param == "prompt"
        deadline = time.monotonic() + 5
        while await process_engine.utility("idle") != [False, 0.0]:
            assert time.monotonic() < deadline, "the aborted request still holds blocks"
            await asyncio.sleep(0.01)
        assert not await process_engine.utility("holds_blocks", "long")
        stats = await process_engine.utility("stats")
        assert stats.num_running == 0 and stats.num_waiting == 0
        facts = await process_engine.utility("kv_facts")
        assert facts["free_blocks"] == facts["num_blocks"]
        with pytest.raises(TypeError):
            await process_engine.call(lambda e: e.num_steps)
        await process_engine.utility("inject_step_delay", 0.0)

    asyncio.run(main())
    counts = process_engine.counts()
    assert counts.finished.get("abort") == 1 and counts.rejected == 1


def test_a_core_that_cannot_start_says_why(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    config = build_engine_config(str(tmp_path), **OPTIONS)
    with pytest.raises((ModelLoadError, EngineStoppedError)) as failed:
        CoreProcessClient(config, startup_timeout_s=60)
    assert "engine core" in str(failed.value)


_ORPHAN = textwrap.dedent("""
    import os, sys
    from tokenloop.llm import build_engine_config
    from tokenloop.serving.core_client import CoreProcessClient
    if __name__ == "__main__":
        client = CoreProcessClient(build_engine_config(sys.argv[1], block_size=4, num_blocks=64))
        print(client.info.pid, flush=True)
        os._exit(0)  # no atexit: the core must notice on its own that its parent is gone
""")


def test_the_core_exits_when_its_parent_dies(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHAN)
    result = subprocess.run([sys.executable, str(script), str(tiny_model_dir)], capture_output=True, text=True,
                            check=True,
                            timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the orphaned engine core did not exit")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _core_pid(server_pid: int) -> int:
    """The engine core: the server's child (forked: the server's own command line; not multiprocessing's
    resource tracker)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.split(")")[-1].split()[1]) == server_pid and b"resource_tracker" not in cmdline:
            return int(entry)
    raise AssertionError("no engine core process found")


def serve_process(model_dir: Path, port: int, *flags: str) -> subprocess.Popen[str]:
    """`tokenloop serve` of the tiny model on 127.0.0.1:`port`, every step >= 50 ms (requests stay in flight
    for a fault on any machine)."""
    return subprocess.Popen([sys.executable, "-m", "tokenloop", "serve", "--model", str(model_dir), "--port", str(port),
                             "--host", "127.0.0.1", "--block-size", "4", "--num-kv-blocks", "256", "--log-level",
                             "warning", *flags], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), STEP_DELAY_ENV: str(SLOW_STEP_S)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def fault_mid_stream(url: str, model_dir: Path, fault: Callable[[], None]) -> tuple[list[str], float, httpx.Response]:
    """With a plain and a streamed 900-token request in flight, run `fault`; the stream's data payloads, the
    seconds it took to end after the fault, and the plain request's response."""
    body = {"model": str(model_dir), "prompt": "hello world", "max_tokens": 900, "ignore_eos": True}
    plain: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: plain.update(
        response=httpx.post(url + "/v1/completions", json=body, timeout=60)))
    waiter.start()
    deadline = time.monotonic() + 10
    while _metric(url, "tokenloop:num_requests_running") < 1:  # in flight before the fault
        assert time.monotonic() < deadline, "the plain request never started"
        time.sleep(0.02)
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "choices" in first
        fault()
        faulted = time.monotonic()
        payloads = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    took = time.monotonic() - faulted
    waiter.join(30)
    return payloads, took, plain["response"]


def assert_health_503(url: str) -> None:
    try:
        assert httpx.get(url + "/health", timeout=2).status_code == 503
    except httpx.HTTPError:
        pass  # already gone: as good as a 503 to a load balancer


def test_killing_the_core_fails_streams_at_once_and_the_server_exits_non_zero(tiny_model_dir: Path) -> None:
    port = free_port()
    process = serve_process(tiny_model_dir, port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, process)
        core = _core_pid(process.pid)
        payloads, took, plain = fault_mid_stream(url, tiny_model_dir, lambda: os.kill(core, signal.SIGKILL))
        assert took < 1.0, f"the stream took {took:.2f} s to end after the core died"
        assert payloads[-1] == "[DONE]"
        error = json.loads(payloads[-2])["error"]
        assert error["type"] == "server_error"
        assert "the engine core process died (exit code -9)" in error["message"]
        assert plain.status_code >= 500
        assert "engine core process died" in plain.json()["error"]["message"]
        assert_health_503(url)
        assert process.wait(timeout=30) == 3
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


_FRONT_END = textwrap.dedent("""
    import sys
    from tokenloop.cli.main import build_parser
    from tokenloop.cli.serve import _cluster_options
    from tokenloop.cli.options import _engine_options
    from tokenloop.config import build_engine_config
    from tokenloop.core.core_launch import start_core_process
    args = build_parser().parse_args(["serve"])
    _cluster_options(args), build_engine_config(args.model, **_engine_options(args))
    before_fork = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fastapi"))
    import tokenloop.serving.app, tokenloop.serving.async_engine, tokenloop.serving.core_client
    import tokenloop.observe.metrics, tokenloop.observe.tracer
    from tokenloop.model.loader import load_model_info
    load_model_info(sys.argv[1])
    print(before_fork, sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
""")


def test_the_server_front_end_never_imports_torch(tiny_model_dir: Path) -> None:
    """`tokenloop serve` forks its core with only the command line imported (the core imports torch, ~1.5 s,
    while the front end imports the web framework), and the front end itself never needs torch."""
    result = subprocess.run([sys.executable, "-c", _FRONT_END, str(tiny_model_dir)], capture_output=True, text=True,
                            check=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.stdout.split() == ["[]", "[]"], result.stdout


_FORKED = textwrap.dedent("""
    import asyncio, json, sys
    from tokenloop.config import build_engine_config
    from tokenloop.core.core_launch import start_core_process
    from tokenloop.request import SamplingParams
    from tokenloop.serving.async_engine import AsyncEngine, RequestSpec
    from tokenloop.serving.core_client import CoreProcessClient

    async def run(engine):
        specs = [RequestSpec(f"r{i}", [5 + i, 9, 17, 3], SamplingParams(max_tokens=8, temperature=0))
                 for i in range(3)]
        tokens = {s.request_id: [] for s in specs}
        async for output in await engine.add_requests(specs):
            for completion in output.outputs:
                tokens[output.request_id] += completion.token_ids_delta
        return tokens

    if __name__ == "__main__":
        config = build_engine_config(sys.argv[1], block_size=4, num_blocks=64)
        results = {}
        for method in ("fork", "spawn"):
            started = start_core_process(config, start_method=method)
            client = CoreProcessClient(config, started=started, wait=False)
            engine = AsyncEngine.with_core_process(config, client=client)
            results[method] = asyncio.run(run(engine))
            engine.close()
            results[method + " exit"] = client.process.exitcode
        print(json.dumps(results))
""")


def test_a_forked_core_serves_what_a_spawned_one_does(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "forked.py"
    script.write_text(_FORKED)
    result = subprocess.run([sys.executable, str(script), str(tiny_model_dir)], capture_output=True, text=True,
                            check=True, timeout=180, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    results = json.loads(result.stdout.splitlines()[-1])
    assert results["fork"] == results["spawn"]
    assert all(len(tokens) == 8 for tokens in results["fork"].values())
    assert results["fork exit"] == 0 and results["spawn exit"] == 0


def test_fork_falls_back_to_spawn_while_another_thread_runs(tiny_model_dir: Path) -> None:
    from tokenloop.core.core_launch import start_core_process

    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()
    try:
        started = start_core_process(build_engine_config(str(tiny_model_dir), **OPTIONS), start_method="fork")
    finally:
        stop.set()
    client = CoreProcessClient(build_engine_config(str(tiny_model_dir), **OPTIONS), started=started)
    try:
        assert type(started.process).__name__ == "SpawnProcess"
        assert client.info.pid == started.process.pid
    finally:
        client.close()
