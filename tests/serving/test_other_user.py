"""Issue 9, "another user": a victim's greedy stream runs while an attacker sends class-2 and class-3 inputs.

The victim must complete normally (finish_reason length, no error frame), with exactly the text it gets
when run alone (greedy on the tiny fp32 model is batch-invariant), and on time: in total, and with no
long pause between two of its chunks. While the attacker sends 2 MB of text to tokenize (and other
CPU-heavy requests), `/health` must answer within 100 ms (the issue's bound), measured here.

Besides the table of attacks: a stage that raises for one request past the edge (cache-salt hashing,
policy ranking) fails that request alone; a client that stops reading, a flood of bad requests, trace
exports and a burst past the queue leave the victim's output unchanged.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.conftest import TINY_PROMPTS
from tests.serving.conftest import MODEL, LiveServer, slow_steps
from tests.serving.hostile_util import (
    AUTH,
    JSON_HEADERS,
    MAX_WAITING,
    assert_error,
    dumps,
    engine_quiet,
    keyed_server,
)
from tokenloop.model.loader import Checkpoint

HEALTH_BOUND_S = 0.100  # the issue: /health answers within 100 ms while a 2 MB prompt is tokenized
# Rounds of an attack the latency bound may take. On 2 cores the engine's torch threads preempt the server's
# Python threads, and a GIL hold that cannot be split (json.loads or pydantic over 100k messages, ~40 ms) then
# stretches: single probes of 103-152 ms came in ~6% of attack rounds here and in one full CI run, with no
# hold over ~35 ms on those paths (measured apart). A stall in the server recurs in every round; that noise
# does not.
HEALTH_ROUNDS = 3
# The victim's longest wait between two chunks (alone: ~0.05-0.1 s here). Generous for a shared 2-core
# machine; one request that stalls the engine thread for a second (e.g. hashing megabytes of cache_salt
# per block) is what it catches.
MAX_GAP_S = 0.75
TWO_MB = "hello world " * (2_000_000 // 12 + 1)  # ~2 MB of text, ~1.3M tiny-model tokens
LONE = "\ud800"


def victim_body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": TINY_PROMPTS[2], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}


@dataclass
class VictimRun:
    status: int | None = None
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    done: bool = False
    elapsed_s: float = 0.0
    max_gap_s: float = 0.0
    exception: BaseException | None = None


def run_victim(url: str, body: dict[str, Any], started: threading.Event, run: VictimRun) -> None:
    """Stream `body` to the end on its own connection, recording text, finish reasons, errors, timing."""
    begin = time.monotonic()
    last = begin
    try:
        with httpx.Client(base_url=url, timeout=120.0) as client, \
                client.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
            run.status = response.status_code
            if response.status_code != 200:
                run.errors.append(response.read().decode(errors="replace")[:500])
                return
            for line in response.iter_lines():
                if not line:
                    continue
                now = time.monotonic()
                run.max_gap_s = max(run.max_gap_s, now - last)
                last = now
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    run.done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    run.errors.append(event["error"])
                    continue
                for choice in event["choices"]:
                    run.text += choice["text"]
                    if choice["finish_reason"] is not None:
                        run.finish_reasons.append(choice["finish_reason"])
                started.set()
    except BaseException as exc:  # noqa: BLE001 - reported by the test thread
        run.exception = exc
    finally:
        run.elapsed_s = time.monotonic() - begin
        started.set()


@dataclass
class Reference:
    text: str
    elapsed_s: float


class Victim:
    """A victim stream on a background thread; `wait()` joins and returns its run."""

    def __init__(self, live: LiveServer, max_tokens: int) -> None:
        self.run = VictimRun()
        self._started = threading.Event()
        args = (live.url, victim_body(max_tokens), self._started, self.run)
        self._thread = threading.Thread(target=run_victim, args=args, daemon=True)

    def start(self) -> Victim:
        self._thread.start()
        assert self._started.wait(60.0), "the victim never started streaming"
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float = 120.0) -> VictimRun:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the victim did not finish within {timeout_s} s"
        return self.run


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Checkpoint) -> Iterator[LiveServer]:
    with keyed_server(tiny_checkpoint) as server:
        yield server


@pytest.fixture(scope="module")
def references(live: LiveServer) -> dict[int, Reference]:
    """The victim alone, per length: its text and how long it took."""
    out = {}
    for max_tokens in (VICTIM_TOKENS, LONG_VICTIM_TOKENS):
        victim = Victim(live, max_tokens).start()
        run = victim.wait()
        assert run.exception is None and run.status == 200 and run.done and not run.errors, run
        assert run.finish_reasons == ["length"], run
        out[max_tokens] = Reference(run.text, run.elapsed_s)
        live.wait_idle()
    return out


VICTIM_TOKENS = 400
LONG_VICTIM_TOKENS = 900  # for attacks that take a while themselves (2 MB of text)


def assert_victim_unharmed(run: VictimRun, ref: Reference, what: str,
                           max_gap_s: float | None = MAX_GAP_S) -> None:
    assert run.exception is None, f"{what}: the victim's client failed: {run.exception!r}"
    assert run.status == 200, f"{what}: victim status {run.status}: {run.errors}"
    assert not run.errors, f"{what}: the victim got an error: {run.errors}"
    assert run.done and run.finish_reasons == ["length"], f"{what}: victim ended {run.finish_reasons}"
    assert run.text == ref.text, f"{what}: the victim's greedy output changed"
    # On time: a noisy shared machine, so generous; the stalls were 2.6 s and 33 s.
    bound = 3 * ref.elapsed_s + 3.0
    assert run.elapsed_s < bound, f"{what}: victim took {run.elapsed_s:.2f} s (alone {ref.elapsed_s:.2f} s)"
    assert max_gap_s is None or run.max_gap_s < max_gap_s, (
        f"{what}: the victim's stream stalled {run.max_gap_s:.2f} s between chunks "
        f"(total {run.elapsed_s:.2f} s, alone {ref.elapsed_s:.2f} s)")


# ---- attacks -------------------------------------------------------------------------------------------

def post(url: str, path: str, body: Any, timeout: float = 60.0) -> httpx.Response:
    content = body if isinstance(body, bytes) else dumps(body)
    with httpx.Client(base_url=url, timeout=timeout) as client:
        return client.post(path, content=content, headers={**AUTH, **JSON_HEADERS})


@dataclass
class Attack:
    id: str
    cls: int
    path: str
    body: Any
    status: int | tuple[int, ...] = 400
    param: Any = ...
    max_s: float = 30.0  # the attacker's own answer comes within this (no stall)
    probe_health: bool = False  # measure /health latency while this request is in flight
    victim_tokens: int = VICTIM_TOKENS


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello world", "max_tokens": 4, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


ATTACKS = [
    # class 2: fields that used to raise inside schedule() and fail every live request
    Attack("salt-lone-surrogate", 2, "/v1/completions", cmpl(cache_salt=LONE), param="cache_salt"),
    Attack("salt-lone-surrogate-chat-stream", 2, "/v1/chat/completions",
           chat(cache_salt=f"x{LONE}", stream=True), param="cache_salt"),
    Attack("salt-lone-surrogate-batched-n2", 2, "/v1/completions",
           cmpl(prompt=["a", "b"], n=2, cache_salt=LONE), param="cache_salt"),
    Attack("priority-beyond-float", 2, "/v1/completions", cmpl(priority=10**400), param="priority"),
    Attack("priority-2^63-chat", 2, "/v1/chat/completions", chat(priority=2**63), param="priority"),
    Attack("prompt-lone-surrogate", 2, "/v1/completions", cmpl(prompt=f"a{LONE}"), param="prompt"),
    Attack("seed-2^64", 2, "/v1/completions", cmpl(seed=2**64, temperature=1.0), param="seed"),
    Attack("logit-bias-nan", 2, "/v1/completions", cmpl(logit_bias={"5": float("nan")})),
    # class 3: unbounded work
    Attack("tokenize-2mb", 3, "/tokenize", {"model": MODEL, "prompt": TWO_MB}, status=200, probe_health=True,
           victim_tokens=LONG_VICTIM_TOKENS),
    Attack("tokenize-2mb-chat", 3, "/tokenize",
           {"model": MODEL, "messages": [{"role": "user", "content": TWO_MB}]}, status=200, probe_health=True,
           victim_tokens=LONG_VICTIM_TOKENS),
    Attack("chat-2mb-prompt", 3, "/v1/chat/completions", chat(messages=[{"role": "user", "content": TWO_MB}]),
           param="messages", probe_health=True, victim_tokens=LONG_VICTIM_TOKENS),
    Attack("completion-2mb-prompt", 3, "/v1/completions", cmpl(prompt=TWO_MB), param="prompt",
           probe_health=True, victim_tokens=LONG_VICTIM_TOKENS),
    Attack("chat-100k-messages", 3, "/v1/chat/completions",
           chat(messages=[{"role": "user", "content": "hi"}] * 100_000), param="messages", probe_health=True,
           victim_tokens=LONG_VICTIM_TOKENS),
    Attack("tokenize-100k-messages", 3, "/tokenize",
           {"messages": [{"role": "user", "content": "hi"}] * 100_000}, status=(200, 400), probe_health=True,
           victim_tokens=LONG_VICTIM_TOKENS),
    # A salt of megabytes is hashed into every block of the prompt, on the engine thread: a length limit
    # (400) or hashing it once keeps everyone else's stream flowing.
    Attack("salt-7mb-long-prompt", 3, "/v1/completions", cmpl(prompt=[5] * 1000, cache_salt="s" * 7_000_000),
           status=(200, 400), param="cache_salt", victim_tokens=LONG_VICTIM_TOKENS),
    # A legitimate but heavy answer (8 x 1,000 prompt tokens x 20 logprobs, ~3.5 MB): built off the loop.
    Attack("echo-logprobs-n8", 3, "/v1/completions",
           cmpl(prompt=[5] * 1000, max_tokens=20, echo=True, logprobs=20, n=MAX_WAITING), status=200,
           probe_health=True, victim_tokens=LONG_VICTIM_TOKENS),
    Attack("n-million", 3, "/v1/completions", cmpl(n=10**6), param="n", max_s=3.0),
    Attack("n-million-chat", 3, "/v1/chat/completions", chat(n=10**6, stream=True), param="n", max_s=3.0),
    Attack("n-over-max-waiting", 3, "/v1/completions", cmpl(n=MAX_WAITING + 1), param="n", max_s=3.0),
    Attack("stop-100k", 3, "/v1/completions", cmpl(stop=[f"s{i}" for i in range(100_000)]), param="stop",
           max_s=5.0),
    Attack("stop-100k-chat", 3, "/v1/chat/completions", chat(stop=["ab"] * 100_000), param="stop", max_s=5.0),
    Attack("stop-string-1mb", 3, "/v1/completions", cmpl(stop="z" * 1_000_000), param="stop", max_s=5.0),
    Attack("logit-bias-100k", 3, "/v1/completions", cmpl(logit_bias={str(i): 1 for i in range(100_000)}),
           param="logit_bias", max_s=5.0),
    Attack("prompt-ids-million", 3, "/v1/completions", cmpl(prompt=[5] * 1_000_000), param="prompt",
           max_s=10.0),
]


def probe_health_while(url: str, busy: threading.Thread) -> list[float]:
    """`/health` latencies, one probe every 20 ms, for as long as `busy` runs (at least one probe).

    Each counts from when the probe was due, not from when its thread got to send it: the server shares this
    process's GIL, so a stall that holds the GIL holds this thread too, and timed from the send it would not
    show (it did not: a 0.2 s hold in /tokenize went unseen)."""
    latencies = []
    with httpx.Client(base_url=url, timeout=10.0) as client:
        client.get("/health")  # the connection is open before we measure
        due = time.perf_counter()
        while True:
            r = client.get("/health")
            latencies.append(time.perf_counter() - due)
            assert r.status_code == 200, r.text
            if not busy.is_alive():
                break
            due = time.perf_counter() + 0.02
            time.sleep(0.02)
    return latencies


def attack_beside_a_victim(live: LiveServer, references: dict[int, Reference], attack: Attack) -> list[float]:
    """One round: a victim streams while `attack` is sent; every check on the answers and on the victim, and
    the /health latencies measured meanwhile (none unless the attack probes them)."""
    content = dumps(attack.body)  # encoded before the clock starts: the client's own work is not measured
    victim = Victim(live, attack.victim_tokens).start()
    assert live.on_engine(lambda e: e.has_unfinished_requests()), "the victim finished before the attack"
    result: dict[str, Any] = {}

    def attack_once() -> None:
        begin = time.monotonic()
        try:
            result["response"] = post(live.url, attack.path, content, timeout=max(60.0, attack.max_s))
        except BaseException as exc:  # noqa: BLE001
            result["exception"] = exc
        result["elapsed"] = time.monotonic() - begin

    attacker = threading.Thread(target=attack_once, daemon=True)
    attacker.start()
    latencies = probe_health_while(live.url, attacker) if attack.probe_health else []
    attacker.join(120.0)
    assert not attacker.is_alive(), "the attack got no answer"
    run = victim.wait()

    assert "exception" not in result, f"the attacker's request failed: {result.get('exception')!r}"
    response: httpx.Response = result["response"]
    if response.status_code == 200 and response.status_code in (
            attack.status if isinstance(attack.status, tuple) else (attack.status,)):
        assert "error" not in response.json(), response.text[:500]
    else:
        assert_error(response, attack.status, param=attack.param)
    assert result["elapsed"] < attack.max_s, f"the attack took {result['elapsed']:.2f} s to answer"
    assert_victim_unharmed(run, references[attack.victim_tokens], attack.id)
    engine_quiet(live)
    return latencies


def health_problem(latencies: list[float]) -> str | None:
    """Why these /health latencies break the bound, or None."""
    ranked = sorted(latencies)
    if ranked[-1] < HEALTH_BOUND_S:
        return None
    return (f"/health took {ranked[-1] * 1000:.0f} ms during the attack ({len(ranked)} probes, median "
            f"{ranked[len(ranked) // 2] * 1000:.0f} ms)")


@pytest.mark.parametrize("attack", ATTACKS, ids=[f"c{a.cls}-{a.id}" for a in ATTACKS])
def test_victim_unharmed(live: LiveServer, references: dict[int, Reference], attack: Attack) -> None:
    problems = []
    for _ in range(HEALTH_ROUNDS):  # every round passes every other check; the latency bound needs one round
        latencies = attack_beside_a_victim(live, references, attack)
        problem = health_problem(latencies) if latencies else None
        if problem is None:
            return
        problems.append(problem)
    pytest.fail(f"in each of {HEALTH_ROUNDS} rounds: " + "; ".join(problems))


def test_stalled_reader_does_not_hurt_the_victim(live: LiveServer, references: dict[int, Reference]) -> None:
    """Class 6: a client that stops reading its stream: the victim is unaffected, and nothing leaks after."""
    body = {"model": MODEL, "prompt": "stall", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=60.0) as stalled, \
            stalled.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # read one line, then never again
        victim = Victim(live, VICTIM_TOKENS).start()
        run = victim.wait()
        assert_victim_unharmed(run, references[VICTIM_TOKENS], "stalled reader")
    engine_quiet(live)


def test_flood_of_bad_requests_in_parallel(live: LiveServer, references: dict[int, Reference]) -> None:
    """Many hostile requests at once (8 threads) while the victim streams: all 4xx, the victim unharmed."""
    bodies: list[tuple[str, Any]] = [
        ("/v1/completions", cmpl(cache_salt=LONE)), ("/v1/completions", cmpl(priority=10**400)),
        ("/v1/chat/completions", chat(n=10**6)), ("/v1/completions", cmpl(stop=["x"] * 10_000)),
        ("/v1/completions", cmpl(temperature=float("inf"))), ("/v1/chat/completions", chat(seed=2**64)),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000), ("/tokenize", {"prompt": LONE}),
    ] * 4
    victim = Victim(live, LONG_VICTIM_TOKENS).start()
    statuses: list[int] = []
    lock = threading.Lock()

    def worker(items: list[tuple[str, Any]]) -> None:
        for path, body in items:
            r = post(live.url, path, body)
            with lock:
                statuses.append(r.status_code)

    threads = [threading.Thread(target=worker, args=(bodies[i::8],), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120.0)
    run = victim.wait()
    assert len(statuses) == len(bodies) and all(400 <= s < 500 for s in statuses), statuses
    assert_victim_unharmed(run, references[LONG_VICTIM_TOKENS], "flood")
    engine_quiet(live)




# ---- class 2 beyond the edge: a stage that raises for one request (valid at the edge) ---------------------

FAULT_TEXT = "injected-fault-text"


def _read_all(url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    with httpx.Client(base_url=url, timeout=60.0) as client:
        r = client.post(path, content=dumps(body), headers={**AUTH, **JSON_HEADERS})
        return r.status_code, r.text


def _assert_failed_alone(status: int, text: str, stream: bool) -> None:
    """The attacker's request failed, with a generic error carrying no exception text and no victim data."""
    assert FAULT_TEXT not in text and TINY_PROMPTS[2] not in text, text[:500]
    if stream:
        assert status == 200, text[:300]
        events = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        failed = any("error" in e for e in events) or any(
            c.get("finish_reason") == "error" for e in events for c in e.get("choices", []))
        assert failed, f"the failing request did not end with an error: {text[:500]}"
    else:
        assert status == 500, text[:300]
        error = json.loads(text)["error"]
        assert error["type"] == "server_error", error


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_hashing_fault_fails_only_its_request(live: LiveServer, references: dict[int, Reference],
                                              stream: bool) -> None:
    """A cache_salt whose hashing raises (as a lone surrogate did): only that request fails."""
    from tokenloop.core import kv_cache

    original = kv_cache.hash_block

    def hostile_hash(parent: Any, token_ids: Any, cache_salt: str | None = None) -> int:
        if cache_salt == "boom-salt":
            raise UnicodeEncodeError("utf-8", FAULT_TEXT, 0, 1, "surrogates not allowed")
        return original(parent, token_ids, cache_salt)

    victim = Victim(live, VICTIM_TOKENS).start()
    kv_cache.hash_block = hostile_hash
    try:
        status, text = _read_all(live.url, "/v1/completions",
                                 cmpl(prompt="a prompt of a few blocks at least", cache_salt="boom-salt",
                                      stream=stream))
    finally:
        kv_cache.hash_block = original
    run = victim.wait()
    _assert_failed_alone(status, text, stream)
    assert_victim_unharmed(run, references[VICTIM_TOKENS], "hash fault")
    engine_quiet(live)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_ranking_fault_fails_only_its_request(live: LiveServer, references: dict[int, Reference],
                                              stream: bool) -> None:
    """A priority the policy cannot rank (as a huge integer did under --policy priority): only it fails."""
    policy = live.on_engine(lambda e: e.scheduler.policy)
    if not hasattr(policy, "effective_priority"):
        pytest.skip("the server does not run the priority policy")
    original = policy.effective_priority

    def hostile_rank(request: Any, now: int) -> float:
        if request.priority == 777:
            raise OverflowError(FAULT_TEXT)
        return original(request, now)

    victim = Victim(live, VICTIM_TOKENS).start()
    live.on_engine(lambda e: setattr(e.scheduler.policy, "effective_priority", hostile_rank))
    try:
        status, text = _read_all(live.url, "/v1/chat/completions", chat(priority=777, stream=stream))
    finally:
        live.on_engine(lambda e: delattr(e.scheduler.policy, "effective_priority"))
    run = victim.wait()
    _assert_failed_alone(status, text, stream)
    assert_victim_unharmed(run, references[VICTIM_TOKENS], "ranking fault")
    engine_quiet(live)


