"""Speculative decoding on the tiny model: greedy output identical to plain decoding (alone, batched, chunked,
preempted, prefix-cached; stop tokens, EOS and max_tokens in the middle of the drafts; stop strings;
logprobs), exact KV accounting, and no speculation for sampled requests."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_engine import make_llm as make_any_llm
from tokenloop import LLM, SamplingParams
from tokenloop.config import SpeculativeConfig
from tokenloop.core.kv_cache import block_hash_chain
from tokenloop.core.speculative import can_speculate
from tokenloop.errors import ConfigError
from tokenloop.llm import build_engine_config
from tokenloop.model.loader import Checkpoint
from tokenloop.observe.metrics import EngineMetrics
from tokenloop.observe.records import EngineObserver, StepRecord
from tokenloop.request import Request
from tokenloop.sim.cluster import ReplicaClock
from tokenloop.sim.cost import StepCostModel
from tokenloop.sim.runner import sim_core

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def repetitive_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts that repeat a motif with some noise, so n-gram drafts exist, some right, some wrong."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        motif = [rng.randrange(300) for _ in range(rng.randint(2, 8))]
        prompt: list[int] = []
        while len(prompt) < rng.randint(4, 48):
            prompt += motif
            if rng.random() < 0.3:
                prompt.append(rng.randrange(300))
        prompts.append(prompt)
    return prompts


PROMPTS = repetitive_prompts(50)


def make_llm(tiny: Checkpoint, **options) -> LLM:
    """The tiny model in float32 throughout: the equality of every logprob below is an fp32 property."""
    return make_any_llm(tiny, dtype="float32", **options)


class Counts(EngineObserver):
    """Draft and accepted tokens over all steps, with the KV invariants checked after every step."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.engine.core
        self.drafts = self.accepted = self.steps = 0

    def on_step(self, record: StepRecord) -> None:
        self.drafts += record.num_draft_tokens
        self.accepted += record.num_accepted_tokens
        self.steps += 1
        scheduler = self.core.scheduler
        self.core.kv_cache.check_invariants(scheduler.running_requests() + scheduler.waiting_requests())


def _spec_llm(tiny: Checkpoint, speculative: SpeculativeConfig = NGRAM, **options) -> tuple[LLM, Counts]:
    llm = make_llm(tiny, speculative=speculative, **options)
    counts = Counts(llm)
    llm.engine.add_observer(counts)
    return llm, counts


