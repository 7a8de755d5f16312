"""The simulator hands off too: no K/V tensors, so a snapshot carries block hashes and empty block data."""

from __future__ import annotations

from tokenloop.core.engine_core import EngineCore
from tokenloop.core.messages import CoreRequest
from tokenloop.llm import build_engine_config
from tokenloop.request import SamplingParams
from tokenloop.sim.cluster import ReplicaClock
from tokenloop.sim.cost import StepCostModel
from tokenloop.sim.runner import sim_core

COST = StepCostModel(step=0.010, tokens=0.0002)
VOCAB = 64


Clock = ReplicaClock  # a virtual clock the simulated runner moves on


def _core(clock: Clock) -> EngineCore:
    config = build_engine_config("simulated", block_size=4, num_blocks=32, enable_kv_events=True)
    return sim_core(config, COST, clock, vocab_size=VOCAB, max_model_len=128, kv_bytes_per_token=1024)


def _drain(core: EngineCore, tokens: list[int]) -> str | None:
    reason = None
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens.extend(out.new_token_ids)
            reason = out.finish_reason or reason
    return reason


def test_simulated_cores_hand_a_request_off() -> None:
    clock_a, clock_b = Clock(), Clock()
    a, b = _core(clock_a), _core(clock_b)
    clock_b.advance_by(5_000_000_000)  # another engine, another clock: times rebase as ages
    prompt = list(range(1, 19))
    a.add_requests([CoreRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=12), 0)])
    tokens: list[int] = []
    for _ in range(4):
        for out in a.step().outputs:
            tokens.extend(out.new_token_ids)
    pre = a.precopy_blocks("r")
    assert pre and all(block.data == b"" for block in pre)
    assert b.import_blocks(pre) == len(pre)
    snapshot = a.export_request("r", [block.block_hash for block in pre])
    age = snapshot.request.age_ns
    result = b.import_request(snapshot)
    assert result.accepted and result.num_blocks_matched == len(pre) and result.bytes_copied == 0
    assert a.complete_export(snapshot.lease_id)
    moved = b._requests["r"]
    assert moved.times.arrival == clock_b.now - age
    assert _drain(b, tokens) == "stop"  # its last token is EOS, as without a handoff
    assert len(tokens) == 12 and tokens[-1] == VOCAB - 1 and set(tokens[:-1]) == {VOCAB - 2}
    for core in (a, b):
        core.kv_cache.check_invariants([])
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
