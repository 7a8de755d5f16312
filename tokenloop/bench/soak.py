"""Soak test: many mixed requests, random client disconnects, a KV pool too small for the load.

    python -m tokenloop.bench.soak --num-requests 1000 --disconnect-fraction 0.3 --num-kv-blocks 64 \
        --hostile-fraction 0.05 --fault-fraction 0.02

With `--hostile-fraction`, that share of the clients send malformed or hostile bodies (each must get a
4xx, never a 5xx); with `--fault-fraction` (in-process only), that share carry a marker that makes the
model forward raise whenever they are in a batch: each of them must fail alone (a 500 or an error
frame), and every other request must finish normally: a failure that reaches an unmarked request is a
collateral failure, and the run fails.

Requests mix streaming and not, chat and completions, n=1/2, logprobs, stop strings, seeds and a shared
system prompt (prefix-cache hits). A fraction of clients go away mid-request. At the end it checks:

- no KV block is referenced (and the block pool's invariants hold),
- every accepted request ended with a reason (accepted == finished, nothing left live),
- no engine error (no failed step, no request finished with 'error', no HTTP 5xx, no error frame),
- every client that stayed got a well-formed answer (finish_reason stop/length, [DONE] on streams).

By default it serves the model in-process (a uvicorn thread on 127.0.0.1); with --url it drives an
external server and checks what /metrics shows instead. Exit status 1 on any violation.

Long module: one soak run: each request's plan, the checks of its answer, and the runs against an
in-process or an external server, all over one `SoakConfig` and one `SoakReport`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenloop.model.loader import DEFAULT_MODEL

SYSTEM_PROMPT = ("You are a concise assistant for a small serving engine. Answer in one or two sentences, "
                 "and never repeat the question back to the user.")
TOPICS = ["the capital of France", "how a paged KV cache works", "why the sky is blue", "prime numbers",
          "a haiku about autumn", "the rules of chess", "continuous batching", "photosynthesis",
          "the history of the printing press", "how to boil an egg", "black holes", "the Fibonacci sequence"]


@dataclass
class SoakConfig:
    """What to run, and against what."""

    num_requests: int = 200
    disconnect_fraction: float = 0.3
    concurrency: int = 32
    max_tokens: int = 32
    seed: int = 0
    url: str | None = None  # an external server; None: serve `model` in-process
    model: str = DEFAULT_MODEL
    num_kv_blocks: int = 64
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    policy: str = "fcfs"
    idle_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    hostile_fraction: float = 0.0
    fault_fraction: float = 0.0  # in-process only: requests whose forward is made to raise


@dataclass
class SoakReport:
    """Outcome counts, engine-side facts, and the list of violated invariants (empty = pass)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    elapsed_s: float = 0.0
    completion_tokens: int = 0
    engine: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)  # well-behaved requests that completed

    def latency_quantile(self, q: float) -> float | None:
        if not self.latencies_s:
            return None
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        generated = self.engine.get("generated_tokens")
        rate = (f"{generated:.0f} tokens generated, {generated / max(self.elapsed_s, 1e-9):.1f} tok/s"
                if generated is not None else f"{self.completion_tokens} completion tokens reported in usage")
        lines = [f"soak: {sum(self.outcomes.values())} requests in {self.elapsed_s:.1f} s ({rate})",
                 "  outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(self.outcomes.items())),
                 "  finish reasons: " + ", ".join(f"{k}={v}" for k, v in sorted(self.finish_reasons.items()))]
        p50, p99 = self.latency_quantile(0.5), self.latency_quantile(0.99)
        if p50 is not None and p99 is not None:
            lines.append(f"  well-behaved requests that completed: {len(self.latencies_s)}, latency p50 "
                         f"{p50:.2f} s, p99 {p99:.2f} s")
        if self.engine:
            lines.append("  engine: " + ", ".join(f"{k}={v}" for k, v in self.engine.items()))
        lines.append("  result: " + ("PASS" if self.ok else "FAIL"))
        lines.extend(f"  violation: {v}" for v in self.violations)
        return "\n".join(lines)


@dataclass
class _Plan:
    """One client request, drawn at random."""

    chat: bool
    stream: bool
    body: dict[str, Any]
    disconnect_after: int | None  # streams: frames read before leaving; None = stay to the end
    disconnect_timeout_s: float | None  # non-streaming: give up after this long; None = stay
    hostile: tuple[str, bytes, str] | None = None  # (name, raw body, content type): must get a 4xx
    faulty: bool = False  # carries the fault marker: must fail alone


FAULT_MARKER = "soak-fault-injection"

