"""The step cost model: one step's duration from physical terms, fitted by non-negative least squares.

A step's terms are counted from what it computes (a `SchedulerOutput` before the step runs, or the
`StepRecord` a real engine reported after it):

- `step`: 1 per step. Reading every weight once is the same whatever the batch, so it lands here
  together with the fixed per-step overhead (launches, the loop's own Python).
- `tokens`: batched tokens; the dense projections do 2 x params FLOPs per token.
- `kv_read_tokens`: the sum over rows of the context attended to (KV bytes read scale with it).
- `prefill_attn`: the sum over multi-token chunks of q x context (the attention's quadratic work).
- `sampled_rows`: rows that reach the LM head (only sampling rows do).
- `seqs`: scheduled sequences (per-row bookkeeping: block tables, sampling parameters).

An engine may run its weights in two forms chosen by the step's row count (`WeightForms`): on this CPU
the layers run torch's packed int4 kernel for up to 16 batched tokens and a bf16 copy above, the LM head
our Q8_0 kernel for up to 8 sampled rows and an fp32 copy above. The forms read different bytes and cost
differently per row, so a step's cost is not linear in its tokens across a switch. With switch points
set, the tokens and sampled rows of a step that runs the packed form count in their own terms, and a
step that runs the dense copy pays its extra weight bytes once:

- `packed_tokens`: batched tokens of a step whose layers run the packed form (`tokens` then counts 0).
- `dense_layers`: 1 when the layers run the dense copy (its weight bytes above the packed form's).
- `packed_sampled_rows`: sampled rows of a step whose head runs the packed form (`sampled_rows`: 0).
- `dense_head`: 1 when the head runs the dense copy.

Without switch points (one form at every size: the GPU profiles) these four count 0 and `tokens` and
`sampled_rows` count everything, as before.

Coefficients are seconds per unit and never negative, so a fit cannot explain time away with a negative
term (the ill-conditioning of free least squares on collinear step features). `combine="sum"` adds the
terms (what a fit produces); `combine="max"` is a roofline: the step lasts as long as the slower of its
bandwidth terms (`step`, `kv_read_tokens`) and its compute terms (`tokens`, `prefill_attn`,
`sampled_rows`), plus the per-sequence overhead (`seqs`).

Two overheads sit outside the roofline in either combine and are never fitted (a fit's `step` and
`tokens` already absorb them): `overhead_step`, seconds added to every step (launches, the framework's
own loop, a tensor-parallel all-reduce's latency per layer), and `overhead_tokens`, seconds per batched
token (the all-reduce bytes each token's hidden state moves between tensor-parallel devices). Profiles
derived from a datasheet set them; see `profiles/*.json`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenloop.core.scheduler_output import SchedulerOutput
from tokenloop.observe.records import StepRecord

TERMS = ("step", "tokens", "kv_read_tokens", "prefill_attn", "sampled_rows", "seqs",
         "packed_tokens", "dense_layers", "packed_sampled_rows", "dense_head")
BANDWIDTH_TERMS = ("step", "kv_read_tokens", "dense_layers", "dense_head")
COMPUTE_TERMS = ("tokens", "prefill_attn", "sampled_rows", "packed_tokens", "packed_sampled_rows")
FORM_TERMS = ("packed_tokens", "dense_layers", "packed_sampled_rows", "dense_head")  # count 0 without forms
COMBINES = ("sum", "max")
OVERHEADS = ("overhead_step", "overhead_tokens")  # outside the roofline; `from_dict`'s "overheads" keys


@dataclass(frozen=True, slots=True)
class WeightForms:
    """Where the engine switches weight forms by rows; None: one form at every size.

    `layers_packed_max_tokens`: the most batched tokens whose layers still run the packed form.
    `head_packed_max_rows`: the most sampled rows whose LM head still runs the packed form.
    """

    layers_packed_max_tokens: int | None = None
    head_packed_max_rows: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers_packed_max_tokens", "head_packed_max_rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"weight form switch {name!r} must be an int >= 0 or null, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        """The switch points that are set (a profile's "forms")."""
        return {name: value for name in ("layers_packed_max_tokens", "head_packed_max_rows")
                if (value := getattr(self, name)) is not None}

    @classmethod
    def from_dict(cls, values: dict[str, int] | None) -> WeightForms:
        values = values or {}
        valid = ("layers_packed_max_tokens", "head_packed_max_rows")
        unknown = sorted(set(values) - set(valid))
        if unknown:
            raise ValueError(f"unknown weight form switch {unknown[0]!r} (valid: {', '.join(valid)})")
        return cls(**values)


ONE_FORM = WeightForms()


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What one step computes, in the cost model's units."""

    step: float = 1.0
    tokens: float = 0.0
    kv_read_tokens: float = 0.0
    prefill_attn: float = 0.0
    sampled_rows: float = 0.0
    seqs: float = 0.0
    packed_tokens: float = 0.0
    dense_layers: float = 0.0
    packed_sampled_rows: float = 0.0
    dense_head: float = 0.0

    def vector(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in TERMS], dtype=np.float64)


