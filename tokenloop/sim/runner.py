"""SimulatedRunner: the model runner's interface with no model behind it.

Each `execute` prices the step with the cost model, moves the virtual clock on by that much, and returns
the tokens the trace dictates (`RunnerOutput.token_ids`: a filler token until the request's last token,
then EOS), so the core skips the sampler. The rest of the step (scheduler, KV cache, update and its stop
checks, release, records) is the engine core's own code.

`sim_core` builds an `EngineCore` around it without a checkpoint (the core's `stand_in` argument).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenloop.config import EngineConfig
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.scheduler_output import SchedulerOutput
from tokenloop.observe.records import Observes
from tokenloop.runner import RunnerOutput
from tokenloop.sim.cost import StepCostModel, features_of_totals

WEIGHT_FORM = "simulated"


class AdvancingClock(Protocol):
    """A clock the simulator moves on (the replay's VirtualClock is one)."""

    def __call__(self) -> int: ...

    def advance_by(self, ns: int) -> None: ...


class SimulatedRunner:
    """Stands in for `ModelRunner`: no KV tensors, no forward; time passes by the cost model."""

    def __init__(self, cost_model: StepCostModel, clock: AdvancingClock, num_blocks: int, block_size: int,
                 vocab_size: int, eos_token_id: int, filler_token_id: int) -> None:
        if not hasattr(clock, "advance_by"):
            raise TypeError("the simulated runner needs a clock it can advance (a VirtualClock)")
        for name, token in (("eos_token_id", eos_token_id), ("filler_token_id", filler_token_id)):
            if not 0 <= token < vocab_size:
                raise ValueError(f"{name} {token} is outside the vocabulary [0, {vocab_size})")
        self.cost_model = cost_model
        self.clock = clock
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.filler_token_id = filler_token_id
        self.modelled_ns = 0  # the sum of every step's modelled cost
        # Modelled time and steps by the side of the roofline that bounds them.
        self.bound_ns = {"bandwidth": 0, "compute": 0}
        self.bound_steps = {"bandwidth": 0, "compute": 0}

    @property
    def last_weight_form(self) -> str:
        return WEIGHT_FORM

    def apply_block_diffs(self, output: SchedulerOutput) -> None:
        """Nothing to keep: there are no KV tensors, and the scheduler owns the block tables."""

    def block_table(self, request_id: str) -> list[int]:
        return []

    # A handoff moves block hashes only: there is no K/V to carry.
    kv_layout = "simulated"
    kv_bytes_per_token = 0

    def read_block(self, block_id: int, num_tokens: int) -> bytes:
        return b""

    def write_block(self, block_id: int, data: bytes, num_tokens: int) -> None:
        """Nothing to write."""

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        """The step's dictated tokens (one per sampling row), its modelled time passed."""
        # One pass over the rows gives both the cost model's sums and the tokens: a row costs ~50-150 ns
        # per Python pass, and a simulated step has no other work (issue 13's speed goal).
        tokens = kv = attn = 0
        indices: list[int] = []
        dictated: list[int] = []
        filler, eos = self.filler_token_id, self.eos_token_id
        for i, item in enumerate(output.scheduled):
            chunk = item.chunk  # its plain values, read without the row's properties
            q = chunk.num_tokens
            context = chunk.start + q
            tokens += q
            kv += context
            if q > 1:
                attn += q * context
            if chunk.samples:
                request = item.request
                indices.append(i)
                # The token sampled now is output number num_output_tokens + 1; the last one is EOS.
                last = len(request.output_token_ids) + 1 >= (request.sampling_params.max_tokens or 1)
                dictated.append(eos if last else filler)
        features = features_of_totals(tokens, kv, attn, len(indices), len(output.scheduled),
                                      self.cost_model.forms)
        cost_ns = self.cost_model.step_ns(features)
        self.clock.advance_by(cost_ns)
        self.modelled_ns += cost_ns
        bound = self.cost_model.critical_path(features)
        self.bound_ns[bound] += cost_ns
        self.bound_steps[bound] += 1
        return RunnerOutput(indices, None, forward_s=cost_ns / 1e9, weight_form=WEIGHT_FORM, token_ids=dictated)


@dataclass(frozen=True)
class SimulatedModel:
    """The core's `ModelStandIn`: the few facts of a model the core needs, and the simulated runner."""

    cost_model: StepCostModel
    clock: AdvancingClock
    vocab_size: int
    max_model_len: int
    kv_bytes_per_token: int

    @property
    def eos_token_id(self) -> int:
        return self.vocab_size - 1

    @property
    def filler_token_id(self) -> int:
        return self.vocab_size - 2

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def make_runner(self, num_blocks: int, block_size: int) -> SimulatedRunner:  # type: ignore[override]
        return SimulatedRunner(self.cost_model, self.clock, num_blocks, block_size, self.vocab_size,
                               self.eos_token_id, self.filler_token_id)


def sim_core(config: EngineConfig, cost_model: StepCostModel, clock: AdvancingClock, *, vocab_size: int,
             max_model_len: int, kv_bytes_per_token: int, observers: Sequence[Observes] = ()) -> EngineCore:
    """An `EngineCore` with the simulated runner: the real scheduler, KV cache and sampler, no model.

    `vocab_size` must exceed every prompt token id by 2: the top two ids are the filler and EOS tokens.
    """
    if vocab_size < 3:
        raise ValueError("the simulated vocabulary needs at least 3 tokens (prompt ids, filler, EOS)")
    model = SimulatedModel(cost_model, clock, vocab_size, max_model_len, kv_bytes_per_token)
    return EngineCore(config, clock=clock, observers=observers, stand_in=model)
