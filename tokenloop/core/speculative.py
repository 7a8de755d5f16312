"""Speculative decoding by n-gram prompt lookup (vLLM's `ngram` method): drafts without a draft model.

A decoding request often repeats text it has already seen (a summary quoting its source, an edit of a
given text, code). The proposer looks for the most recent earlier occurrence of the request's last n
tokens in its own prompt + output (n from `prompt_lookup_max` down to `prompt_lookup_min`) and proposes
the k tokens that followed it. The scheduler gives those drafts KV slots in the request's row, the model
scores all 1 + k positions in one forward, and `accept_greedy` keeps the longest prefix the model agrees
with plus the model's own next token, so the output is exactly what plain greedy decoding produces.

Only requests whose next-token choice depends on the logits alone are drafted for (`can_speculate`):
greedy, no grammar, no penalties, past min_tokens. For a sampled request, accepting a draft while it
equals the sampled token would keep the distribution exact but consume the request's random stream
differently, so its seeded output would change: those requests decode one token a step.

The lookup index lives on the request (`request.ngram_index`, like `block_hashes` for the KV cache):
built over the prompt once, then extended by the few tokens each step appends, so a step's proposal
costs a handful of dict operations whatever the request's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenloop.config import SpeculativeConfig
from tokenloop.core.ngram import NgramIndex
from tokenloop.request import GREEDY_TEMPERATURE, Request


def propose_ngram_reference(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The same proposal by a plain scan (for tests): slow, obviously right."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = list(tokens[end - n:])
        for start in range(end - n - 1, -1, -1):  # latest occurrence first, excluding the suffix itself
            if list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


def can_speculate(request: Request) -> bool:
    """Whether the request's next tokens are the argmax of logits that do not depend on earlier drafts."""
    p = request.sampling_params
    return (p.temperature < GREEDY_TEMPERATURE and request.structured is None
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            and request.num_output_tokens >= p.min_tokens)


class DraftProposer(Protocol):
    """What the scheduler asks for drafts: at most `max_drafts` tokens to follow the request's tokens."""

    def propose(self, request: Request, max_drafts: int) -> list[int]: ...

    def drafts_allowed(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests drafts at all."""
        ...


class NgramProposer:
    """Draft tokens for a decoding request from its own n-grams."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def drafts_allowed(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running < limit

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """At most min(k, max_drafts) draft tokens to follow the request's tokens; [] when it may not draft."""
        k = min(self.config.num_speculative_tokens, max_drafts)
        if k <= 0 or not can_speculate(request):
            return []
        index = request.ngram_index
        if index is None:
            index = request.ngram_index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        tokens = request.all_token_ids
        index.settle(tokens)
        if index.cooldown > 0:
            index.cooldown -= 1
            return []
        drafts = index.propose(tokens, k)
        index.remember(drafts, len(tokens))
        return drafts


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many drafts the model agrees with: `targets[i]` is its token after input i (0: the real last
    token, i > 0: draft i). The tokens to emit are then targets[:accepted + 1]."""
    accepted = 0
    for draft, target in zip(drafts, targets):
        if draft != target:
            break
        accepted += 1
    return accepted
