"""Request handoff between two engine cores (tokenloop.core.handoff), in-process on the tiny model.

The oracle: a request run k steps on A, exported, imported on B, acknowledged, and finished on B yields the
tokens of the same request run alone on one engine, greedy or seeded, whatever B held already, whatever
the chunking, and whether or not one side preempts it around the copy. Every protocol stage can be
aborted without leaking a block on either side; a nack or an expired lease resumes the request on A.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloop.core import wire
from tokenloop.core.core_loop import CoreLoop
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.handoff import ImportResult, KVSnapshot
from tokenloop.core.kv_events import KVIndexMirror
from tokenloop.core.messages import CoreRequest, UtilityCall
from tokenloop.errors import InvalidRequestError
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.records import EngineObserver, ReleaseInfo
from tokenloop.request import RequestStatus, SamplingParams
from tokenloop.structured import StructuredOutputsParams

BLOCK = 4
RID = "handed"


class FakeClock:
    """An integer-ns clock that moves only when told (and 1 ns per read, so stamps stay ordered)."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        self.now += 1
        return self.now


def _core(tiny: Checkpoint, clock: FakeClock | None = None, **options: object) -> EngineCore:
    # fp32: greedy tokens are exact whatever the chunking or batch (dtype auto picks bf16 on a CPU with
    # AVX512-BF16, where the tiny random model's near-ties break one way or the other: hypothesis found one
    # with a prefix hit on B after a preemption on A).
    settings_ = {"block_size": BLOCK, "num_blocks": 40, "max_num_seqs": 4, "max_num_batched_tokens": 32,
                 "enable_kv_events": True, "dtype": "float32"}
    settings_.update(options)
    config = build_engine_config(str(tiny.path), **settings_)
    return EngineCore(config, checkpoint=tiny, **({"clock": clock} if clock is not None else {}))


def _params(seeded: bool, max_tokens: int = 10) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=1.0, seed=1234, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def _step(core: EngineCore, tokens: dict[str, list[int]], finished: dict[str, str] | None = None) -> None:
    for out in core.step().outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished and finished is not None:
            finished[out.request_id] = out.finish_reason or ""


def _drain(core: EngineCore, tokens: dict[str, list[int]], finished: dict[str, str] | None = None) -> None:
    for _ in range(500):
        if not core.has_unfinished_requests():
            return
        _step(core, tokens, finished)
    raise AssertionError("the core never finished its requests")


_REFERENCE: dict[tuple[tuple[int, ...], bool, int], list[int]] = {}


def _reference(tiny: Checkpoint, prompt: list[int], seeded: bool, max_tokens: int = 10) -> list[int]:
    """The request alone on a roomy engine: what any handoff must reproduce."""
    key = (tuple(prompt), seeded, max_tokens)
    if key not in _REFERENCE:
        core = _core(tiny)
        core.add_requests([CoreRequest(RID, prompt, _params(seeded, max_tokens), 0)])
        tokens: dict[str, list[int]] = {}
        _drain(core, tokens)
        _REFERENCE[key] = tokens[RID]
    return _REFERENCE[key]


def _assert_clean(*cores: EngineCore) -> None:
    for core in cores:
        assert not core.has_unfinished_requests()
        core.kv_cache.check_invariants([])
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def _assert_events_mirror(core: EngineCore, tokens: dict[str, list[int]]) -> None:
    _step(core, tokens)  # flushes what happened since the last step into a batch
    mirror = KVIndexMirror()
    for batch in core.kv_events_since(0) or []:
        assert mirror.apply(batch)
    assert mirror.hashes == set(_cached_hashes(core))


def _cached_hashes(core: EngineCore) -> list[int]:
    """What a router's mirror of `core` holds: the skip list for a handoff to it."""
    return [block_hash for block_hash, _ in core.kv_cache.pool.cached_items()]


