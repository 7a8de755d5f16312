"""Grammar compilation, bounded and cached: specs -> validated llguidance grammars -> per-request matchers.

llguidance (not xgrammar) because, measured on this machine (BENCHMARKS.md): it builds a grammar in
under 2 ms where xgrammar takes 4-20 ms, its parser runs under fuel limits (a hostile schema errors
out instead of hanging the engine), it reads our tokenizer's JSON directly and it has no dependencies.

A grammar is compiled once per distinct spec (keyed by the spec's hash) into a template matcher that
has computed its first mask, so every error a spec can cause at the start shows up here, at the edge,
as an `InvalidRequestError` naming the request field. Requests get deep copies of the template.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llguidance
import llguidance.torch
import torch

from tokenloop.errors import InvalidRequestError
from tokenloop.structured.matcher import RequestMatcher
from tokenloop.structured.spec import StructuredOutputsParams

if TYPE_CHECKING:
    from tokenloop.tokenizer import Tokenizer


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on one grammar: llguidance's fuel (work per build and per mask step) and sizes."""

    max_grammar_size: int = 200_000  # symbols in the grammar's productions
    initial_lexer_fuel: int = 2_000_000  # ~40 ms of regex building
    step_lexer_fuel: int = 400_000  # ~30 ms per mask, at most
    max_lexer_states: int = 100_000

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(max_grammar_size=self.max_grammar_size,
                                         initial_lexer_fuel=self.initial_lexer_fuel,
                                         step_lexer_fuel=self.step_lexer_fuel,
                                         max_lexer_states=self.max_lexer_states, verbose_errors=False)


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


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a spec (not yet validated); JSON is compact, as small models need."""
    options = {"whitespace_flexible": False}
    kind = spec.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec.json), defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice or ()))
        return llguidance.grammar_from("gbnf", spec.grammar or "")
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{spec.param}: invalid {kind}: {exc}", param=spec.param) from None


class GrammarCompiler:
    """Compiles specs for one tokenizer, keeping the last `cache_size` grammars (LRU, by spec hash).

    Thread-safe: the front end validates requests on worker threads while the engine thread compiles.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256,
                 limits: GrammarLimits | None = None) -> None:
        eos = sorted(tokenizer.eos_token_ids) or None
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
        self.cache_size = cache_size
        self.stats = CompileStats()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The spec's grammar, from the cache or built now; raises InvalidRequestError naming `spec.param`."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return hit
        begin = time.perf_counter()
        compiled = CompiledGrammar(key, self._build(spec))
        elapsed = time.perf_counter() - begin
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_s.append(elapsed)
            del self.stats.compile_s[:-10_000]  # bounded history
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        grammar = grammar_text(spec)
        limits = self.limits.parser_limits()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if not matcher.is_error():
            # The first mask builds the lexer's start states: a grammar too costly for its fuel fails here.
            mask = torch.zeros(1, (self.vocab_size + 31) // 32, dtype=torch.int32)
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.param}: invalid or unsupported {spec.kind}: "
                                      f"{_short(matcher.get_error())}", param=spec.param)
        return matcher


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."
