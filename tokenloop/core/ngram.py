"""The n-gram lookup index of one request's tokens, for speculative decoding's proposer (`speculative.py`).

It lives on the request (`request.ngram_index`, like `block_hashes` for the KV cache), so it sits below
both: the request holds one, the proposer fills and reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_BACKOFF_STEPS = 16  # the longest a request waits to draft again after proposals rejected outright


class NgramIndex:
    """For each n-gram of one token sequence, where the token after its latest occurrence is; and how the
    request's last proposal fared.

    `add(tokens)` indexes the n-grams that end before the sequence's last token, so a lookup of the last
    n tokens finds an *earlier* occurrence, never the suffix itself.

    A proposal the model rejects outright still cost its row k more tokens to verify. In free text (chat)
    most are (acceptance ~5-10% here), so each such rejection doubles the steps the request waits before
    it drafts again (1, 2, 4 ... 16), and any accepted draft ends the wait.
    """

    __slots__ = ("backoff", "cooldown", "max_n", "min_n", "next_after", "num_indexed", "pending", "pending_at")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.num_indexed = 0  # tokens whose preceding n-grams are indexed
        self.next_after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self.pending: Sequence[int] = ()  # the last proposal, until the token after it is known
        self.pending_at = 0  # where that proposal's first draft stands in the sequence
        self.backoff = 0  # the wait the last outright rejection set; an acceptance resets it
        self.cooldown = 0  # steps left before this request drafts again

    def remember(self, drafts: Sequence[int], num_tokens: int) -> None:
        """Note a proposal made after `num_tokens` tokens, to learn from once it is verified."""
        self.pending, self.pending_at = drafts, num_tokens

    def settle(self, tokens: Sequence[int]) -> None:
        """Learn from the last proposal once the token after it is known (see the class docstring)."""
        if not self.pending or len(tokens) <= self.pending_at:
            return
        if tokens[self.pending_at] == self.pending[0]:
            self.backoff = 0
        else:
            self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF_STEPS)
            self.cooldown = self.backoff
        self.pending = ()

    def add(self, tokens: Sequence[int]) -> None:
        """Index every n-gram followed by a token of `tokens` (that is, ending before its last token)."""
        index = self.next_after
        min_n, max_n = self.min_n, self.max_n
        for follow in range(max(self.num_indexed, 1), len(tokens)):
            # n-grams tokens[follow - n: follow] for every n that fits; later occurrences overwrite.
            for n in range(min_n, min(max_n, follow) + 1):
                index[tuple(tokens[follow - n:follow])] = follow
        self.num_indexed = max(self.num_indexed, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        self.add(tokens)
        end = len(tokens)
        index = self.next_after
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            follow = index.get(tuple(tokens[end - n:end]))
            if follow is not None:
                return list(tokens[follow:follow + k])
        return []