def _run_on_a(tiny: Checkpoint, prompt: list[int], seeded: bool, steps: int, max_tokens: int = 10,
              **options: object) -> tuple[EngineCore, dict[str, list[int]]]:
    a = _core(tiny, **options)
    a.add_requests([CoreRequest(RID, prompt, _params(seeded, max_tokens), 0)])
    tokens: dict[str, list[int]] = {}
    for _ in range(steps):
        request = a._requests[RID]
        if request.num_output_tokens >= max_tokens - 1:
            break  # one more step would finish it: keep something to hand off
        _step(a, tokens)
    return a, tokens


# ---- the oracle --------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(length=st.integers(1, 14), seed=st.integers(0, 10_000), seeded=st.booleans(),
       steps=st.integers(0, 9), budget=st.sampled_from([3, 4, 7, 32]), warm=st.integers(0, 14),
       warm_live=st.booleans(), skip_cached=st.booleans(), preempt=st.sampled_from(["none", "A", "B"]))
def test_handoff_continues_with_identical_tokens(tiny: Checkpoint, length: int, seed: int, seeded: bool,
                                                 steps: int, budget: int, warm: int, warm_live: bool,
                                                 skip_cached: bool, preempt: str) -> None:
    vocab = tiny.config.vocab_size
    prompt = _prompt(length, seed, vocab)
    expected = _reference(tiny, prompt, seeded)
    # A small pool and a higher-priority competitor make the chosen side preempt the handed request.
    squeeze = {"num_blocks": 12, "policy": "priority"}
    a_options: dict[str, object] = dict(max_num_batched_tokens=budget, **(squeeze if preempt == "A" else {}))
    a = _core(tiny, **a_options)
    a.add_requests([CoreRequest(RID, prompt, _params(seeded), 0)])
    if preempt == "A":
        rival = CoreRequest("rival-a", _prompt(8, seed + 1, vocab), _params(False, 30), 0, priority=-1)
        a.add_requests([rival])
    tokens: dict[str, list[int]] = {}
    for _ in range(steps):
        if a._requests[RID].num_output_tokens >= 9:
            break
        _step(a, tokens)
    b = _core(tiny, max_num_batched_tokens=max(3, 32 - budget), **(squeeze if preempt == "B" else {}))
    if warm:  # B already holds a prefix of the prompt (full blocks of its first `warm` tokens)
        b.add_requests([CoreRequest("warm", prompt[:warm], _params(False, 6 if warm_live else 1), 0)])
        if warm_live:  # still running there: the handed request shares its blocks
            _step(b, {})
        else:
            _drain(b, {})
    if preempt == "B":
        rival = CoreRequest("rival-b", _prompt(8, seed + 2, vocab), _params(False, 30), 0, priority=-1)
        b.add_requests([rival])
        _step(b, {})
    before = list(tokens.get(RID, []))
    snapshot = a.export_request(RID, _cached_hashes(b) if skip_cached else [])
    _step(a, tokens)  # A keeps serving the others; the exporting request gets nothing
    assert tokens.get(RID, []) == before
    result = b.import_request(snapshot)
    assert result.accepted, result.reason
    assert a.complete_export(snapshot.lease_id)
    _drain(a, tokens)
    assert tokens.get(RID, []) == before, "the source sends nothing more for a handed-off request"
    moved: dict[str, list[int]] = {}
    _drain(b, moved)
    assert before + moved[RID] == expected
    _assert_clean(a, b)
    if preempt != "A":  # released, not evicted: the exported blocks are still cached on A
        assert all(a.kv_cache.pool.lookup(h) is not None for h in snapshot.block_hashes)