_DEEP = b'{"prompt": "x", "max_tokens": 1, "logit_bias": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
# (name, raw body, content type, chat?) of the hostile clients: each must get a 4xx and hurt no one else.
HOSTILE_BODIES: list[tuple[str, bytes, str, bool]] = [
    ("lone surrogate cache_salt", b'{"prompt": "hi", "max_tokens": 4, "cache_salt": "\\ud800"}', "application/json",
     False),
    ("lone surrogate in a message", b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "application/json",
     True),
    ("n = 10^6", b'{"prompt": "hi", "max_tokens": 1, "n": 1000000}', "application/json", False),
    ("max_tokens = 10^12", b'{"prompt": "hi", "max_tokens": 1000000000000}', "application/json", False),
    ("NaN temperature", b'{"prompt": "hi", "temperature": NaN}', "application/json", False),
    ("Infinity repetition_penalty", b'{"prompt": "hi", "repetition_penalty": Infinity}', "application/json", False),
    ("NaN logit_bias", b'{"prompt": "hi", "logit_bias": {"5": NaN}}', "application/json", False),
    ("seed 2^64", b'{"prompt": "hi", "seed": 18446744073709551616}', "application/json", False),
    ("priority 10^400", b'{"prompt": "hi", "priority": 1' + b"0" * 400 + b"}", "application/json", False),
    ("10,000 stop strings", json.dumps({"prompt": "hi", "stop": [f"s{i}" for i in range(10_000)]}).encode(),
     "application/json", False),
    ("JSON nested 100,000 deep", _DEEP, "application/json", False),
    ("not JSON", b"{'prompt': 'hi'", "application/json", False),
    ("wrong content type", b"prompt=hi", "application/x-www-form-urlencoded", False),
    ("empty body", b"", "application/json", True),
    ("reserved chat_template_kwargs", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"chat_template_kwargs": {"messages": []}}', "application/json", True),
    ("unknown role", b'{"messages": [{"role": "root", "content": "hi"}]}', "application/json", True),
    ("body over the size limit", b'{"prompt": "' + b"x" * (9 * 2 ** 20) + b'"}', "application/json", False),
]


