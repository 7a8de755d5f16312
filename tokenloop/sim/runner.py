"""SimulatedRunner: the model runner's interface with no model behind it.

Each `execute` prices the step with the cost model, moves the virtual clock on by that much, and returns
one-hot logits that make the real sampler (greedy argmax) pick the token the trace dictates: a filler
token until the request's last token, then EOS. The rest of the step (scheduler, KV cache, sampler,
update and its stop checks, release, records) is the engine core's own code.

`sim_core` builds an `EngineCore` around it without a checkpoint (the core's `stand_in` argument).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tokenloop.config import EngineConfig
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.scheduler import SchedulerOutput
from tokenloop.observe.records import Observes
from tokenloop.runner import RunnerOutput
from tokenloop.sim.cost import StepCostModel

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
        """The step's logits (one-hot on the dictated token per sampling row), its modelled time passed."""
        features = self.cost_model.features(output)
        cost_ns = self.cost_model.step_ns(features)
        self.clock.advance_by(cost_ns)
        self.modelled_ns += cost_ns
        bound = self.cost_model.critical_path(features)
        self.bound_ns[bound] += cost_ns
        self.bound_steps[bound] += 1
        indices = []
        eos_rows = []
        for i, item in enumerate(output.scheduled):
            if item.samples:
                request = item.request
                # The token sampled now is output number num_output_tokens + 1; the last one is EOS.
                if request.num_output_tokens + 1 >= (request.sampling_params.max_tokens or 1):
                    eos_rows.append(len(indices))
                indices.append(i)
        # One-hot rows, built in numpy and shared with torch (a filled column, a few EOS rows): the same
        # tensor as torch.zeros and two index assignments, at a fraction of their per-call overhead.
        logits = np.zeros((len(indices), self.vocab_size), dtype=np.float32)
        logits[:, self.filler_token_id] = 1.0
        logits[eos_rows, self.filler_token_id] = 0.0
        logits[eos_rows, self.eos_token_id] = 1.0
        return RunnerOutput(indices, torch.from_numpy(logits), forward_s=cost_ns / 1e9, weight_form=WEIGHT_FORM)


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