def test_preemption_on_either_side_around_the_copy(tiny: Checkpoint) -> None:
    """The squeezed side really preempts, and the tokens are still the reference's."""
    vocab = tiny.config.vocab_size
    prompt = _prompt(12, 7, vocab)
    expected = _reference(tiny, prompt, True)
    for side in ("A", "B"):
        squeeze = {"num_blocks": 12, "policy": "priority", "max_num_batched_tokens": 8}
        a = _core(tiny, **(squeeze if side == "A" else {}))
        a.add_requests([CoreRequest(RID, prompt, _params(True), 0)])
        tokens: dict[str, list[int]] = {}
        for _ in range(4):
            _step(a, tokens)
        rival = CoreRequest("rival", _prompt(36, 8, vocab), _params(False, 8), 0, priority=-1)
        if side == "A":
            a.add_requests([rival])
            for _ in range(20):  # the rival outranks it: the handed request is preempted on A
                if a.stats().num_preemptions:
                    break
                _step(a, tokens)
            assert a._requests[RID].status is RequestStatus.PREEMPTED
        b = _core(tiny, **(squeeze if side == "B" else {}))
        if side == "B":
            b.add_requests([rival])
            _step(b, {})
        snapshot = a.export_request(RID)
        assert b.import_request(snapshot).accepted
        assert a.complete_export(snapshot.lease_id)
        moved: dict[str, list[int]] = {}
        _drain(a, tokens)
        _drain(b, moved)
        assert (a if side == "A" else b).stats().num_preemptions > 0, side
        assert tokens[RID] + moved[RID] == expected, side
        _assert_clean(a, b)