def test_trace_exports_do_not_stall_the_engine(live: LiveServer, references: dict[int, Reference]) -> None:
    """Class 6: exporting all traces and polling the dashboard (10 a second) while the victim streams.

    The exports are built outside the lock the engine thread takes every step, so the victim's stream
    keeps flowing (one export thread with pauses: a GIL share, not a lock, is all it may cost).
    """
    victim = Victim(live, LONG_VICTIM_TOKENS).start()
    statuses: list[int] = []
    slowest = [0.0]

    def poll() -> None:
        with httpx.Client(base_url=live.url, timeout=60.0) as client:
            while victim.running:
                for path in ("/v1/trace", "/v1/dashboard/state"):
                    begin = time.monotonic()
                    statuses.append(client.get(path, headers=AUTH).status_code)
                    slowest[0] = max(slowest[0], time.monotonic() - begin)
                    time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    run = victim.wait()
    poller.join(60.0)
    assert statuses and all(s == 200 for s in statuses), statuses[:20]
    assert_victim_unharmed(run, references[LONG_VICTIM_TOKENS], f"trace exports (slowest {slowest[0]:.2f} s)")
    engine_quiet(live)


def test_burst_past_the_queue_is_429_not_400(live: LiveServer, references: dict[int, Reference]) -> None:
    """Many valid requests at once: those past --max-waiting get a retryable 429 (with Retry-After), the
    rest complete; what can fit later is not a 400. The victim is unharmed and nothing leaks."""
    victim = Victim(live, LONG_VICTIM_TOKENS).start()
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        r = post(live.url, "/v1/completions", cmpl(max_tokens=200, ignore_eos=True))
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(40)]
    # Until the queue has overflowed, every step is slowed: 16 running requests of 200 tokens then outlast the
    # burst's arrival on any machine (on a fast one they could all finish before the 25th arrives).
    with slow_steps(live.async_engine, 0.05):
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            with lock:
                if any(r.status_code == 429 for r in results):
                    break
            time.sleep(0.01)
    for t in threads:
        t.join(120.0)
    run = victim.wait()
    statuses = sorted(r.status_code for r in results)
    assert len(results) == 40 and set(statuses) <= {200, 429}, statuses
    for r in results:
        if r.status_code == 429:
            assert_error(r, 429, type_="rate_limit_error", names_field=False)
            assert int(r.headers["Retry-After"]) >= 1
    assert 200 in statuses and 429 in statuses, statuses
    # 40 client threads share this process (and its GIL) with the server: no stall bound here.
    assert_victim_unharmed(run, references[LONG_VICTIM_TOKENS], "burst", max_gap_s=None)
    engine_quiet(live)
