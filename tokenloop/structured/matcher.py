"""A request's grammar state, and the batched bitmask the sampler applies before drawing.

A `RequestMatcher` advances with each token the engine appends to the request's output, never with
tokens recomputed after a preemption or read from the prefix cache (those are not new outputs), so
its state always equals "the grammar after these output tokens". `export_state()` is exactly that list,
and `RequestMatcher.restore` replays it into a fresh matcher (for a handoff to another engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class MatcherState:
    """Everything needed to rebuild a matcher elsewhere: its grammar's key and the accepted tokens."""

    grammar_key: str
    token_ids: tuple[int, ...]


class RequestMatcher:
    """One sequence's position in its grammar (each sample of an n>1 request has its own)."""

    def __init__(self, grammar_key: str, matcher: llguidance.LLMatcher) -> None:
        self.grammar_key = grammar_key
        self._matcher = matcher
        self._token_ids: list[int] = []

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and an error state) if the grammar forbids it."""
        ok = self._matcher.consume_token(token_id)
        if ok:
            self._token_ids.append(token_id)
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._token_ids[-num_tokens:]

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete: nothing but EOS may follow, so the request should stop."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    @property
    def num_accepted(self) -> int:
        return len(self._token_ids)

    def export_state(self) -> MatcherState:
        """The accepted token ids (and the grammar's key): replaying them rebuilds this state."""
        return MatcherState(self.grammar_key, tuple(self._token_ids))

    @classmethod
    def restore(cls, fresh: RequestMatcher, state: MatcherState) -> RequestMatcher:
        """Replay `state` into `fresh` (a new matcher of the same grammar); raises if the tokens don't fit."""
        if fresh.grammar_key != state.grammar_key or fresh.num_accepted:
            raise ValueError("restore needs a fresh matcher of the state's grammar")
        for token_id in state.token_ids:
            if not fresh.accept(token_id):
                raise ValueError(f"token {token_id} does not fit the grammar: {fresh.error}")
        return fresh


class BitmaskApplier:
    """Fills the constrained rows' token bitmasks (in parallel, through llguidance's executor) and masks
    their logits; rows without a matcher are untouched. Owns its scratch buffers (one per sampler)."""

    def __init__(self, vocab_size: int, num_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._executor: llguidance.LLExecutor | None = None
        self._num_threads = num_threads

    def apply(self, logits: torch.Tensor, matchers: Sequence[RequestMatcher | None]) -> torch.Tensor:
        """`logits` [B, V] with the constrained rows' disallowed tokens at -inf (a copy, or `logits`)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        bitmask = torch.empty(len(rows), self.words, dtype=torch.int32)
        pairs = [(matchers[row].llmatcher, k) for k, row in enumerate(rows)]  # type: ignore[union-attr]
        # The native calls, not `llguidance.torch`: importing that runs torch.compile's setup (~5 s), on the
        # core's loop at its first constrained request: longer than the heartbeat's bound on a busy machine.
        row_bytes = self.words * 4
        if len(pairs) == 1:
            pairs[0][0].unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, len(pairs))
        # numpy, single-threaded: on a busy machine each parallel torch op over [B, V] waits ~8 ms for its
        # second thread, which costs more than the whole masking (bit k of word w is token 32 w + k).
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = allowed[:, :logits.shape[1]].view(np.bool_)
        if logits.device.type != "cpu":  # the mask goes to the logits, not the logits to the host
            allowed_rows = torch.from_numpy(allowed).to(logits.device)
            out = logits.clone()
            out[rows] = logits[rows].masked_fill(~allowed_rows, _NEG_INF)
            return out
        source = logits.numpy()
        if len(rows) == logits.shape[0]:
            return torch.from_numpy(np.where(allowed, source, np.float32(_NEG_INF)))
        out = source.copy()
        out[rows] = np.where(allowed, source[rows], np.float32(_NEG_INF))
        return torch.from_numpy(out)
