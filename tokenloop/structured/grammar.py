"""Building one llguidance grammar from a spec, under explicit limits; no cache, no torch.

Shared by the engine core's compile cache (`tokenloop.structured.compiler`) and the door's checking worker
(`tokenloop.structured.compile_worker`), so that what the door accepted is exactly what the core builds.

llguidance (not xgrammar) because, measured on this machine (BENCHMARKS.md): it builds a grammar in
under 2 ms where xgrammar takes 4-20 ms, its parser runs under fuel limits, it reads our tokenizer's JSON
directly and it has no dependencies. Its fuel does not bound everything (the first mask of `a{1000000}` takes
4 s): the door adds a time budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.numpy

from tokenloop.errors import InvalidRequestError
from tokenloop.structured.spec import StructuredOutputsParams


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


def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer (its HF JSON; ~0.2 s to build)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids) or None)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a spec (not yet validated); JSON is compact, as small models need."""
    options = {"whitespace_flexible": False}
    kind = spec.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex or "")
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice or ()))
        return llguidance.grammar_from("gbnf", spec.grammar or "")
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{spec.field}: invalid {kind}: {exc}", param=spec.field) from None


def build_matcher(tokenizer: llguidance.LLTokenizer, spec: StructuredOutputsParams,
                  limits: GrammarLimits) -> llguidance.LLMatcher:
    """A validated matcher at the start of the spec's grammar; InvalidRequestError naming `spec.field`."""
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0, limits=limits.parser_limits())
    if not matcher.is_error():
        # The first mask builds the lexer's start states: a grammar too costly for its fuel fails here.
        mask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    if matcher.is_error():
        raise InvalidRequestError(f"{spec.field}: invalid or unsupported {spec.kind}: "
                                  f"{short_error(matcher.get_error())}", param=spec.field)
    return matcher


def short_error(message: str, limit: int = 300) -> str:
    """A grammar engine's message on one line, at most `limit` characters."""
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."
