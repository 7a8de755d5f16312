"""The serving loop on the tiny model: greedy invariance, seeds, aborts, stops, failures, times."""

from __future__ import annotations

import dataclasses

import pytest
from tokenizers import Tokenizer as RustTokenizer

from tests.conftest import TINY_PROMPTS
from tokenloop import LLM, SamplingParams
from tokenloop.engine import LLMEngine
from tokenloop.errors import InvalidRequestError
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_llm(tiny: Checkpoint, **options) -> LLM:
    options.setdefault("max_num_seqs", 16)
    options.setdefault("max_num_batched_tokens", 256)
    options.setdefault("block_size", 4)
    options.setdefault("num_blocks", 256)
    return LLM(str(tiny.path), checkpoint=tiny, **options)


PROMPTS = TINY_PROMPTS


def _greedy_tokens(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_identical_alone_batched_chunked_preempted_and_cached(tiny: Checkpoint) -> None:
    alone = [_greedy_tokens(make_llm(tiny), [p])[0] for p in PROMPTS]
    batched = _greedy_tokens(make_llm(tiny), PROMPTS)
    chunked = _greedy_tokens(make_llm(tiny, max_num_batched_tokens=7), PROMPTS)
    squeezed = make_llm(tiny, num_blocks=24)  # 96 tokens of KV for ~5 x 40: preemption is forced
    preempted = _greedy_tokens(squeezed, PROMPTS)
    assert squeezed.engine.stats().num_preemptions > 0
    cached_llm = make_llm(tiny)
    _greedy_tokens(cached_llm, PROMPTS)
    cached = _greedy_tokens(cached_llm, PROMPTS)  # the second pass hits the prefix cache
    assert cached_llm.engine.stats().prefix_cache_hits > 0
    assert batched == alone
    assert chunked == alone
    assert preempted == alone
    assert cached == alone


def test_seeded_sampling_does_not_depend_on_the_batch(tiny: Checkpoint) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = make_llm(tiny).generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)] * 3
    mixed = make_llm(tiny).generate(PROMPTS[1:4] + [PROMPTS[0]], others + [params], use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone


def test_abort_emits_nothing_more_and_releases_blocks(tiny: Checkpoint) -> None:
    engine = make_llm(tiny).engine
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("keep", PROMPTS[0], long)
    engine.add_request("drop", PROMPTS[2], long)
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.holds_blocks("drop")
    final = engine.abort_request("drop")
    assert [o.request_id for o in final] == ["drop"] and final[0].finished
    assert final[0].outputs[0].finish_reason == "abort" and final[0].metrics.e2e_s is not None
    assert not engine.kv_cache.holds_blocks("drop")
    assert engine.abort_request("drop") == []  # idempotent
    for _ in range(3):
        outputs = engine.step()
        assert all(o.request_id != "drop" for o in outputs)
    engine.abort_request("keep")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.usage == 0.0
    engine.kv_cache.check_invariants([])


def test_stop_strings_and_token_ids(tiny: Checkpoint) -> None:
    llm = make_llm(tiny)
    free = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    tokens = free.token_ids
    # Stop on the 5th generated token id.
    by_id = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop_token_ids=[tokens[4]]), use_tqdm=False)[0].outputs[0]
    first = tokens.index(tokens[4])
    assert by_id.token_ids == tokens[:first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tokens[4]
    # Stop on a piece of the generated text: truncated before it, or kept with include_stop_str_in_output.
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        cut = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert cut.text == text[:text.index(stop)]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        kept = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                         include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
        assert kept.text == text[:text.index(stop) + len(stop)]
    # min_tokens keeps the stop id from ending the request early.
    late = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=10,
                                                     stop_token_ids=[tokens[0]]), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 10
    assert free.finish_reason == "length" and len(free.token_ids) == 24


def test_max_model_len_and_eos(tiny: Checkpoint) -> None:
    llm = make_llm(tiny, max_model_len=32)
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[2])[:20]
    out = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=None,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    assert len(prompt_ids) + len(out.outputs[0].token_ids) == 32
    assert out.outputs[0].finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate([{"prompt_token_ids": [5] * 40}], GREEDY, use_tqdm=False)
    # EOS ends a request unless ignore_eos: force it through logit_bias.
    eos = llm.get_tokenizer().eos_token_id
    stopped = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, logit_bias={eos: 100.0}),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [eos] and stopped.finish_reason == "stop" and stopped.text == ""