def test_import_matches_copies_and_recomputes_what_is_missing(tiny: Checkpoint) -> None:
    vocab = tiny.config.vocab_size
    prompt = _prompt(14, 3, vocab)
    expected = _reference(tiny, prompt, False)
    a, tokens = _run_on_a(tiny, prompt, False, 4)
    computed = a._requests[RID].num_computed_tokens
    b = _core(tiny)
    b.add_requests([CoreRequest("warm", prompt[:9], _params(False, 1), 0)])  # 2 full blocks of the prompt
    _drain(b, {})
    snapshot = a.export_request(RID, _cached_hashes(b))
    result = b.import_request(snapshot)
    assert result.accepted and result.num_blocks_matched == 2
    assert result.num_blocks_copied == len(snapshot.blocks) == -(-computed // BLOCK) - 2
    assert result.num_tokens_recomputed == 0 and result.bytes_copied > 0
    assert b._requests[RID].status is RequestStatus.RUNNING
    moved: dict[str, list[int]] = {}
    _assert_events_mirror(b, moved)  # copied blocks were announced as stored
    assert a.complete_export(snapshot.lease_id)
    _drain(b, moved)
    assert tokens[RID] + moved[RID] == expected
    _drain(a, {})
    _assert_clean(a, b)

    # Skipped blocks that B has lost meanwhile (evicted by other work): B recomputes from what it has.
    a, tokens = _run_on_a(tiny, prompt, False, 4)
    b = _core(tiny, num_blocks=8)
    b.add_requests([CoreRequest("warm", prompt[:9], _params(False, 1), 0)])
    _drain(b, {})
    snapshot = a.export_request(RID, _cached_hashes(b))
    b.add_requests([CoreRequest("evictor", _prompt(28, 4, vocab), _params(False, 4), 0)])
    _drain(b, {})
    assert not any(b.kv_cache.pool.lookup(h) for h in snapshot.block_hashes[:2])
    result = b.import_request(snapshot)
    assert result.accepted and result.num_tokens_recomputed == computed
    assert b._requests[RID].status is RequestStatus.WAITING
    assert a.complete_export(snapshot.lease_id)
    moved = {}
    _drain(b, moved)
    assert tokens[RID] + moved[RID] == expected
    _drain(a, {})
    _assert_clean(a, b)


# ---- the lease: abort at every stage, nack, expiry ------------------------------------------------------

@pytest.mark.parametrize("stage", ["exported", "imported", "acknowledged"])
def test_abort_at_every_stage_leaks_nothing(tiny: Checkpoint, stage: str) -> None:
    prompt = _prompt(10, 11, tiny.config.vocab_size)
    a, _tokens = _run_on_a(tiny, prompt, True, 3)
    b = _core(tiny)
    snapshot = a.export_request(RID)
    finals = []
    if stage == "exported":
        finals = a.finish_requests([RID])
        assert not a.complete_export(snapshot.lease_id) and not a.resume_export(snapshot.lease_id)
    elif stage == "imported":
        assert b.import_request(snapshot).accepted
        finals = a.finish_requests([RID]) + b.finish_requests([RID])
        assert not a.complete_export(snapshot.lease_id)
    else:
        assert b.import_request(snapshot).accepted
        assert a.complete_export(snapshot.lease_id)
        _step(b, {})
        finals = b.finish_requests([RID])
        assert not a.finish_requests([RID]), "A no longer knows the request"
    assert finals and all(f.finish_reason == "abort" for f in finals)
    _drain(a, {})
    _drain(b, {})
    _assert_clean(a, b)


def test_nack_resumes_on_the_source_with_identical_tokens(tiny: Checkpoint) -> None:
    prompt = _prompt(9, 5, tiny.config.vocab_size)
    expected = _reference(tiny, prompt, True)
    a, tokens = _run_on_a(tiny, prompt, True, 3)
    snapshot = a.export_request(RID)
    with pytest.raises(InvalidRequestError, match="already being exported"):
        a.export_request(RID)
    assert a.resume_export(snapshot.lease_id)
    assert not a.resume_export(snapshot.lease_id) and not a.complete_export(snapshot.lease_id)
    _drain(a, tokens)
    assert tokens[RID] == expected
    _assert_clean(a)


def test_lease_expiry_resumes_on_the_source(tiny: Checkpoint) -> None:
    prompt = _prompt(9, 6, tiny.config.vocab_size)
    expected = _reference(tiny, prompt, False)
    clock = FakeClock()
    a = _core(tiny, clock)
    a.add_requests([CoreRequest(RID, prompt, _params(False), 0)])
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        _step(a, tokens)
    snapshot = a.export_request(RID, lease_s=1.0)
    assert snapshot.lease_expires_ns > clock.now
    before = list(tokens[RID])
    _step(a, tokens)  # not yet expired: still paused
    assert tokens[RID] == before and a._requests[RID].status is RequestStatus.EXPORTING
    clock.now = snapshot.lease_expires_ns
    _drain(a, tokens)
    assert tokens[RID] == expected
    assert not a.complete_export(snapshot.lease_id), "an expired lease cannot be acknowledged"
    _assert_clean(a)


def test_unknown_ids_raise(tiny: Checkpoint) -> None:
    a = _core(tiny)
    with pytest.raises(InvalidRequestError, match="not unfinished"):
        a.export_request("nobody")
    with pytest.raises(InvalidRequestError, match="not unfinished"):
        a.precopy_blocks("nobody")
    assert not a.complete_export("nobody#1") and not a.resume_export("nobody#1")
    a.add_requests([CoreRequest(RID, [1, 2, 3], _params(False), 0)])
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidRequestError, match="lease_s"):
            a.export_request(RID, lease_s=bad)
    assert a._requests[RID].status is RequestStatus.WAITING, "a refused export leaves it where it was"
    a.finish_requests([RID])
    _assert_clean(a)


# ---- refusals --------------------------------------------------------------------------------------------

def test_refusals_name_the_reason_and_the_request_resumes_on_a(tiny: Checkpoint) -> None:
    vocab = tiny.config.vocab_size
    prompt = _prompt(10, 9, vocab)
    expected = _reference(tiny, prompt, True)
    full = _core(tiny, num_blocks=10)
    full.add_requests([CoreRequest("hog", _prompt(32, 1, vocab), _params(False, 4), 0)])
    _step(full, {})  # the hog holds 8 of 10 blocks
    duplicate = _core(tiny)
    duplicate.add_requests([CoreRequest(RID, prompt, _params(False), 0)])
    cases = [(_core(tiny, block_size=8), "other block size"), (full, "no room"),
             (_core(tiny, num_blocks=4), "no room"), (duplicate, "duplicate id")]
    for b, reason in cases:
        a, tokens = _run_on_a(tiny, prompt, True, 4)
        snapshot = a.export_request(RID)
        result = b.import_request(snapshot)
        assert not result.accepted and result.reason is not None and reason in result.reason, result.reason
        assert a.resume_export(snapshot.lease_id)
        _drain(a, tokens)
        assert tokens[RID] == expected
        _assert_clean(a)
        b.finish_requests(list(b._requests))
        _assert_clean(b)
    # Other model, other KV layout: refused naming both sides.
    a, tokens = _run_on_a(tiny, prompt, True, 4)
    snapshot = a.export_request(RID)
    b = _core(tiny)
    mismatches = (("model", "another-model", "model"), ("kv_layout", "float16:2x2x16", "layout"))
    for field_, value, name in mismatches:
        changed = wire.decode(wire.encode(snapshot))
        setattr(changed, field_, value)
        result = b.import_request(changed)
        assert not result.accepted and name in (result.reason or "") and value in (result.reason or "")
    changed = wire.decode(wire.encode(snapshot))
    changed.request.output_token_ids.append(vocab + 5)
    assert "vocabulary" in (b.import_request(changed).reason or "")
    assert a.resume_export(snapshot.lease_id)
    _drain(a, tokens)
    assert tokens[RID] == expected
    _assert_clean(a, b)


def test_engines_with_other_kv_cache_dtypes_refuse_a_handoff_naming_both(tiny: Checkpoint) -> None:
    """fp32 K/V bytes cannot be read as bf16 ones (nor the reverse): refused, both dtypes named; the request
    resumes on its source with the tokens it would have had."""
    vocab = tiny.config.vocab_size
    prompt = _prompt(10, 9, vocab)
    for here, there in (("float32", "bfloat16"), ("bfloat16", "float32")):
        alone = _core(tiny, dtype="float32", kv_cache_dtype=here)
        alone.add_requests([CoreRequest(RID, prompt, _params(True), 0)])
        expected: dict[str, list[int]] = {}
        _drain(alone, expected)
        a, tokens = _run_on_a(tiny, prompt, True, 4, dtype="float32", kv_cache_dtype=here)
        b = _core(tiny, dtype="float32", kv_cache_dtype=there)
        snapshot = a.export_request(RID)
        result = b.import_request(snapshot)
        assert not result.accepted and "KV layout" in (result.reason or "")
        assert f"{here}:2x2x16" in (result.reason or "") and f"{there}:2x2x16" in (result.reason or "")
        assert a.resume_export(snapshot.lease_id)
        _drain(a, tokens)
        assert tokens[RID] == expected[RID]
        _assert_clean(a, b)


# ---- live migration: pre-copy, then the tail ------------------------------------------------------------

def test_precopy_then_final_export_copies_only_the_tail(tiny: Checkpoint) -> None:
    prompt = _prompt(21, 13, tiny.config.vocab_size)
    expected = _reference(tiny, prompt, True, 16)
    a, tokens = _run_on_a(tiny, prompt, True, 2, max_tokens=16)
    b = _core(tiny)
    computed = a._requests[RID].num_computed_tokens
    first = a.precopy_blocks(RID, max_blocks=1)  # in stages: each stage reads at most max_blocks
    rest = a.precopy_blocks(RID, [first[0].block_hash])
    pre = first + rest
    assert len(first) == 1 and rest[0].parent_hash == first[0].block_hash
    with pytest.raises(InvalidRequestError, match="max_blocks"):
        a.precopy_blocks(RID, max_blocks=0)
    assert len(pre) == computed // BLOCK and all(blk.block_hash is not None for blk in pre)
    assert a._requests[RID].status is RequestStatus.RUNNING, "pre-copy does not pause"
    assert b.import_blocks(pre) == len(pre)
    assert b.import_blocks(pre) == 0, "already there"
    _assert_clean(b)  # stored unreferenced: cached and reusable
    for _ in range(6):  # decoding goes on meanwhile; full blocks never change, so no dirty tracking
        _step(a, tokens)
    computed = a._requests[RID].num_computed_tokens
    snapshot = a.export_request(RID, [blk.block_hash for blk in pre])
    tail_full = computed // BLOCK - len(pre)
    partial = 1 if computed % BLOCK else 0
    assert len(snapshot.blocks) == tail_full + partial
    result = b.import_request(snapshot)
    assert result.accepted and result.num_blocks_matched == len(pre)
    assert result.num_blocks_copied == tail_full + partial
    assert a.complete_export(snapshot.lease_id)
    moved: dict[str, list[int]] = {}
    _drain(b, moved)
    assert tokens[RID] + moved[RID] == expected
    _drain(a, {})
    _assert_clean(a, b)