def _tokens(llm: LLM, prompts: list, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_outputs(tiny: Checkpoint) -> list[list[int]]:
    return _tokens(make_llm(tiny), PROMPTS)


def test_fifty_prompts_identical_alone_and_batched(tiny: Checkpoint, plain_outputs: list[list[int]]) -> None:
    alone_llm, alone_counts = _spec_llm(tiny)
    alone = [_tokens(alone_llm, [p])[0] for p in PROMPTS]
    batched_llm, batched_counts = _spec_llm(tiny)
    batched = _tokens(batched_llm, PROMPTS)
    assert alone == plain_outputs
    assert batched == plain_outputs
    for counts in (alone_counts, batched_counts):
        assert 0 < counts.accepted < counts.drafts  # some drafts accepted, some rejected
    # Accepted drafts are tokens a plain run would have spent a step each on.
    assert alone_counts.steps < 50 * (1 + GREEDY.max_tokens)


def test_identical_with_chunked_prefill_preemption_and_prefix_hits(tiny: Checkpoint,
                                                                   plain_outputs: list[list[int]]) -> None:
    prompts = PROMPTS[:20]
    chunked_llm, chunked_counts = _spec_llm(tiny, max_num_batched_tokens=7)
    assert _tokens(chunked_llm, prompts) == plain_outputs[:20]
    assert chunked_counts.accepted > 0
    squeezed, squeezed_counts = _spec_llm(tiny, num_blocks=40)  # 160 tokens of KV for 20 x ~60
    assert _tokens(squeezed, prompts) == plain_outputs[:20]
    assert squeezed.engine.stats().num_preemptions > 0 and squeezed_counts.accepted > 0
    cached, _ = _spec_llm(tiny)
    _tokens(cached, prompts)
    assert _tokens(cached, prompts) == plain_outputs[:20]
    assert cached.engine.stats().prefix_cache_hits > 0


class OracleProposer:
    """Drafts from a plain run's continuation, with one wrong token at a position set by `rng`: drafts are
    mostly accepted, sometimes cut, and they run past EOS, stop tokens and max_tokens."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], k: int, seed: int = 0) -> None:
        self.continuations = continuations
        self.k = k
        self.rng = random.Random(seed)

    def drafts_allowed(self, num_running: int) -> bool:
        return True

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        if not can_speculate(request):
            return []
        done = request.num_output_tokens
        drafts = self.continuations[tuple(request.prompt_token_ids)][done:done + min(self.k, max_drafts)]
        wrong = self.rng.randrange(self.k + 2)
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % 300
        return drafts


def _oracle_llm(tiny: Checkpoint, continuations: dict, k: int = 5, seed: int = 0, **options) -> tuple[LLM, Counts]:
    llm, counts = _spec_llm(tiny, **options)
    llm.engine.core.scheduler.proposer = OracleProposer(continuations, k, seed)
    return llm, counts


@pytest.fixture(scope="module")
def long_continuations(tiny: Checkpoint) -> dict[tuple[int, ...], list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return {tuple(p): out for p, out in zip(PROMPTS, _tokens(make_llm(tiny), PROMPTS, params))}


def test_eos_stop_tokens_and_max_tokens_inside_the_drafts(tiny: Checkpoint, long_continuations: dict) -> None:
    prompts = PROMPTS[:16]
    # Stop tokens and EOS that first occur part-way through each continuation; max_tokens of every residue.
    stop_params = [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[long_continuations[tuple(p)][5 + i]])
                   for i, p in enumerate(prompts)]
    length_params = [SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True) for i in range(16)]
    eos = long_continuations[tuple(prompts[0])][9]
    for params, eos_token in ((stop_params, None), (length_params, None), (GREEDY, eos)):
        plain = make_llm(tiny)
        spec, counts = _oracle_llm(tiny, long_continuations)
        if eos_token is not None:
            plain.engine.core.eos_token_ids = spec.engine.core.eos_token_ids = frozenset({eos_token})
            params = SamplingParams(temperature=0.0, max_tokens=32)
        expected = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
        assert [o.outputs[0].stop_reason for o in got] == [o.outputs[0].stop_reason for o in expected]
        assert counts.accepted > counts.drafts // 3


def test_stop_strings_and_logprobs_match_plain_decoding(tiny: Checkpoint, long_continuations: dict) -> None:
    plain = make_llm(tiny)
    tokenizer = plain.get_tokenizer()
    prompts = PROMPTS[:8]
    params = []
    for p in prompts:
        text = tokenizer.decode(long_continuations[tuple(p)][:20])
        stop = text[len(text) // 2:len(text) // 2 + 3].strip() or text[-2:]
        params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=2))
    spec, counts = _oracle_llm(tiny, long_continuations)
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert counts.accepted > 0
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (e.outputs[0].finish_reason,
                                                                          e.outputs[0].stop_reason)
        assert len(g.outputs[0].logprobs) == len(e.outputs[0].logprobs)
        for a, b in zip(g.outputs[0].logprobs, e.outputs[0].logprobs):
            assert a.token_id == b.token_id and a.rank == b.rank
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_sampled_and_penalised_requests_decode_one_token_a_step(tiny: Checkpoint) -> None:
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, min_tokens=24, max_tokens=24)]
    prompts = PROMPTS[:3]
    expected = _tokens(make_llm(tiny), prompts, params)
    spec, counts = _spec_llm(tiny)
    assert _tokens(spec, prompts, params) == expected
    assert counts.drafts == 0


def _final_token_ids(outputs: list) -> list[list[int]]:  # RequestOutputs
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), k=st.integers(1, 7), num_blocks=st.sampled_from([30, 48, 400]),
       budget=st.sampled_from([9, 64]))
def test_kv_accounting_is_exact(tiny: Checkpoint, long_continuations: dict, seed: int, k: int, num_blocks: int,
                                budget: int) -> None:
    """Invariants after every step (no leak, refcounts = table entries); at the end nothing is held, every
    cached block holds real tokens only, and with a pool that never evicts, the prefix index and the hits
    of a second pass are exactly those of plain decoding."""
    prompts = random.Random(seed).sample(PROMPTS, 10)
    spec, _ = _oracle_llm(tiny, long_continuations, k=k, seed=seed, num_blocks=num_blocks,
                          max_num_batched_tokens=budget)
    outputs = spec.generate(prompts, GREEDY, use_tqdm=False)
    kv = spec.engine.core.kv_cache
    kv.check_invariants([])
    assert kv.num_free_blocks == num_blocks
    real = {h for tokens in _final_token_ids(outputs) for h in block_hash_chain(tokens, kv.block_size)}
    assert {h for h, _ in kv.pool.cached_items()} <= real
    if num_blocks == 400:
        plain = make_llm(tiny, num_blocks=num_blocks, max_num_batched_tokens=budget)
        plain_outputs = plain.generate(prompts, GREEDY, use_tqdm=False)
        assert _final_token_ids(outputs) == _final_token_ids(plain_outputs)
        plain_kv = plain.engine.core.kv_cache
        assert {h for h, _ in kv.pool.cached_items()} == {h for h, _ in plain_kv.pool.cached_items()}
        spec.generate(prompts, GREEDY, use_tqdm=False)
        plain.generate(prompts, GREEDY, use_tqdm=False)
        assert kv.prefix_cache_hits == plain_kv.prefix_cache_hits > 0


def test_metrics_count_drafts_and_the_simulator_refuses_speculation(tiny: Checkpoint) -> None:

    spec, counts = _spec_llm(tiny)
    metrics = EngineMetrics("tiny")
    spec.engine.add_observer(metrics)
    _tokens(spec, PROMPTS[:10])
    text = metrics.render().decode()
    assert counts.accepted > 0
    assert f'tokenloop:spec_decode_num_draft_tokens_total{{model_name="tiny",replica="0"}} {counts.drafts}.0' in text
    assert (f'tokenloop:spec_decode_num_accepted_tokens_total{{model_name="tiny",replica="0"}} '
            f'{counts.accepted}.0') in text
    config = build_engine_config("simulated", block_size=4, num_blocks=32, speculative=NGRAM)
    with pytest.raises(ConfigError, match="simulator does not model speculative decoding"):
        sim_core(config, StepCostModel(step=0.01, tokens=0.0002), ReplicaClock(), vocab_size=64, max_model_len=128,
                 kv_bytes_per_token=1024)