def features_of_chunks(chunks: Iterable[tuple[int, int, bool]], forms: WeightForms = ONE_FORM) -> StepFeatures:
    """From (first position, tokens, samples) per row, each form's rows in its own terms."""
    tokens = kv = attn = sampled = seqs = 0
    for start, q, samples in chunks:
        context = start + q
        tokens += q
        kv += context
        if q > 1:
            attn += q * context
        sampled += samples
        seqs += 1
    return features_of_totals(tokens, kv, attn, sampled, seqs, forms)


def features_of_totals(tokens: int, kv: int, attn: int, sampled: int, seqs: int,
                       forms: WeightForms = ONE_FORM) -> StepFeatures:
    """From a step's sums over its rows (`features_of_chunks`' loop, or a caller's own pass over them):
    batched tokens, contexts attended to, q x context of multi-token chunks, sampled rows, rows."""
    layers_max, head_max = forms.layers_packed_max_tokens, forms.head_packed_max_rows
    packed_layers = layers_max is not None and tokens <= layers_max
    packed_head = head_max is not None and sampled <= head_max
    return StepFeatures(
        1.0, 0 if packed_layers else tokens, kv, attn, 0 if packed_head else sampled, seqs,
        packed_tokens=tokens if packed_layers else 0,
        dense_layers=float(layers_max is not None and not packed_layers),
        packed_sampled_rows=sampled if packed_head else 0,
        dense_head=float(head_max is not None and not packed_head))


def features_of_schedule(schedule: SchedulerOutput, forms: WeightForms = ONE_FORM) -> StepFeatures:
    """The terms of a step about to run (the simulator prices it before it happens)."""
    chunks = ((item.num_computed_tokens, item.num_tokens, item.samples) for item in schedule.scheduled)
    return features_of_chunks(chunks, forms)


def features_of_record(record: StepRecord, forms: WeightForms = ONE_FORM) -> StepFeatures:
    """The terms of a step a real engine ran."""
    return features_of_chunks(((c.start, c.num_tokens, c.samples) for c in record.scheduled), forms)


@dataclass(frozen=True)
class StepCostModel:
    """Seconds per unit of each term (all >= 0); see the module docstring for `combine`."""

    step: float = 0.0
    tokens: float = 0.0
    kv_read_tokens: float = 0.0
    prefill_attn: float = 0.0
    sampled_rows: float = 0.0
    seqs: float = 0.0
    packed_tokens: float = 0.0
    dense_layers: float = 0.0
    packed_sampled_rows: float = 0.0
    dense_head: float = 0.0
    combine: str = "sum"
    overhead_step: float = 0.0
    overhead_tokens: float = 0.0
    forms: WeightForms = ONE_FORM  # where the weight forms switch: how `features` counts a step

    def __post_init__(self) -> None:
        if self.combine not in COMBINES:
            raise ValueError(f"unknown combine {self.combine!r} (valid: {', '.join(COMBINES)})")
        for name in (*TERMS, *OVERHEADS):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"cost coefficient {name!r} must be finite and >= 0, got {value!r}")
        if self.coefficients().sum() <= 0:
            raise ValueError("a cost model needs at least one positive coefficient")

    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in TERMS], dtype=np.float64)

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in TERMS}

    def features(self, schedule: SchedulerOutput) -> StepFeatures:
        """A schedule's terms as this model counts them (its weight forms)."""
        return features_of_schedule(schedule, self.forms)

    def overheads(self) -> dict[str, float]:
        """The overheads outside the roofline, by the names a profile's "overheads" uses."""
        return {"step": self.overhead_step, "tokens": self.overhead_tokens}

    def _parts(self, f: StepFeatures) -> tuple[float, float, float]:
        """(bandwidth seconds, compute seconds, overhead seconds) of one step."""
        bandwidth = (self.step * f.step + self.kv_read_tokens * f.kv_read_tokens
                     + self.dense_layers * f.dense_layers + self.dense_head * f.dense_head)
        compute = (self.tokens * f.tokens + self.prefill_attn * f.prefill_attn
                   + self.sampled_rows * f.sampled_rows + self.packed_tokens * f.packed_tokens
                   + self.packed_sampled_rows * f.packed_sampled_rows)
        return bandwidth, compute, (self.seqs * f.seqs + self.overhead_step * f.step
                                    + self.overhead_tokens * f.tokens)

    def step_seconds(self, features: StepFeatures) -> float:
        bandwidth, compute, overhead = self._parts(features)
        if self.combine == "max":
            return max(bandwidth, compute) + overhead
        return bandwidth + compute + overhead

    def step_ns(self, features: StepFeatures) -> int:
        # At least 1 ns: time must move forward with every step, or a replay could spin at one instant.
        return max(1, round(self.step_seconds(features) * 1e9))

    def critical_path(self, features: StepFeatures) -> str:
        """'bandwidth' or 'compute': which side of the roofline bounds this step."""
        bandwidth, compute, _ = self._parts(features)
        return "bandwidth" if bandwidth >= compute else "compute"

    @classmethod
    def from_dict(cls, values: dict[str, float], combine: str = "sum",
                  overheads: dict[str, float] | None = None, forms: dict[str, int] | None = None,
                  ) -> StepCostModel:
        """From a profile's "coefficients" (TERMS; a term left out is 0), optional "overheads" ({"step": s,
        "tokens": s}) and optional "forms" (`WeightForms`' switch points)."""
        unknown = sorted(set(values) - set(TERMS))
        if unknown:
            raise ValueError(f"unknown cost term {unknown[0]!r} (valid: {', '.join(TERMS)})")
        overheads = overheads or {}
        valid = [name.removeprefix("overhead_") for name in OVERHEADS]
        unknown = sorted(set(overheads) - set(valid))
        if unknown:
            raise ValueError(f"unknown overhead {unknown[0]!r} (valid: {', '.join(valid)})")
        return cls(**{k: float(v) for k, v in values.items()}, combine=combine,
                   **{f"overhead_{k}": float(v) for k, v in overheads.items()}, forms=WeightForms.from_dict(forms))