# ---- across the process boundary --------------------------------------------------------------------------

def test_snapshot_crosses_the_wire(tiny: Checkpoint) -> None:
    prompt = _prompt(11, 21, tiny.config.vocab_size)
    a, _ = _run_on_a(tiny, prompt, True, 3)
    snapshot = a.export_request(RID)
    assert snapshot.blocks and snapshot.request.generator_state
    again = wire.decode(wire.encode(snapshot))
    assert isinstance(again, KVSnapshot) and again == snapshot
    result = ImportResult(RID, False, "no room", 1, 2, 3, 4)
    assert wire.decode(wire.encode(result)) == result


def _call(loop: CoreLoop, tokens: dict[str, list[int]], name: str, *args: object) -> object:
    """One utility call through a CoreLoop (a turn: it steps too), the call and its frame through the wire."""
    loop.apply(wire.decode(wire.encode(UtilityCall(1, name, list(args)))))
    frame = loop.turn()
    assert frame is not None
    frame = wire.decode(wire.encode(frame))
    for out in frame.outputs.outputs if frame.outputs is not None else []:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    (result,) = frame.results
    assert result.error is None, result.error
    return result.value


def test_utilities_through_core_loops(tiny: Checkpoint) -> None:
    prompt = _prompt(13, 17, tiny.config.vocab_size)
    expected = _reference(tiny, prompt, False)
    a, tokens = _run_on_a(tiny, prompt, False, 3)
    b = _core(tiny)
    loop_a, loop_b = CoreLoop(a), CoreLoop(b)
    moved: dict[str, list[int]] = {}
    pre = _call(loop_a, tokens, "precopy_blocks", RID, [])
    assert isinstance(pre, list) and pre
    assert _call(loop_b, moved, "import_blocks", pre) == len(pre)
    snapshot = _call(loop_a, tokens, "export_request", RID, [blk.block_hash for blk in pre], 30.0)
    assert isinstance(snapshot, KVSnapshot)
    result = _call(loop_b, moved, "import_request", snapshot)
    assert isinstance(result, ImportResult) and result.accepted and result.num_blocks_matched == len(pre)
    assert _call(loop_a, tokens, "complete_export", snapshot.lease_id) is True
    assert _call(loop_a, tokens, "resume_export", snapshot.lease_id) is False
    _drain(b, moved)
    assert tokens[RID] + moved[RID] == expected
    _drain(a, {})
    _assert_clean(a, b)


# ---- what the request carries ----------------------------------------------------------------------------

def test_a_constrained_request_rebuilds_its_matcher_on_the_destination(tiny: Checkpoint) -> None:
    regex = r"[a-z]{2,6}-[0-9]{1,3}"
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    prompt = tiny.tokenizer.encode("the quick brown fox")
    alone = _core(tiny)
    alone.add_requests([CoreRequest(RID, prompt, params, 0)])
    expected: dict[str, list[int]] = {}
    _drain(alone, expected)
    a = _core(tiny)
    a.add_requests([CoreRequest(RID, prompt, params, 0)])
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        _step(a, tokens)
    b = _core(tiny)
    snapshot = wire.decode(wire.encode(a.export_request(RID)))  # the constraint crosses the wire too
    assert b.import_request(snapshot).accepted
    matcher = b._requests[RID].structured
    assert matcher is not None and matcher.num_accepted == len(tokens[RID])
    assert a.complete_export(snapshot.lease_id)
    finished: dict[str, str] = {}
    _drain(b, tokens, finished)
    assert tokens[RID] == expected[RID] and finished[RID] == "stop"
    assert re.fullmatch(regex, tiny.tokenizer.decode(tokens[RID]))
    _drain(a, {})
    _assert_clean(a, b)


