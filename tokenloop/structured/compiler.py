"""The engine core's grammar cache: specs -> compiled llguidance grammars -> per-request matchers.

A grammar is compiled once per distinct spec (keyed by the spec's hash) into a template matcher that has
computed its first mask, so every error a spec can cause at the start shows up at compile time as an
`InvalidRequestError` naming the request field. Requests get deep copies of the template.

The core compiles on a worker thread (`compile_later`), never on the thread that steps: llguidance releases
the GIL while it builds (measured: the longest hold ~40 ms during a 1 s build), so steps go on meanwhile.
The server has already compiled every spec once at the door, in a worker process under a time budget
(`tokenloop.structured.compile_worker`); the core's own build is the same code on the same input.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llguidance

from tokenloop.structured.grammar import GrammarLimits, build_matcher, grammar_tokenizer
from tokenloop.structured.matcher import RequestMatcher
from tokenloop.structured.spec import StructuredOutputsParams

if TYPE_CHECKING:
    from tokenloop.tokenizer import Tokenizer

__all__ = ["CompileStats", "CompiledGrammar", "GrammarCompiler", "GrammarLimits"]


@dataclass
class CompileStats:
    """What the cache did: hits, misses (compiles), and each compile's seconds."""

    hits: int = 0
    misses: int = 0
    compile_s: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class CompiledGrammar:
    """A validated grammar: `new_matcher()` gives each request (each sample) its own state."""

    key: str
    template: llguidance.LLMatcher

    def new_matcher(self) -> RequestMatcher:
        return RequestMatcher(self.key, self.template.deep_copy())


class GrammarCompiler:
    """Compiles specs for one tokenizer, keeping the last `cache_size` grammars (LRU, by spec hash).

    Thread-safe: the front end validates requests on worker threads while the engine thread compiles.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256,
                 limits: GrammarLimits | None = None) -> None:
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self.tokenizer = grammar_tokenizer(tokenizer.backend.to_str(), vocab_size, tokenizer.eos_token_ids)
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made on the first compile_later
        self._building: dict[str, concurrent.futures.Future[CompiledGrammar]] = {}  # guarded by _lock

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The spec's grammar, from the cache or built now; raises InvalidRequestError naming `spec.field`."""
        hit = self.cached(spec)
        return hit if hit is not None else self._build(spec)

    def cached(self, spec: StructuredOutputsParams) -> CompiledGrammar | None:
        """The spec's grammar if it is in the cache (counted as a hit), else None."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
            return hit

    def has(self, spec: StructuredOutputsParams) -> bool:
        """Whether the spec's grammar is in the cache (not counted as a hit)."""
        with self._lock:
            return spec.key() in self._cache

    def compile_later(self, spec: StructuredOutputsParams) -> concurrent.futures.Future[CompiledGrammar]:
        """The spec's grammar built on a worker thread (one build per key at a time); the future raises
        InvalidRequestError for a bad spec. Look in the cache first: this always goes to the pool."""
        key = spec.key()
        with self._lock:
            future = self._building.get(key)
            if future is not None:
                return future
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            future = self._building[key] = self._pool.submit(self._build, spec)
        # Outside the lock: a build already done calls back at once, on this thread.
        future.add_done_callback(lambda _: self._forget_building(key))
        return future

    def close(self) -> None:
        """Stop the worker thread (builds already queued finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget_building(self, key: str) -> None:
        with self._lock:
            self._building.pop(key, None)

    def _build(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        begin = time.perf_counter()
        compiled = CompiledGrammar(spec.key(), build_matcher(self.tokenizer, spec, self.limits))
        elapsed = time.perf_counter() - begin
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_s.append(elapsed)
            del self.stats.compile_s[:-10_000]  # bounded history
            self._cache[compiled.key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled
