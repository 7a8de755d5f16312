"""n-gram prompt lookup: the proposer against a plain scan, acceptance, eligibility, config and CLI flags,
and how the scheduler hands out drafts (leftover budget and free blocks only)."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloop.cli.options import _engine_options, add_engine_args
from tokenloop.config import SchedulerConfig, SpeculativeConfig
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.ngram import NgramIndex
from tokenloop.core.scheduler import Scheduler
from tokenloop.core.speculative import (
    NgramProposer,
    accept_greedy,
    can_speculate,
    propose_ngram_reference,
)
from tokenloop.errors import ConfigError
from tokenloop.llm import build_engine_config
from tokenloop.request import Request, RequestStatus, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
SHORT = SamplingParams(temperature=0.0, max_tokens=8)  # fits the small pools below


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), k=st.integers(1, 6),
       min_n=st.integers(1, 3), extra=st.integers(0, 3), steps=st.lists(st.integers(1, 5), max_size=8))
def test_incremental_index_proposes_what_a_plain_scan_finds(tokens: list[int], k: int, min_n: int, extra: int,
                                                            steps: list[int]) -> None:
    """The index grows with the sequence (as a request's does, several tokens a step); every proposal
    equals the latest earlier occurrence of the longest matching suffix, found by brute force."""
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    seq = list(tokens)
    assert index.propose(seq, k) == propose_ngram_reference(seq, k, min_n, max_n)
    for i, grow in enumerate(steps):
        seq.extend((i * 7 + j) % 5 for j in range(grow))
        assert index.propose(seq, k) == propose_ngram_reference(seq, k, min_n, max_n)


def test_reference_scan_examples() -> None:
    # The latest earlier "1 2" is at 3..4, followed by 9 8; the suffix itself never matches.
    assert propose_ngram_reference([1, 2, 7, 1, 2, 9, 8, 1, 2], 2, 1, 3) == [9, 8]
    # Longest n first: "7 1 2" occurs earlier at 2..4 even though "1 2" occurs later.
    assert propose_ngram_reference([7, 1, 2, 5, 1, 2, 6, 7, 1, 2], 1, 1, 3) == [5]
    assert propose_ngram_reference([1, 2, 3], 4, 1, 3) == []
    assert propose_ngram_reference([4, 4], 4, 1, 3) == [4]  # only what follows exists


def test_accept_greedy_keeps_the_agreeing_prefix() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == 0
    assert accept_greedy([], [3]) == 0


def _request(params: SamplingParams, tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, tokens, params, 0)


def test_only_requests_whose_argmax_is_position_independent_speculate() -> None:
    assert can_speculate(_request(GREEDY, [1]))
    assert can_speculate(_request(SamplingParams(temperature=0.0, logit_bias={3: 2.0}, logprobs=2), [1]))
    assert not can_speculate(_request(SamplingParams(temperature=0.7), [1]))
    assert not can_speculate(_request(SamplingParams(temperature=0.0, repetition_penalty=1.2), [1]))
    assert not can_speculate(_request(SamplingParams(temperature=0.0, presence_penalty=0.5), [1]))
    assert not can_speculate(_request(SamplingParams(temperature=0.0, frequency_penalty=0.5), [1]))
    waiting_for_min = _request(SamplingParams(temperature=0.0, min_tokens=2), [1])
    assert not can_speculate(waiting_for_min)
    waiting_for_min.append_output_token(3)
    waiting_for_min.append_output_token(3)
    assert can_speculate(waiting_for_min)
    constrained = _request(GREEDY, [1])
    constrained.structured = object()  # type: ignore[assignment]
    assert not can_speculate(constrained)


def test_proposer_caps_drafts_and_skips_ineligible_requests() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3))
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.propose(_request(GREEDY, tokens), 10) == [3, 4, 5]
    assert proposer.propose(_request(GREEDY, tokens, "b"), 2) == [3, 4]
    assert proposer.propose(_request(GREEDY, tokens, "c"), 0) == []
    assert proposer.propose(_request(SamplingParams(temperature=1.0), tokens), 10) == []


@pytest.mark.parametrize("options, message", [
    ({"method": "eagle"}, "unknown speculative method 'eagle'"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be > 0"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min must be > 0"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max (2) must be >= prompt_lookup_min (3)"),
    ({"disable_by_batch_size": 1}, "disable_by_batch_size must be >= 2 (1 would never draft), got 1"),
])
def test_speculative_config_names_the_bad_field(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig(**options)


def test_engine_options_take_a_vllm_style_dict() -> None:
    config = build_engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=3)
    assert build_engine_config().speculative is None
    with pytest.raises(ConfigError, match="unknown speculative option"):
        build_engine_config(speculative_config={"method": "ngram", "draft_model": "x"})


def _cli(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(list(argv))
    args.no_prefix_caching = False
    return _engine_options(args)


def test_cli_flags_turn_speculation_on_and_refuse_lookup_sizes_alone() -> None:
    assert "speculative" not in _cli()
    assert _cli("--speculative-method", "ngram")["speculative"] == SpeculativeConfig()
    assert _cli("--num-speculative-tokens", "6", "--prompt-lookup-max", "5")["speculative"] == SpeculativeConfig(
        num_speculative_tokens=6, prompt_lookup_max=5)
    with pytest.raises(ConfigError, match="need speculative decoding on"):
        _cli("--prompt-lookup-max", "3")
    with pytest.raises(ConfigError, match="need speculative decoding on"):
        _cli("--speculative-disable-by-batch-size", "4")
    assert _cli("--speculative-method", "ngram", "--speculative-disable-by-batch-size", "4")["speculative"] == (
        SpeculativeConfig(disable_by_batch_size=4))
    with pytest.raises(ConfigError, match="prompt_lookup_max"):
        _cli("--num-speculative-tokens", "2", "--prompt-lookup-min", "5")


# ---- the scheduler's side ---------------------------------------------------------------------------

class FixedProposer:
    """Proposes the same drafts for every request (the scheduler's side does not care what they are)."""

    def __init__(self, drafts: list[int], disable_by_batch_size: int | None = None) -> None:
        self.drafts = drafts
        self.limit = NgramProposer(SpeculativeConfig(disable_by_batch_size=disable_by_batch_size))

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return self.drafts[:max_drafts]

    def drafts_allowed(self, num_running: int) -> bool:
        return self.limit.drafts_allowed(num_running)


def _scheduler(num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 8, drafts: list[int] | None = None,
               disable_by_batch_size: int | None = None) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget), kv, 1024,
                     proposer=FixedProposer(drafts if drafts is not None else [7, 7, 7], disable_by_batch_size))