class Releases(EngineObserver):
    def __init__(self) -> None:
        self.infos: list[ReleaseInfo] = []

    def on_release(self, records: list[ReleaseInfo]) -> None:
        self.infos.extend(records)


def test_times_rebase_and_salt_priority_and_fair_share_travel(tiny: Checkpoint) -> None:
    clock_a, clock_b = FakeClock(), FakeClock()
    clock_b.now = 10**12  # another engine's clock: only ages mean anything across
    releases = Releases()
    config = {"block_size": BLOCK, "num_blocks": 40, "enable_kv_events": True, "policy": "fair"}
    a = EngineCore(build_engine_config(str(tiny.path), **config), checkpoint=tiny, clock=clock_a,
                   observers=[releases])
    b = EngineCore(build_engine_config(str(tiny.path), **config), checkpoint=tiny, clock=clock_b)
    prompt = _prompt(10, 31, tiny.config.vocab_size)
    a.add_requests([CoreRequest(RID, prompt, _params(False), clock_a.now, priority=3, user="ann",
                                cache_salt="tenant-7")])
    for _ in range(4):
        clock_a.now += 1000
        _step(a, {})
    source = a._requests[RID]
    itls, ttft = source.times.itls_ns, source.times.ttft_ns
    charge = a.scheduler.policy.charge(source)
    assert charge > 0
    snapshot = a.export_request(RID)
    assert b.import_request(snapshot).accepted
    moved = b._requests[RID]
    assert (moved.priority, moved.user, moved.cache_salt) == (3, "ann", "tenant-7")
    assert moved.block_hashes[:2] == source.block_hashes[:2], "the salt keeps the hashes"
    assert moved.times.itls_ns == itls
    assert 0 <= clock_b.now - snapshot.request.age_ns - moved.times.arrival <= 5  # the clock ticks per read
    assert moved.times.ttft_ns is not None and abs(moved.times.ttft_ns - ttft) <= 2  # ns ticks of reads
    assert b.scheduler.policy.counter("ann") >= charge  # the user pays here for what it got there
    assert a.complete_export(snapshot.lease_id)
    (info,) = releases.infos
    assert info.request_id == RID and info.status == "handed_off" and info.finish_reason is None
    assert info.num_kept_cached == len(snapshot.block_hashes) and info.num_freed == 1  # the partial tail
    _drain(b, {})
    _assert_clean(a, b)


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"),
                                                  ("float32", "bfloat16")])
def test_runner_block_bytes_round_trip(tiny: Checkpoint, dtype: str, kv_cache_dtype: str) -> None:
    runner = _core(tiny, dtype=dtype, kv_cache_dtype=kv_cache_dtype).runner
    kv = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    assert runner.kv_layout == f"{kv}:2x2x16"  # the tiny model: 2 layers, 2 KV heads of 16
    assert runner.kv_bytes_per_token == 2 * 2 * 2 * 16 * (4 if kv == "float32" else 2)
    for key, value in runner.kv_caches:
        key[3].normal_()
        value[3].normal_()
    data = runner.read_block(3, BLOCK)
    assert len(data) == BLOCK * runner.kv_bytes_per_token
    runner.write_block(5, data, BLOCK)
    runner.write_block(6, runner.read_block(3, 2), 2)  # a partial tail: its first slots only
    for key, value in runner.kv_caches:
        assert torch.equal(key[5], key[3]) and torch.equal(value[5], value[3])
        assert torch.equal(key[6, :2], key[3, :2]) and not key[6, 2:].any()
