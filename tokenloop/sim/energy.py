"""Energy per request: each step's modelled energy shared among its requests by their share of its tokens.

A step of `c` modelled seconds at the profile's busy power `P` costs `P x c` joules; a request that had
`n` of the step's `N` batched tokens (a prefill chunk's tokens, or its one decode token) is charged
`P x c x n / N`. Every joule of the run lands on exactly one request, recomputation after a preemption
included (the request that was preempted pays to redo its prefill), so the requests' energies sum to the
run's. Prefill-heavy requests pay for their prompt; a decode token in a big batch is cheap.

`StepEnergy` is an observer: the core builds the step's record anyway (the replay observes every step),
and this adds one multiply-add per scheduled chunk. It is attached only when the profile has a power.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from tokenloop.observe.records import EngineObserver, StepRecord


class StepEnergy(EngineObserver):
    """Joules charged to each request id, and in all, from the steps' modelled time (`forward_ns`)."""

    def __init__(self, power_watts: float) -> None:
        if not power_watts > 0:
            raise ValueError(f"power_watts must be > 0, got {power_watts!r}")
        self.joules_per_ns = power_watts / 1e9
        self.by_request: defaultdict[str, float] = defaultdict(float)
        self.total_j = 0.0

    def on_step(self, record: StepRecord) -> None:
        tokens = record.num_batched_tokens
        if not tokens:
            return
        step_j = self.joules_per_ns * record.forward_ns
        self.total_j += step_j
        per_token = step_j / tokens
        by_request = self.by_request
        for chunk in record.scheduled:
            by_request[chunk.request_id] += per_token * chunk.num_tokens


def attach_energy(records: Sequence[Any], energy: StepEnergy | None) -> None:
    """Write each replay record's `energy_j` from what the observer charged its request (after the run)."""
    if energy is None:
        return
    for record in records:
        record.energy_j = energy.by_request.get(record.id, 0.0)


def energy_summary(records: Sequence[Any]) -> dict[str, Any] | None:
    """Total, per output token and per finished request (mean, p50, p90, max) joules; None without energy."""
    import numpy as np

    values = [r.energy_j for r in records if getattr(r, "energy_j", None) is not None]
    if not values:
        return None
    done = np.array([r.energy_j for r in records if r.success and r.energy_j is not None], dtype=np.float64)
    outputs = sum(r.output_len for r in records if r.success)
    summary: dict[str, Any] = {"total_j": float(sum(values)),
                               "j_per_output_token": float(done.sum() / outputs) if outputs else None}
    if len(done):
        summary.update(mean_j=float(done.mean()), p50_j=float(np.percentile(done, 50)),
                       p90_j=float(np.percentile(done, 90)), max_j=float(done.max()))
    return summary