def _step(scheduler: Scheduler, accept: dict[str, int] | None = None) -> list:
    """One schedule; each sampling request appends its token and the first accept[rid] drafts."""
    output = scheduler.schedule()
    scheduler.update_from_output(output)
    for item in output.scheduled:
        if item.samples:
            accepted = (accept or {}).get(item.request_id, 0)
            for token in list(item.draft_token_ids)[:accepted] + [1]:
                item.request.append_output_token(token)
            if item.draft_token_ids:
                scheduler.accept_drafts(item, accepted)
    return output.scheduled


def test_drafts_go_to_decoding_rows_from_the_leftover_budget() -> None:
    scheduler = _scheduler(budget=12)
    scheduler.add_request(_request(GREEDY, list(range(8)), "a"))
    first = _step(scheduler)  # the prefill: no drafts on a row that is not decoding
    assert [(i.num_tokens, list(i.draft_token_ids)) for i in first] == [(8, [])]
    second = _step(scheduler, {"a": 2})
    assert [(i.num_tokens, list(i.draft_token_ids)) for i in second] == [(4, [7, 7, 7])]
    request = second[0].request
    assert request.num_computed_tokens == request.num_tokens - 1 == 11  # 8 + 1 real + 2 accepted
    scheduler.add_request(_request(GREEDY, list(range(100, 110)), "b"))
    third = scheduler.schedule()  # a's real token, b's prefill (10): one token of budget left for drafts
    assert [(i.request_id, i.num_tokens, list(i.draft_token_ids)) for i in third.scheduled] == [
        ("a", 2, [7]), ("b", 10, [])]
    assert third.num_batched_tokens == 12 and third.num_draft_tokens == 1


def test_no_drafts_while_a_waiting_request_lacks_blocks_nor_past_max_tokens() -> None:
    scheduler = _scheduler(num_blocks=6, budget=64)
    scheduler.add_request(_request(SamplingParams(temperature=0.0, max_tokens=3), list(range(8)), "a"))
    _step(scheduler)
    decode = scheduler.schedule()
    # max_tokens=3: the K/V of at most 8 + 3 - 1 = 10 tokens is ever needed, so 1 draft after token 9.
    assert [list(i.draft_token_ids) for i in decode.scheduled] == [[7]]
    scheduler.update_from_output(decode)
    decode.scheduled[0].request.append_output_token(1)

    crowded = _scheduler(num_blocks=6, budget=64)
    crowded.add_request(_request(SHORT, list(range(8)), "a"))  # holds 2 blocks, then 3
    _step(crowded)
    crowded.add_request(_request(SHORT, list(range(100, 116)), "b"))  # needs 4 blocks: 3 free
    blocked = crowded.schedule()
    assert [(i.request_id, list(i.draft_token_ids)) for i in blocked.scheduled] == [("a", [])]
    assert crowded.num_waiting == 1


def test_drafts_never_preempt_nor_evict_and_blocks_stay_exact() -> None:
    scheduler = _scheduler(num_blocks=6, budget=64, drafts=[7, 7, 7, 7, 7, 7])
    for rid, first in (("a", 0), ("b", 20)):
        scheduler.add_request(_request(SHORT, list(range(first, first + 7)), rid))
    _step(scheduler)  # 2 blocks each (positions 0..7 once the first token is appended)
    cached = scheduler.kv_cache.pool.take(1)  # one block that holds a cached prefix, free
    scheduler.kv_cache.pool.publish(cached[0], 1234)
    scheduler.kv_cache.pool.release(cached)
    output = scheduler.schedule()
    # One plain free block: a's drafts fill it (4 slots after its real token), b gets none; no one is
    # preempted and the cached block is not taken.
    assert not output.preempted
    assert {i.request_id: list(i.draft_token_ids) for i in output.scheduled} == {"a": [7, 7, 7, 7], "b": []}
    assert scheduler.kv_cache.pool.lookup(1234) is cached[0]
    scheduler.update_from_output(output)
    for item in output.scheduled:
        item.request.append_output_token(1)
        if item.draft_token_ids:
            scheduler.accept_drafts(item, 0)
    live = scheduler.running_requests() + scheduler.waiting_requests()
    scheduler.kv_cache.check_invariants(live)
    assert [r.num_computed_tokens for r in live] == [8, 8]


def test_no_drafts_while_the_batch_reaches_disable_by_batch_size() -> None:
    scheduler = _scheduler(budget=64, disable_by_batch_size=3)
    for rid in "ab":
        scheduler.add_request(_request(GREEDY, list(range(8)), rid))
    _step(scheduler)  # the prefills
    assert all(i.draft_token_ids == [7, 7, 7] for i in _step(scheduler))  # 2 running: below the limit
    scheduler.add_request(_request(GREEDY, list(range(100, 108)), "c"))
    _step(scheduler)  # c's prefill: 3 running from now on
    assert [list(i.draft_token_ids) for i in _step(scheduler)] == [[], [], []]
    scheduler.finish_request("c", RequestStatus.FINISHED_ABORTED)
    assert all(i.draft_token_ids == [7, 7, 7] for i in _step(scheduler))  # back to 2: drafting again


def test_outright_rejections_back_off_and_an_acceptance_ends_the_wait() -> None:
    index = NgramIndex(1, 4)
    tokens = [1, 2, 3, 1, 2]
    for wait in (1, 2, 4, 8, 16, 16):  # each proposal rejected outright doubles the wait, up to 16 steps
        index.remember([3], len(tokens))
        tokens.append(7)  # the model's token was 7, not the draft
        index.settle(tokens)
        assert index.cooldown == wait
        index.cooldown = 0
    index.remember([3, 1], len(tokens))
    tokens += [3, 9]  # the first draft accepted
    index.settle(tokens)
    assert (index.backoff, index.cooldown) == (0, 0)


def test_a_request_cooling_down_proposes_nothing_until_its_wait_is_over() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=2))
    request = _request(GREEDY, [1, 2, 3, 1, 2])
    assert proposer.propose(request, 10) == [3, 1]
    request.append_output_token(5)  # rejected outright: one step without drafts
    request.append_output_token(1)
    request.append_output_token(2)
    assert proposer.propose(request, 10) == []
    assert proposer.propose(request, 10) == [5, 1]  # the wait is over; the latest "1 2" was followed by 5
