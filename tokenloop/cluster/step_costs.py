"""A replica's step costs as a router prices them, seeded from a profile and fitted online from its steps.

`StepCosts` is the model (`step_s + prefill_token_s x prefill tokens + decode_row_s x decode rows`);
`StepCostFit` refits it by NNLS over a replica's recent step records; the load tracker keeps one per replica.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from tokenloop.observe.records import StepRecord
from tokenloop.sim.cost import StepCostModel, StepFeatures, features_of_chunks, nnls


@dataclass(frozen=True, slots=True)
class StepCosts:
    """A replica's step time as `step_s + prefill_token_s x prefill tokens + decode_row_s x decode rows`."""

    step_s: float
    prefill_token_s: float
    decode_row_s: float

    @classmethod
    def from_cost_model(cls, model: StepCostModel, context: int = 512) -> StepCosts:
        """The marginal costs a profile's model implies: a bare step, a `context`-token prefill chunk
        from position 0, and one decode row at `context` (roofline profiles included)."""
        bare = model.step_seconds(StepFeatures())
        # Counted as the model counts them: a calibrated profile puts each weight form's rows in its terms.
        chunk = model.step_seconds(features_of_chunks([(0, context, True)], model.forms))
        decode = model.step_seconds(features_of_chunks([(context, 1, True)], model.forms))
        return cls(bare, max(chunk - bare, 0.0) / context, max(decode - bare, 0.0))


# Before anything is measured: `StepCosts.from_cost_model` of the shipped CPU profile (cpu-smollm2-135m),
# rounded; a tracker in front of other hardware is seeded from its profile instead.
DEFAULT_STEP_COSTS = StepCosts(step_s=0.0037, prefill_token_s=0.0007, decode_row_s=0.0018)


class StepCostFit:
    """Step costs fitted online from a replica's step records: NNLS over the recent steps.

    The fitted terms are a bare step, each batched token and each sampled row (`sim/cost.py`'s `step`,
    `tokens` and `sampled_rows`): a prefill token costs a token, a decode row a token and a sampled row.
    A term no recent step exercised keeps its seed, so an idle replica is never priced as free.
    """

    def __init__(self, seed: StepCosts, window: int = 512, refit_every: int = 32) -> None:
        self.costs = seed
        self._seed = seed
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0

    def observe(self, record: StepRecord) -> None:
        if not record.scheduled:
            return
        # The two terms fitted, summed here (features_of_record's tokens and sampled rows without weight
        # forms): a frame comes every step, and the full features cost a tuple per row.
        tokens = sampled = 0
        for chunk in record.scheduled:
            tokens += chunk.num_tokens
            sampled += chunk.samples
        self._rows.append((1.0, tokens, sampled, (record.end_ns - record.start_ns) / 1e9))
        self._since_fit += 1
        if self._since_fit >= self._refit_every:
            self.refit()

    def refit(self) -> None:
        self._since_fit = 0
        if len(self._rows) < 8:
            return
        rows = np.array(self._rows, dtype=np.float64)
        a, b = rows[:, :3], rows[:, 3]
        # Relative errors: the many short decode steps count as much as the few long prefills.
        weights = 1.0 / np.maximum(b, 1e-9)
        seed = self._seed
        values = [seed.step_s, seed.prefill_token_s, seed.decode_row_s - seed.prefill_token_s]
        # Tokens and sampled rows are collinear while only decodes ran: then keep the seeded token cost.
        prefill_seen = bool((a[:, 1] > a[:, 2]).any())
        used = [0, 1, 2] if prefill_seen else [0, 2]
        if prefill_seen:
            x = nnls(a[:, used] * weights[:, None], b * weights)
        else:
            x = nnls(a[:, used] * weights[:, None], (b - a[:, 1] * values[1]) * weights)
        for i, column in enumerate(used):
            values[column] = float(x[i])
        if sum(values) <= 0:
            return
        self.costs = StepCosts(values[0], values[1], values[1] + values[2])