# ---- fitting -------------------------------------------------------------------------------------

def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None, tol: float = 1e-10) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method).

    Columns are scaled to unit norm first, so terms whose units differ by orders of magnitude (steps vs
    q x context) are weighed alike when the method picks which to free.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    n = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    max_iter = max_iter or 3 * n + 30
    for _ in range(max_iter):
        gradient = a.T @ (b - a @ x)
        candidates = ~passive & (gradient > tol * max(1.0, np.abs(gradient).max()))
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step back towards x until the first passive coefficient hits zero, then drop it.
            blocking = passive & (z <= 0)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking] + 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x / norms


@dataclass(frozen=True)
class FitReport:
    """A fitted model and how well it explains the records it was fitted on."""

    model: StepCostModel
    num_steps: int  # fitted on (after trimming)
    num_records: int  # steps offered
    median_abs_rel_error: float
    mean_step_s: float


def fit(records: Sequence[StepRecord], *, terms: Sequence[str] | None = None, forms: WeightForms = ONE_FORM,
        duration: str = "step", durations: Sequence[float] | None = None, relative: bool = True,
        trim: float | None = 3.0, rounds: int = 3) -> FitReport:
    """Fit a `combine="sum"` model to real steps: each record's features against its duration.

    `terms`: the terms fitted (default: every term, less the form terms without `forms`); the others stay
    0. `forms`: the engine's weight form switches, counted into the features and kept in the model.
    `duration`: "step" (end - start: the whole loop body, the time the next step waits for) or "forward"
    (the model forward alone); `durations` (seconds, one per record) replaces either, e.g. the loop's
    period from one step's start to the next one's. `relative`: minimise relative errors (each row
    divided by its duration), so a few multi-second prefill steps do not outweigh the many short decode
    steps. `trim`: refit without the steps whose relative error exceeds `trim` x the median (up to
    `rounds` times, keeping at least half): on a shared machine another process's burst only ever adds
    time to a step, and such steps say nothing about the engine.
    """
    if terms is None:
        terms = [t for t in TERMS if forms != ONE_FORM or t not in FORM_TERMS]
    unknown = [t for t in terms if t not in TERMS]
    if unknown:
        raise ValueError(f"unknown cost term {unknown[0]!r} (valid: {', '.join(TERMS)})")
    if durations is not None and len(durations) != len(records):
        raise ValueError(f"{len(durations)} durations for {len(records)} records")
    chosen = [i for i, r in enumerate(records) if r.scheduled]
    steps = [records[i] for i in chosen]
    if len(steps) < len(terms):
        raise ValueError(f"{len(steps)} steps cannot fit {len(terms)} terms")
    columns = [TERMS.index(t) for t in terms]
    a = np.stack([features_of_record(r, forms).vector()[columns] for r in steps])
    if durations is not None:
        b = np.array([float(durations[i]) for i in chosen])
    else:
        b = np.array([(r.end_ns - r.start_ns if duration == "step" else r.forward_ns) / 1e9 for r in steps])
    weights = 1.0 / np.maximum(b, 1e-9) if relative else np.ones_like(b)
    keep = np.ones(len(b), dtype=bool)
    for round_ in range(rounds if trim else 1):
        x = nnls(a[keep] * weights[keep, None], b[keep] * weights[keep])
        rel = np.abs(a @ x - b) / np.maximum(b, 1e-12)
        if trim is None or round_ == rounds - 1:
            break
        bound = max(trim * float(np.median(rel[keep])), float(np.quantile(rel, 0.5)))
        if (rel <= bound).sum() < len(terms) or (rel <= bound).all():
            break
        keep = rel <= bound
    model = StepCostModel(**{t: float(v) for t, v in zip(terms, x)}, forms=forms)
    return FitReport(model, int(keep.sum()), len(b), float(np.median(rel[keep])), float(b[keep].mean()))
