"""The engine core's decisions, pinned: a seeded trace through the simulated engine must reproduce, step for
step, the records recorded before the scheduler and KV cache were optimised for speed (issue 13, item 6).

Every policy runs a trace built to reach the hard paths: a small KV pool (preemption by recompute, resumes
that recompute in chunks), shared prefixes (prefix hits), prompts longer than a step's budget and a
long-prefill threshold (chunked prefill), a waiting queue tens of requests long, priorities, users, aborts
between steps, and KV events. The digest covers every field of every `StepRecord` (but `kv_ns`, which is
wall time), every output, and every KV event batch; the time stamps are the virtual clock's, so they are
exact. A change that alters any decision changes the digest: if it is meant to, re-record the digests with
`python tests/sim/test_schedule_digest.py` and say why in the commit.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import random
import sys
from typing import Any

import pytest

from tokenloop.bench.replay import VirtualClock, greedy_params
from tokenloop.llm import build_engine_config
from tokenloop.observe.records import EngineObserver, StepRecord
from tokenloop.sim.cost import StepCostModel
from tokenloop.sim.engine import SimulatedEngine

COST = StepCostModel(step=0.004, tokens=0.0001, kv_read_tokens=2e-7, prefill_attn=1e-9, sampled_rows=2e-5,
                     seqs=1e-5)
VOCAB = 512
POLICIES = ("fcfs", "priority", "sjf", "fair")
SETTINGS = {
    # Long prefills off (threshold 0): the first request in line may take a whole step's budget.
    "plain": {"long_prefill_token_threshold": 0},
    # A threshold below the budget: a long prefill gets 12 tokens first, then what the others left.
    "threshold+events": {"long_prefill_token_threshold": 12, "enable_kv_events": True},
    # The defaults: half the budget for a long prefill first, one long prefill at a time (issue 28).
    "defaults": {},
}

# "plain" recorded on main before the speed work (commit 899da89); see the module docstring. The others
# re-recorded when long prefills became a share first, the budget left last (issue 28).
DIGESTS = {
    ('fcfs', 'plain'): '1319ed552950de68a0365838e7ca02d918e3ba75f08bcb80bb38b27b117f0b46',
    ('priority', 'plain'): 'b46e7777d20c7fcf0e7061dcf77ab8d91ef36847397b5a1b86132d500baa2b7e',
    ('sjf', 'plain'): '66cf2d2d640a4e6757db9d64cba308f0c90cb95e1f751de0bf83d27e8108c82f',
    ('fair', 'plain'): '3547d0c86eb4ea4d1f789a6d78640dee3b59e98fe65b9c453a3810e380605a77',
    ('fcfs', 'threshold+events'): 'd56f7a9acde052ee19e2e5d73d380c35843bed6597638b5cde98cde8c4ee94f2',
    ('priority', 'threshold+events'): 'e137c1dd579952fa918ad67535a3f7ca137a3b591fcc6c292114a127e6e91c43',
    ('sjf', 'threshold+events'): 'ea45eb043c253b48fd4ec529090d1c9b8dec7171522e0702fb89a480e25fc2ca',
    ('fair', 'threshold+events'): '6964748fcedecd51896807845cfbdc50203bb688de877ddf6fba7c8bceacab65',
    ('fcfs', 'defaults'): '216dd0d55a2c5d76bf7488dce71a1c3c3d0a633b2ef3111b93415ae8c0b68dd6',
    ('priority', 'defaults'): '09d26a028693d133a598bd0e577cec8ad522dbb5c366dbb7deaefedf601480c3',
    ('sjf', 'defaults'): '6e8590a06efeb1bf5197cb3549209a2eb71acf5023e7c12816d9dd41430b850b',
    ('fair', 'defaults'): '716015807b92903773775e01575b971defbb89680757e8300b7eb082d376d3da',
}


@dataclasses.dataclass
class Trace:
    arrival_ns: list[int]
    prompts: list[list[int]]
    max_tokens: list[int]
    priorities: list[int]
    users: list[str | None]


def make_trace(seed: int = 13, n: int = 160) -> Trace:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB - 2) for _ in range(rng.randrange(8, 24))] for _ in range(3)]
    trace = Trace([], [], [], [], [])
    t = 0
    for i in range(n):
        # Bursts (a long waiting queue) and lulls (the engine drains and idles).
        t += rng.choice((0, 1_000_000, 3_000_000)) if i % 40 < 30 else rng.choice((50_000_000, 200_000_000))
        own = [rng.randrange(1, VOCAB - 2) for _ in range(rng.choice((1, 3, 9, 20, 45, 90)))]
        prompt = (rng.choice(prefixes) + own) if rng.random() < 0.45 else own
        trace.arrival_ns.append(t)
        trace.prompts.append(prompt)
        trace.max_tokens.append(rng.choice((1, 2, 5, 12, 30, 60)))
        trace.priorities.append(rng.choice((-1, 0, 0, 1, 3)))
        trace.users.append(rng.choice(("ann", "bob", "cy", None)))
    return trace


class Keep(EngineObserver):
    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)


def run(policy: str, setting: str, trace: Trace) -> tuple[list[Any], Keep, SimulatedEngine]:
    """Replay `trace`; returns what the loop produced, step by step (the records are in `Keep`)."""
    clock = VirtualClock()
    options = {"block_size": 4, "num_blocks": 40, "max_num_seqs": 6, "max_num_batched_tokens": 32,
               "policy": policy, "priority_aging_per_s": 2.0, "sjf_aging_tokens_per_s": 50.0,
               **SETTINGS[setting]}
    engine = SimulatedEngine(build_engine_config("simulated", **options), COST, clock, vocab_size=VOCAB,
                             max_model_len=160, kv_bytes_per_token=1024)
    keep = Keep()
    engine.add_observer(keep)
    produced: list[Any] = []
    next_arrival = 0
    steps = 0
    while next_arrival < len(trace.arrival_ns) or engine.core.has_unfinished_requests():
        while next_arrival < len(trace.arrival_ns) and trace.arrival_ns[next_arrival] <= clock():
            i = next_arrival
            engine.add_request(f"r{i}", None, greedy_params(trace.max_tokens[i]),
                               prompt_token_ids=trace.prompts[i], priority=trace.priorities[i],
                               user=trace.users[i], arrival_ns=trace.arrival_ns[i])
            next_arrival += 1
        if not engine.core.has_unfinished_requests():
            clock.advance_to(trace.arrival_ns[next_arrival])
            continue
        steps += 1
        if steps % 23 == 0:  # an abort between steps: the oldest unfinished request, waiting or running
            victim = min(engine.core._requests)  # any deterministic pick will do
            produced.append(("abort", as_recorded(engine.core.finish_requests([victim]))))
            if not engine.core.has_unfinished_requests():
                continue
        outs, finished = engine.step_outputs()
        produced.append((as_recorded(outs.outputs), outs.num_scheduled, outs.timestamp_ns,
                         _EventsAsRecorded(outs.kv_events), finished_as_recorded(finished)))
        if outs.num_scheduled == 0:
            assert next_arrival < len(trace.arrival_ns), "the engine holds requests but schedules none"
            clock.advance_to(trace.arrival_ns[next_arrival])
    return produced, keep, engine


# Record fields added after the digests were recorded, with the value they have in this trace (no speculative
# decoding): left out of the digest, so that it still compares the decisions rather than the record's shape.
LATER_FIELDS = {"num_draft_tokens": 0, "num_accepted_tokens": 0}
# The same for the outputs: the field to blame for a request's own failure (issue 34), None here.
LATER_OUTPUT_FIELDS = {"error_param": None}


def _plain(value: Any) -> Any:
    """Finish reasons and statuses became str enums (issue 31): the digest reads them as the strings they
    equal, as they were recorded."""
    return value.value if isinstance(value, enum.Enum) else value


class _AsRecorded:
    """An output whose repr is the one it had when the digests were recorded."""

    def __init__(self, output: Any) -> None:
        self.output = output

    def __repr__(self) -> str:
        output = self.output
        values = {f.name: _plain(getattr(output, f.name)) for f in dataclasses.fields(output) if f.repr}
        for name, value in LATER_OUTPUT_FIELDS.items():
            assert values.pop(name) == value, f"{name} is no longer {value} in the digest's trace"
        return f"{type(output).__qualname__}({', '.join(f'{k}={v!r}' for k, v in values.items())})"


class _EventsAsRecorded:
    """A step's KV events with the repr they had when the digests were recorded: before events named their
    KV group (docs/kv-groups.md), which is 0 for every event of this one-group model, and before a stored
    block named its LoRA adapter (None: this trace runs none)."""

    def __init__(self, events: Any) -> None:
        self.events = events

    def __repr__(self) -> str:
        text = repr(self.events).replace(", lora_name=None)", ")").replace(", group=0)", ")")
        assert "lora_name=" not in text, "an event of a trace without adapters names one"
        assert "group=" not in text, "an event of a one-group model names a group other than 0"
        return text


def as_recorded(outputs: list[Any]) -> list[_AsRecorded]:
    return [_AsRecorded(output) for output in outputs]


def finished_as_recorded(finished: list[Any]) -> list[Any]:
    """Finished requests with their completions' finish reasons as recorded (strings)."""
    return [dataclasses.replace(o, outputs=[dataclasses.replace(c, finish_reason=_plain(c.finish_reason))
                                            for c in o.outputs]) for o in finished]


