"""The door's grammar check: each new constraint is compiled once in a worker process, under a time budget.

A constraint is text that a native library (llguidance) turns into automata. Its own fuel limits bound most
of that work, not all of it: measured here, the first mask of `a{1000000}` took 4 s, `(a{1000}){1000}` 12 s,
a GBNF of 10,000 chained rules more than a minute, and ~1,000 nested `$ref`s crashed the process (SIGSEGV).
So before a request is accepted its spec is compiled in a child process of the API server:

    checker = GrammarChecker(tokenizer_json, vocab_size, eos_token_ids, timeout_s=3.0)
    checker.check(spec)   # returns, or raises InvalidRequestError naming spec.field (never blocks the loop:
                          # call it from a worker thread)

- past `timeout_s` the child is killed and the request gets a 400 saying the constraint is too costly;
- if the child dies (a native crash) the request gets a 400 saying so; the next check starts a new child;
- a spec's verdict is cached by its key (sha256 of the constraint), accepted and refused alike, so a
  repeated hostile spec costs nothing and a repeated good one is not compiled again here.

The engine core then builds the same grammar with the same code (`tokenloop.structured.grammar`), on a
thread of its own: it never sees a spec the door did not compile within the budget.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import random
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from tokenloop.errors import CapacityError, InvalidRequestError
from tokenloop.structured.spec import StructuredOutputsParams

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # importing llguidance and building its tokenizer: ~0.5 s, more on a busy machine


@dataclass(frozen=True)
class _Verdict:
    """A check's outcome for one key: None if the spec compiled, else the 400's message."""

    problem: str | None


class _Worker:
    """One child process that compiles specs sent over a pipe, one at a time."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        context = multiprocessing.get_context("spawn")  # never fork a server with threads
        self.conn, child_end = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=_serve, args=(child_end, tokenizer_json, vocab_size, list(eos_token_ids)),
            name="tokenloop-grammar-check", daemon=True)
        self.process.start()
        child_end.close()
        if not self.conn.poll(_STARTUP_TIMEOUT_S) or self.conn.recv() != "ready":
            self.kill()
            raise RuntimeError("the grammar-check worker did not start")

    def compile(self, spec: StructuredOutputsParams, timeout_s: float) -> _Verdict:
        self.conn.send(spec)
        if not self.conn.poll(timeout_s):
            self.kill()
            return _Verdict(f"{spec.field}: this {spec.kind} takes longer than {timeout_s:g} s to compile; "
                            "simplify it (fewer or smaller repetitions, rules or alternatives)")
        try:
            problem = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            code = self.process.exitcode
            logger.warning("the grammar-check worker died (exit code %s) compiling a %s", code, spec.kind)
            return _Verdict(f"{spec.field}: the grammar compiler crashed on this {spec.kind} (exit code "
                            f"{code}); simplify it (less nesting, fewer $ref levels)")
        return _Verdict(problem)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class GrammarChecker:
    """Compiles specs in up to `workers` child processes within `timeout_s` each; thread-safe.

    A check waits at most `timeout_s` for a free worker, then gets a 429 (CapacityError): a burst of costly
    specs cannot queue the door up without bound.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int], *,
                 timeout_s: float = 3.0, workers: int = 2, cache_size: int = 4096) -> None:
        self.timeout_s = timeout_s
        self._worker_args = (tokenizer_json, vocab_size, tuple(eos_token_ids))
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)  # a slot; its worker starts on first use
        self._verdicts: OrderedDict[str, _Verdict] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._closed = False
        self.num_compiled = 0  # specs compiled here (not answered from the cache)

    def check(self, spec: StructuredOutputsParams) -> None:
        """Return if `spec` compiles within the budget; raise InvalidRequestError naming its field if not."""
        key = spec.key()
        verdict = self._cached(key)
        if verdict is None:
            verdict = self._compile(spec)
            with self._lock:
                self._verdicts[key] = verdict
                while len(self._verdicts) > self._cache_size:
                    self._verdicts.popitem(last=False)
        if verdict.problem is not None:
            raise InvalidRequestError(verdict.problem, param=spec.field)

    def close(self) -> None:
        """Stop every worker (idle ones now; busy ones as they come back)."""
        self._closed = True
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()

    def _cached(self, key: str) -> _Verdict | None:
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
            return verdict

    def _compile(self, spec: StructuredOutputsParams) -> _Verdict:
        try:
            worker = self._idle.get(timeout=self.timeout_s)
        except queue.Empty:
            raise CapacityError("every grammar compiler is busy with other requests' constraints; retry",
                                retry_after_s=self.timeout_s) from None
        try:
            if worker is None or not worker.alive:
                worker = _Worker(*self._worker_args)
            self.num_compiled += 1
            verdict = worker.compile(spec, self.timeout_s)
            if not worker.alive:
                worker = None  # killed past its budget, or crashed: the next check starts another
            return verdict
        except BaseException:
            if worker is not None:
                worker.kill()
            worker = None
            raise
        finally:
            if self._closed and worker is not None:
                worker.kill()
                worker = None
            self._idle.put(worker)


# Tokens a check walks into a new grammar after building it: a schema whose required properties refer back to
# their own object passes the build but fails its very first token on the parser's item limit.
PROBE_TOKENS = 8


def _serve(conn: Connection, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
    """The worker's main: build each spec it is sent and answer None (fine) or the problem's message."""
    from tokenloop.structured.grammar import GrammarLimits, build_matcher, grammar_tokenizer

    tokenizer = grammar_tokenizer(tokenizer_json, vocab_size, eos_token_ids)
    limits = GrammarLimits()
    conn.send("ready")
    while True:
        try:
            spec = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        try:
            problem = _probe(build_matcher(tokenizer, spec, limits), spec, set(eos_token_ids), vocab_size)
            conn.send(problem)
        except InvalidRequestError as exc:
            conn.send(str(exc))
        except Exception as exc:  # noqa: BLE001 - any other failure is still this spec's problem
            conn.send(f"{spec.field}: the grammar compiler failed on this {spec.kind}: {type(exc).__name__}")


def _probe(matcher: Any, spec: StructuredOutputsParams, eos: set[int], vocab_size: int) -> str | None:
    """Walk up to PROBE_TOKENS allowed tokens (drawn by a generator seeded with the spec's key, EOS last);
    the message if the grammar reaches one of its limits on the way, else None."""
    import llguidance.numpy
    import numpy as np

    rng = random.Random(spec.key())
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    for step in range(PROBE_TOKENS):  # noqa: B007 - the message below names the step it stopped at
        if matcher.is_stopped():
            return None
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error():
            break
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab_size]).tolist()
        choices = [t for t in allowed if t not in eos] or allowed
        if not choices or not matcher.consume_token(rng.choice(choices)):
            break
    else:
        return None
    if not matcher.is_error():
        return None
    from tokenloop.structured.grammar import short_error

    return (f"{spec.field}: this {spec.kind} reaches a limit of the grammar compiler after {step} token(s) "
            f"({short_error(matcher.get_error(), 200)}); simplify it (a required property that refers back to "
            "its own object can never end)")