def test_every_end_of_generation_id_stops_a_request(tiny: Checkpoint) -> None:
    # A second end-of-generation id (Gemma's <end_of_turn>, Llama 3's <|eot_id|>) ends a request as eos does.
    base = tiny.tokenizer
    end_of_turn = next(i for i in range(3, base.vocab_size) if i not in base.eos_token_ids)
    tokenizer = Tokenizer(RustTokenizer.from_str(base.backend.to_str()), source="tiny+eot",
                          eos_token_id=base.eos_token_id, extra_eos_token_ids=[end_of_turn])
    llm = make_llm(dataclasses.replace(tiny, tokenizer=tokenizer))
    forced = {end_of_turn: 100.0}

    def run(**options: object) -> object:
        params = SamplingParams(temperature=0, max_tokens=6, logit_bias=forced, **options)
        return llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]

    stopped = run()
    assert stopped.token_ids == [end_of_turn] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert run(ignore_eos=True).token_ids == [end_of_turn] * 6
    late = run(min_tokens=3)  # masked until the third token
    assert len(late.token_ids) == 4 and late.token_ids[-1] == end_of_turn and late.finish_reason == "stop"


def test_n_samples_share_the_prompt_blocks(tiny: Checkpoint) -> None:
    llm = make_llm(tiny)
    out = llm.generate([PROMPTS[2]], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different draws
    prompt_len = len(out.prompt_token_ids)
    # The second and third samples found the first one's full prompt blocks in the cache.
    assert llm.engine.stats().prefix_cache_hits >= 2 * ((prompt_len - 1) // 4) * 4


def test_bad_requests_are_rejected_and_nothing_accepted_is_lost(tiny: Checkpoint) -> None:
    engine = make_llm(tiny).engine
    engine.add_request("ok", PROMPTS[0], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("ok", PROMPTS[1], GREEDY)
    with pytest.raises(InvalidRequestError, match="not a token id"):
        engine.add_request("bad-ids", [1, 2, 10**9], GREEDY)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        engine.add_request("bad-bias", PROMPTS[0], SamplingParams(logit_bias={10**9: 1.0}))
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.add_request("empty", [], GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [o.request_id for o in outputs if o.finished] == ["ok"]


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny: Checkpoint,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_llm(tiny).engine
    engine.add_request("doomed", PROMPTS[0], GREEDY)
    real_execute = engine.runner.execute

    def broken(output):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "execute", broken)
    outputs = engine.step()
    assert outputs[0].finished and outputs[0].outputs[0].finish_reason == "error"
    assert "simulated kernel failure" in outputs[0].outputs[0].error
    assert engine.kv_cache.usage == 0.0
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    engine.add_request("fine", PROMPTS[0], GREEDY)
    while engine.has_unfinished_requests():
        for output in engine.step():
            last = output
    assert last.request_id == "fine" and last.outputs[0].finish_reason == "length"


def test_times_come_from_the_injected_clock(tiny: Checkpoint) -> None:
    ticks = iter(range(0, 10**12, 1_000_000))  # each clock read advances 1 ms
    engine = LLMEngine(build_engine_config(str(tiny.path), block_size=4, num_blocks=64), checkpoint=tiny,
                       clock=lambda: next(ticks))
    engine.add_request("t", PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    metrics = final.metrics
    assert metrics.arrival_time < metrics.first_scheduled_time < metrics.first_token_time
    assert metrics.queue_wait_s == pytest.approx(metrics.first_scheduled_time - metrics.arrival_time)
    assert len(metrics.itls_s) == 4
    assert metrics.e2e_s == pytest.approx(metrics.ttft_s + sum(metrics.itls_s), abs=1e-12)
    assert engine.kv_cache.usage == 0.0


def test_prompt_logprobs_and_logprobs(tiny: Checkpoint) -> None:
    llm = make_llm(tiny, max_num_batched_tokens=5)  # prompt logprobs gathered across prefill chunks
    llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)  # its blocks are cached now, yet must not be skipped
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                                                    prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == out.prompt_token_ids[position] and len(entry.top) == 2
    completion = out.outputs[0]
    assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    assert all(lp.rank == 1 for lp in completion.logprobs)  # greedy picks the most likely token
    assert completion.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in completion.logprobs))
