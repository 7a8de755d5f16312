"""One position's logprobs, as the sampler makes them and every later stage carries them.

Its own module, free of torch: the messages between the front end and the engine core, and the server's
responses, carry logprobs in processes that never import the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token's, its rank, and the best alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token (ties share the better rank)
    top: list[tuple[int, float]]  # the N most likely (token_id, logprob), best first
