"""The engine's side of structured outputs: compile a request's spec on arrival, advance its matcher.

The grammar engine is imported and its tokenizer built only when the first constrained request arrives:
unconstrained serving neither loads llguidance nor does any per-step work for it. That first build imports
llguidance's torch glue (torch._dynamo: 3-8 s on a loaded 2-core machine), so the core's loop never waits
for it: `compile_later` builds it on a thread of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from tokenloop.errors import InvalidRequestError, TokenloopError
from tokenloop.structured.spec import StructuredOutputsParams

if TYPE_CHECKING:
    from tokenloop.request import Request
    from tokenloop.structured.compiler import CompiledGrammar, GrammarCompiler
    from tokenloop.tokenizer import Tokenizer


class GrammarRefusedTokenError(TokenloopError):
    """A sampled token did not fit the request's grammar (the mask should make this impossible)."""


class GrammarLimitError(InvalidRequestError):
    """The request's grammar hit one of the compiler's limits mid-way (say, a schema whose required
    properties refer back to their own object grows the parser's state without end): its own fault."""


class StructuredOutputs:
    """Per engine: the grammar cache (built on first use) and the matcher update of each new token."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._cache_size = cache_size
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # held while the compiler is built: seconds, the first time
        self._first_builds: ThreadPoolExecutor | None = None  # compiles until the compiler exists
        self._first_builds_lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar cache, made on first use (thread-safe: the front end compiles ahead of the engine)."""
        with self._lock:
            if self._compiler is None:
                from tokenloop.structured.compiler import GrammarCompiler

                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._cache_size)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams | None) -> CompiledGrammar | None:
        """The compiled grammar of `spec` (cached), None without one; raises InvalidRequestError."""
        return None if spec is None else self.compiler.compile(spec)

    def compile_later(self, specs: Sequence[StructuredOutputsParams | None]) -> list[Future[CompiledGrammar]]:
        """Futures of the grammars among `specs` that are not compiled yet, each building on a worker
        thread; empty when every spec is None or cached (the common case costs no thread hop)."""
        if all(spec is None for spec in specs):
            return []
        compiler = self._compiler  # not the property: it would wait on the lock of a build in progress
        if compiler is None:
            # No compiler yet: building it here would stall the core's loop past its hang bound (5 s),
            # and the front end would kill the core. One thread builds it, then compiles these specs.
            with self._first_builds_lock:
                if self._first_builds is None:
                    self._first_builds = ThreadPoolExecutor(1, thread_name_prefix="grammar-first-build")
                pool = self._first_builds
            return [pool.submit(self.compile, spec) for spec in specs if spec is not None]
        return [compiler.compile_later(spec) for spec in specs
                if spec is not None and not compiler.has(spec)]

    def close(self) -> None:
        """Stop the compile threads, if any were started."""
        with self._first_builds_lock:
            if self._first_builds is not None:
                self._first_builds.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            compiler = self._compiler
        if compiler is not None:
            compiler.close()

    @staticmethod
    def replay(request: Request, token_ids: Sequence[int]) -> None:
        """Advance a new matcher by output tokens produced elsewhere (a failover's recompute)."""
        for token_id in token_ids:
            StructuredOutputs.accept(request, token_id)

    @staticmethod
    def accept(request: Request, token_id: int) -> None:
        """Advance a constrained request's matcher by its newly appended output token."""
        matcher = request.structured
        if matcher is not None and not matcher.accept(token_id):
            spec = request.sampling_params.structured_outputs
            if matcher.error is not None and spec is not None:  # a limit, not a token the mask let through
                from tokenloop.structured.grammar import short_error

                raise GrammarLimitError(
                    f"{spec.field}: generation stopped after {matcher.num_accepted} tokens: the constraint's "
                    f"grammar reached a limit ({short_error(matcher.error, 200)}); simplify it",
                    param=spec.field)
            raise GrammarRefusedTokenError(f"token {token_id} does not fit the grammar: {matcher.error}")