def record_repr(record: StepRecord) -> str:
    """The record's dataclass repr as it was when the digests were recorded (`kv_ns` zeroed)."""
    values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.repr}
    values["kv_ns"] = 0
    values["releases"] = [dataclasses.replace(r, status=_plain(r.status), finish_reason=_plain(r.finish_reason))
                          for r in record.releases]
    for name, value in LATER_FIELDS.items():
        assert values.pop(name) == value, f"{name} is no longer {value} in the digest's trace"
    return f"{type(record).__qualname__}({', '.join(f'{k}={v!r}' for k, v in values.items())})"


def digest(produced: list[Any], records: list[StepRecord]) -> str:
    h = hashlib.sha256()
    h.update(repr(produced).encode())
    for record in records:
        h.update(record_repr(record).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def trace() -> Trace:
    return make_trace()


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("policy", POLICIES)
def test_the_step_records_of_a_fixed_trace_are_unchanged(trace: Trace, policy: str, setting: str) -> None:
    produced, keep, engine = run(policy, setting, trace)
    chunks = [c for r in keep.records for c in r.scheduled]
    # The trace reaches the paths the digest is meant to pin down.
    assert sum(len(r.preempted) for r in keep.records) >= 3
    assert any(c.prefix_hit_tokens for c in chunks)
    assert any(0 < c.start < c.num_prompt_tokens for c in chunks)  # a prefill continued over steps
    assert max(r.gauges.num_waiting for r in keep.records) >= 20
    assert any(item[0] == "abort" and item[1] for item in produced)
    assert not engine.core.has_unfinished_requests()
    engine.kv_cache.check_invariants([])
    assert digest(produced, keep.records) == DIGESTS[(policy, setting)]


if __name__ == "__main__":  # print the digests to record
    recorded = make_trace()
    for key in DIGESTS:
        produced, keep, _ = run(*key, recorded)
        print(f"    {key!r}: {digest(produced, keep.records)!r},", file=sys.stdout)