def _plan(rng: random.Random, config: SoakConfig, index: int) -> _Plan:
    if rng.random() < config.hostile_fraction:
        name, raw, content_type, chat = rng.choice(HOSTILE_BODIES)
        return _Plan(chat, False, {}, None, None, hostile=(name, raw, content_type))
    faulty = rng.random() < config.fault_fraction
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    topic = rng.choice(TOPICS)
    body: dict[str, Any] = {"max_tokens": rng.randint(max(1, config.max_tokens // 4), config.max_tokens),
                            "temperature": rng.choice([0.0, 0.7, 1.0]), "user": f"user-{index % 7}"}
    if rng.random() < 0.2:
        body["n"] = 2
    if rng.random() < 0.2:
        body["seed"] = rng.randint(0, 10_000)
    if rng.random() < 0.15:
        body["stop"] = [rng.choice([".", "\n", " the"])]
    if chat:
        body["messages"] = [{"role": "system", "content": SYSTEM_PROMPT},
                            {"role": "user", "content": f"Tell me about {topic}. (#{index})"}]
        if rng.random() < 0.2:
            body.update(logprobs=True, top_logprobs=2)
    else:
        body["prompt"] = f"{SYSTEM_PROMPT}\nQuestion {index}: tell me about {topic}.\nAnswer:"
        if rng.random() < 0.2:
            body["logprobs"] = 2
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if faulty:
        body["user"] = FAULT_MARKER
    leaves = rng.random() < config.disconnect_fraction and not faulty
    return _Plan(chat, stream, body, rng.randint(0, 4) if leaves and stream else None,
                 rng.uniform(0.05, 1.0) if leaves and not stream else None, faulty=faulty)


async def _run_hostile(client: httpx.AsyncClient, path: str, plan: _Plan, report: SoakReport) -> None:
    name, raw, content_type = plan.hostile  # type: ignore[misc]
    r = await client.post(path, content=raw, headers={"content-type": content_type})
    if 400 <= r.status_code < 500:
        report.outcomes[f"rejected_{r.status_code}"] += 1
        return
    report.outcomes[f"hostile_http_{r.status_code}"] += 1
    report.violations.append(f"hostile request {name!r}: HTTP {r.status_code} (wanted a 4xx): {r.text[:200]}")


async def _run_one(client: httpx.AsyncClient, plan: _Plan, report: SoakReport) -> None:
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    n = plan.body.get("n", 1)
    began = time.monotonic()
    try:
        if plan.hostile is not None:
            await _run_hostile(client, path, plan, report)
            return
        if plan.stream:
            completed = await _run_stream(client, path, plan, n, report)
        else:
            timeout = plan.disconnect_timeout_s
            try:
                wait = timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT
                r = await client.post(path, json=plan.body, timeout=wait)
            except httpx.TimeoutException:
                if timeout is None:
                    raise
                report.outcomes["disconnected"] += 1
                return
            completed = _check_plain(r, n, report, plan.faulty)
        if completed:
            report.latencies_s.append(time.monotonic() - began)
    except httpx.HTTPError as exc:
        report.outcomes["client_error"] += 1
        report.violations.append(f"{path}: transport error {type(exc).__name__}: {exc}")


def _check_plain(r: httpx.Response, n: int, report: SoakReport, faulty: bool = False) -> bool:
    if r.status_code == 429:
        report.outcomes["rejected_429"] += 1
        return False
    if faulty:  # it must have failed, alone, with a 500 that names nobody's data
        if r.status_code == 500 and r.json()["error"]["type"] == "server_error":
            report.outcomes["failed_by_injected_fault"] += 1
        else:
            report.violations.append(f"a request with an injected fault got HTTP {r.status_code}: {r.text[:200]}")
        return False
    if r.status_code != 200:
        report.outcomes[f"http_{r.status_code}"] += 1
        report.violations.append(f"HTTP {r.status_code}: {r.text[:200]}")
        return False
    body = r.json()
    reasons = [c["finish_reason"] for c in body["choices"]]
    report.finish_reasons.update(reasons)
    report.completion_tokens += body["usage"]["completion_tokens"]
    if len(reasons) != n or any(reason not in ("stop", "length") for reason in reasons):
        report.violations.append(f"bad finish reasons {reasons} for n={n}")
    report.outcomes["completed"] += 1
    return True


async def _run_stream(client: httpx.AsyncClient, path: str, plan: _Plan, n: int, report: SoakReport) -> bool:
    async with client.stream("POST", path, json=plan.body) as r:
        if r.status_code != 200:
            await r.aread()
            return _check_plain(r, n, report, plan.faulty)
        frames = 0
        done = False
        finished: dict[int, str] = {}
        async for line in r.aiter_lines():
            if not line:
                continue
            if plan.disconnect_after is not None and frames >= plan.disconnect_after:
                report.outcomes["disconnected"] += 1
                return False  # leaving the block closes the connection mid-stream
            frames += 1
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                if plan.faulty:
                    report.outcomes["failed_by_injected_fault"] += 1
                else:
                    report.outcomes["collateral_failure"] += 1
                    report.violations.append(f"error frame: {chunk['error']}")
                return False
            for choice in chunk["choices"]:
                if choice.get("finish_reason"):
                    finished[choice["index"]] = choice["finish_reason"]
            if chunk.get("usage"):
                report.completion_tokens += chunk["usage"]["completion_tokens"]
    report.finish_reasons.update(finished.values())
    if plan.faulty:
        report.violations.append(f"a stream with an injected fault finished normally: {finished}")
        return False
    if not done or len(finished) != n or any(v not in ("stop", "length") for v in finished.values()):
        report.violations.append(f"stream ended badly: done={done}, finish reasons={finished}, n={n}")
        return False
    report.outcomes["completed"] += 1
    return True


async def _drive(config: SoakConfig, url: str, report: SoakReport) -> None:
    rng = random.Random(config.seed)
    plans = [_plan(rng, config, i) for i in range(config.num_requests)]
    limit = asyncio.Semaphore(config.concurrency)
    transport = httpx.AsyncHTTPTransport(retries=0)
    limits = httpx.Limits(max_connections=config.concurrency + 8, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=config.request_timeout_s, transport=transport,
                                 limits=limits) as client:

        async def one(plan: _Plan) -> None:
            async with limit:
                await _run_one(client, plan, report)

        await asyncio.gather(*(one(p) for p in plans))


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _check_external(url: str, config: SoakConfig, report: SoakReport) -> None:
    deadline = time.monotonic() + config.idle_timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        running = _metric(text, "tokenloop:num_requests_running") + _metric(text, "tokenloop:num_requests_waiting")
        usage = _metric(text, "tokenloop:kv_cache_usage_perc")
        if (running == 0 and usage == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    report.engine = {"running+waiting": running, "kv_cache_usage_perc": usage,
                     "generated_tokens": _metric(text, "tokenloop:generation_tokens_total"),
                     "preemptions": _metric(text, "tokenloop:num_preemptions_total"),
                     "errors": _metric(text, 'tokenloop:request_success_total{finished_reason="error"')}
    if running:
        report.violations.append(f"{running:.0f} request(s) still running or waiting after the run")
    if usage:
        report.violations.append(f"KV blocks still referenced after the run: usage {usage}")


def _serve_in_process(config: SoakConfig) -> Any:
    from tokenloop.engine import LLMEngine
    from tokenloop.llm import build_engine_config
    from tokenloop.serving.app import create_app
    from tokenloop.serving.server import ServerThread

    options: dict[str, Any] = {"num_blocks": config.num_kv_blocks, "policy": config.policy}
    for key in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(config, key) is not None:
            options[key] = getattr(config, key)
    engine = LLMEngine(build_engine_config(config.model, **options))
    if config.fault_fraction > 0:
        _inject_forward_faults(engine)
    app = create_app(engine, served_model_name=config.model)
    return ServerThread(app, log_level="critical").start()


def _inject_forward_faults(engine: Any) -> None:
    """Make the model forward raise for every batch holding a request of the fault-marked user."""
    execute = engine.runner.execute

    def faulty_execute(schedule: Any) -> Any:
        if any(item.request.user == FAULT_MARKER for item in schedule.scheduled):
            raise RuntimeError("soak: injected forward fault")
        return execute(schedule)

    engine.runner.execute = faulty_execute


def _check_in_process(server: Any, config: SoakConfig, report: SoakReport) -> None:
    async_engine = server.app.state.async_engine
    deadline = time.monotonic() + config.idle_timeout_s

    while True:
        try:
            # Raises if refcounts and the free queue disagree (in the core, wherever it runs).
            current = async_engine.utility_blocking("kv_facts")
        except Exception as exc:  # noqa: BLE001 - an invariant failure is a finding, not a crash
            report.violations.append(f"KV cache invariants broken: {exc}")
            return
        if (current["unfinished"] == 0 and current["kv_usage"] == 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    counts = async_engine.counts()
    generated = _metric(server.app.state.metrics.render().decode(), "tokenloop:generation_tokens_total")
    report.engine = {**current, "accepted": counts.accepted, "finished": dict(sorted(counts.finished.items())),
                     "step_failures": counts.step_failures, "generated_tokens": generated}
    if current["kv_usage"] != 0.0 or current["free_blocks"] != current["num_blocks"]:
        report.violations.append(f"{current['num_blocks'] - current['free_blocks']} KV block(s) still referenced")
    if current["unfinished"] or async_engine.num_live_requests:
        report.violations.append(f"{current['unfinished']} request(s) never ended")
    if counts.accepted != counts.num_finished:
        report.violations.append(f"accepted {counts.accepted} requests but {counts.num_finished} ended with a reason")
    errors = counts.finished.get("error", 0)
    report.engine["errored_requests"] = errors
    if counts.step_failures:
        report.violations.append(f"{counts.step_failures} engine step(s) failed as a whole")
    if config.fault_fraction == 0 and errors:
        report.violations.append(f"{errors} request(s) finished with 'error'")


def run_soak(config: SoakConfig) -> SoakReport:
    """Run the soak and return its report (`report.ok` is the verdict)."""
    report = SoakReport()
    server = None if config.url else _serve_in_process(config)
    url = config.url or server.url
    try:
        begin = time.monotonic()
        asyncio.run(_drive(config, url, report))
        report.elapsed_s = time.monotonic() - begin
        if server is None:
            _check_external(url, config, report)
        else:
            _check_in_process(server, config, report)
    finally:
        if server is not None:
            server.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenloop.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=SoakConfig.num_requests)
    parser.add_argument("--disconnect-fraction", type=float, default=SoakConfig.disconnect_fraction)
    parser.add_argument("--concurrency", type=int, default=SoakConfig.concurrency)
    parser.add_argument("--max-tokens", type=int, default=SoakConfig.max_tokens)
    parser.add_argument("--seed", type=int, default=SoakConfig.seed)
    parser.add_argument("--url", help="drive an external server instead of serving in-process")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-kv-blocks", type=int, default=SoakConfig.num_kv_blocks)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--policy", default="fcfs", choices=["fcfs", "priority", "sjf", "fair"])
    parser.add_argument("--hostile-fraction", type=float, default=0.0,
                        help="share of clients that send malformed or hostile bodies (each must get a 4xx)")
    parser.add_argument("--fault-fraction", type=float, default=0.0,
                        help="share of requests whose model forward is made to raise (in-process only)")
    args = parser.parse_args(argv)
    if args.fault_fraction and args.url:
        parser.error("--fault-fraction injects faults into an in-process engine: it cannot be used with --url")
    config = SoakConfig(num_requests=args.num_requests, disconnect_fraction=args.disconnect_fraction,
                        concurrency=args.concurrency, max_tokens=args.max_tokens, seed=args.seed, url=args.url,
                        model=args.model, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        policy=args.policy, hostile_fraction=args.hostile_fraction,
                        fault_fraction=args.fault_fraction)
    if config.fault_fraction:  # each injected fault is logged with its traceback: keep the output readable
        logging.getLogger("tokenloop").setLevel(logging.CRITICAL)
    report = run_soak(config)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
