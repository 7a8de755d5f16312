"""Sampler: each logit processor against hand-computed cases, draws, seeded batch-independence, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenloop.sampler as sampler_module
from tokenloop import sampling_ops
from tokenloop.errors import InvalidRequestError
from tokenloop.request import Request, SamplingParams
from tokenloop.sampler import Sampler

NEG_INF = float("-inf")


def make_request(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
                 eos: int | frozenset[int] | None = None, request_id: str = "r") -> Request:
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else eos
    request = Request(request_id, prompt or [0], params, arrival_ns=0, eos_token_ids=eos_ids)
    for token_id in output or []:
        request.append_output_token(token_id)
    return request


def processed_row(logits: list[float], params: SamplingParams, **kwargs) -> list[float]:
    """The processed logits of a one-row batch."""
    sampler = Sampler(len(logits))
    return sampler.process(torch.tensor([logits]), [make_request(params, **kwargs)])[0].tolist()


def draw_counts(logits: list[float], params: SamplingParams, draws: int = 4000, seed: int = 0) -> list[int]:
    """How often each token is drawn over `draws` identical rows sampled in one call."""
    sampler = Sampler(len(logits), seed=seed)
    batch = torch.tensor([logits]).expand(draws, -1).contiguous()
    tokens = sampler.sample(batch, [make_request(params) for _ in range(draws)]).token_ids
    return [tokens.count(t) for t in range(len(logits))]


def assert_follows(counts: list[int], probs: list[float]) -> None:
    """Never drawn where the probability is 0; a loose chi-square fit elsewhere (fixed seed: not flaky)."""
    total = sum(counts)
    chi2 = 0.0
    for count, p in zip(counts, probs):
        if p == 0:
            assert count == 0
        else:
            expected = total * p
            chi2 += (count - expected) ** 2 / expected
    degrees = sum(p > 0 for p in probs) - 1
    assert chi2 < 10 + 5 * degrees, (counts, probs, chi2)


def logits_of(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


# ---- greedy ---------------------------------------------------------------------------------------


def test_greedy_equals_argmax_with_ties_to_lowest_id() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 300)
    logits[3, [7, 9, 200]] = 50.0  # a three-way tie: torch.argmax takes the lowest id
    sampler = Sampler(300)
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(16)]
    out = sampler.sample(logits, requests)
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.token_ids[3] == 7
    assert out.logprobs == [None] * 16


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 6), st.integers(1, 40), st.integers(0, 2**31 - 1),
       st.sampled_from(["plain", "ties", "nan", "-inf", "+inf", "strided"]))
def test_row_argmax_fast_path_equals_torch_argmax(rows: int, vocab: int, seed: int, kind: str) -> None:
    """The CPU fast path (numpy's argmax) picks what torch.argmax picks: first maximum, first NaN, views."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (rows, vocab), generator=generator).float()  # small ints: many ties
    if kind != "ties":
        x += torch.rand(rows, vocab, generator=generator)
    if rows and kind in ("nan", "-inf", "+inf"):
        value = {"nan": math.nan, "-inf": -math.inf, "+inf": math.inf}[kind]
        x[0, vocab // 2:] = value
        x[-1, :] = value  # a whole row of it
    if kind == "strided":
        x = torch.cat([x, x], dim=1)[:, ::2]  # not contiguous
    assert sampler_module.row_argmax(x).tolist() == x.argmax(dim=1).tolist()
    assert sampler_module.row_argmax(x).dtype == torch.long


def test_greedy_applies_penalties() -> None:
    # Token 1 leads, but the prompt holds it: repetition 2.0 halves it below token 2.
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    request = make_request(params, prompt=[1, 4])
    logits = torch.tensor([[1.0, 2.0, 1.9, -1.0, 0.5]])
    assert Sampler(5).sample(logits, [request]).token_ids == [2]
    assert Sampler(5).sample(logits, [make_request(SamplingParams(temperature=0.0))]).token_ids == [1]


def test_greedy_rows_stay_argmax_in_a_mixed_batch_and_input_is_untouched() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 500)
    logits[5, 9] = 100.0  # EOS leads row 5, but min_tokens=2 with one output token masks it
    before = logits.clone()
    requests = [make_request(SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.8, min_tokens=i % 3,
                                            presence_penalty=0.3 if i == 4 else 0.0,
                                            logit_bias={7: 1.0} if i == 2 else None), output=[5], eos=9)
                for i in range(6)]
    out = Sampler(500).sample(logits, requests)
    assert torch.equal(logits, before)
    for i in (1, 3):
        assert out.token_ids[i] == int(logits[i].argmax())
    assert out.token_ids[5] == int(logits[5].index_fill(0, torch.tensor([9]), NEG_INF).argmax())


# ---- each processor alone -----------------------------------------------------------------------


def test_logit_bias_is_added() -> None:
    row = processed_row([0.0, 1.0, 2.0, 3.0], SamplingParams(temperature=0.0, logit_bias={0: 5.0, 3: -2.5}))
    assert row == [5.0, 1.0, 2.0, 0.5]


def test_repetition_penalty_over_prompt_and_output() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    row = processed_row([2.0, -2.0, 1.0, 3.0, -1.0], params, prompt=[0], output=[1, 1])
    # Seen tokens 0 and 1: positive divided, negative multiplied; unseen ones untouched.
    assert row == [1.0, -4.0, 1.0, 3.0, -1.0]


def test_frequency_penalty_counts_output_only() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    row = processed_row([0.0, 0.0, 0.0, 0.0], params, prompt=[3, 3], output=[2, 2, 1])
    assert row == [0.0, -0.5, -1.0, 0.0]


def test_presence_penalty_counts_output_only() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    row = processed_row([0.0, 0.0, 0.0, 0.0], params, prompt=[3, 3], output=[2, 2, 1])
    assert row == [0.0, -0.5, -0.5, 0.0]


def test_penalties_apply_in_order_bias_repetition_frequency_presence() -> None:
    params = SamplingParams(temperature=0.0, logit_bias={0: 2.0}, repetition_penalty=2.0,
                            frequency_penalty=1.0, presence_penalty=0.5)
    # Token 0: (0 + 2) / 2 - 1 * 1 - 0.5 = -0.5 (another order would give something else).
    row = processed_row([0.0, 4.0], params, output=[0])
    assert row == [-0.5, 4.0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    logits = [0.0, 5.0, 1.0, 9.0]
    assert processed_row(logits, params, output=[2], eos=3) == [0.0, NEG_INF, 1.0, NEG_INF]
    assert processed_row(logits, params, output=[2, 2], eos=3) == logits
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert processed_row(logits, ignoring, output=[2], eos=3) == [0.0, NEG_INF, 1.0, 9.0]


def test_temperature_divides() -> None:
    row = processed_row([1.0, 2.0, -4.0], SamplingParams(temperature=0.5))
    assert row == [2.0, 4.0, -8.0]


def test_top_k_keeps_k_best_and_draws_renormalised() -> None:
    probs = [0.1, 0.4, 0.05, 0.3, 0.15]
    params = SamplingParams(top_k=2)
    row = processed_row(logits_of(probs), params)
    assert [v > NEG_INF for v in row] == [False, True, False, True, False]
    assert_follows(draw_counts(logits_of(probs), params), [0, 4 / 7, 0, 3 / 7, 0])


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]
    # Mass before each token, best first: 0, 0.5, 0.8, 0.95; a token stays while that is < p.
    kept_075 = [v > NEG_INF for v in processed_row(logits_of(probs), SamplingParams(top_p=0.75))]
    assert kept_075 == [False, True, False, True]
    kept_085 = [v > NEG_INF for v in processed_row(logits_of(probs), SamplingParams(top_p=0.85))]
    assert kept_085 == [False, True, True, True]
    assert_follows(draw_counts(logits_of(probs), SamplingParams(top_p=0.75)), [0, 0.5 / 0.8, 0, 0.3 / 0.8])


def test_top_p_works_on_the_top_k_renormalised_distribution() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]
    # After top_k=2 the mass is [4/7, 3/7]: 4/7 >= 0.5, so top_p=0.5 keeps token 0 alone.
    kept = [v > NEG_INF for v in processed_row(logits_of(probs), SamplingParams(top_k=2, top_p=0.5))]
    assert kept == [True, False, False, False]


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    params = SamplingParams(min_p=0.2)  # floor 0.1
    kept = [v > NEG_INF for v in processed_row(logits_of(probs), params)]
    assert kept == [True, True, True, False]
    assert_follows(draw_counts(logits_of(probs), params), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])


def test_plain_draws_follow_softmax_with_temperature() -> None:
    logits = [0.0, 1.0, 2.0, -1.0, 0.5]
    scaled = torch.softmax(torch.tensor(logits) / 2.0, dim=0).tolist()
    assert_follows(draw_counts(logits, SamplingParams(temperature=2.0)), scaled)


def test_seeded_draws_follow_the_distribution_too() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    sampler = Sampler(4)
    batch = torch.tensor([logits_of(probs)]).expand(3000, -1).contiguous()
    requests = [make_request(SamplingParams(seed=i)) for i in range(3000)]
    tokens = sampler.sample(batch, requests).token_ids
    assert_follows([tokens.count(t) for t in range(4)], probs)


def test_staged_candidates_give_the_same_thresholds_as_a_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 6000
    # Peaky rows settle among 256 candidates, medium ones among 4096, flat ones need the full sort.
    scales = torch.tensor([8.0, 8.0, 3.0, 3.0, 0.5, 0.5, 6.0, 1.0]).unsqueeze(1)
    x = torch.randn(8, vocab, generator=gen) * scales
    x[1, :10] = x[1].max()  # ties at the top
    top_k = [0, 20, 0, 3000, 0, 5000, 300, 0]
    top_p = [0.9, 0.95, 0.9, 0.8, 0.99, 1.0, 1.0, 0.5]
    staged = sampling_ops.top_k_top_p_thresholds(x, top_k, top_p)
    monkeypatch.setattr(sampling_ops, "_CANDIDATE_STAGES", ())  # the kernels' module
    full = sampling_ops.top_k_top_p_thresholds(x, top_k, top_p)
    assert torch.equal(staged, full)
    for row, k in enumerate(top_k):
        if k and top_p[row] == 1.0:
            assert int((x[row] >= full[row]).sum()) == k


# ---- seeded requests do not depend on the batch -------------------------------------------------


def step_logits(step: int, tag: int, vocab: int, scale: float) -> torch.Tensor:
    """A request's logits at a step: fixed by (step, tag), whatever the batch."""
    gen = torch.Generator().manual_seed(1000 * tag + step)
    return torch.randn(vocab, generator=gen) * scale


SEEDED = [
    SamplingParams(seed=7, temperature=0.8, top_p=0.9, repetition_penalty=1.3),
    SamplingParams(seed=8, temperature=1.0, top_k=40, min_p=0.05, frequency_penalty=0.5),
    SamplingParams(seed=9, temperature=1.2),
]


def run_steps(order: list[int | str], vocab: int, steps: int) -> dict[int, list[int]]:
    """Sample `steps` steps for a batch: ints name a SEEDED request, strings an unseeded filler."""
    requests: dict[int | str, Request] = {}
    for name in order:
        params = SEEDED[name] if isinstance(name, int) else SamplingParams(temperature=0.7, top_p=0.95)
        requests[name] = make_request(params, prompt=[1, 2, 3], request_id=str(name))
    sampler = Sampler(vocab, seed=len(order))
    for step in range(steps):
        # Request 0 gets flat logits (its top-p needs the full sort), the others peaky ones.
        logits = torch.stack([step_logits(step, name if isinstance(name, int) else 10 + ord(name), vocab,
                                          0.3 if name == 0 else 4.0) for name in order])
        out = sampler.sample(logits, [requests[name] for name in order])
        for name, token_id in zip(order, out.token_ids):
            requests[name].append_output_token(token_id)
    return {name: requests[name].output_token_ids for name in order if isinstance(name, int)}


def test_seeded_request_is_independent_of_batch_and_row() -> None:
    vocab, steps = 1000, 8
    alone = {i: run_steps([i], vocab, steps)[i] for i in range(len(SEEDED))}
    for order in ([0, 1, 2], ["a", 2, "b", 0, 1], [1, "c", "d", "e", 0, 2], [2, "a", 1]):
        batched = run_steps(order, vocab, steps)
        for name, tokens in batched.items():
            assert tokens == alone[name], (order, name)
    assert len(set(map(tuple, alone.values()))) == len(SEEDED)


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_describe_the_raw_distribution() -> None:
    torch.manual_seed(5)
    logits = torch.randn(5, 200)
    requests = [
        make_request(SamplingParams(temperature=0.0, logprobs=5, logit_bias={3: 100.0})),
        make_request(SamplingParams(temperature=0.9, top_k=10, logprobs=0)),
        make_request(SamplingParams(temperature=1.0)),
        make_request(SamplingParams(temperature=0.0, logprobs=20, repetition_penalty=1.5), output=[4, 4]),
        make_request(SamplingParams(temperature=0.5, top_p=0.5, logprobs=3)),
    ]
    out = Sampler(200).sample(logits, requests)
    raw = torch.log_softmax(logits, dim=1)
    assert out.token_ids[0] == 3  # the bias decides the token, not the reported logprob
    assert out.logprobs[2] is None
    for row, (token_id, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        if entry is None:
            continue
        n = requests[row].sampling_params.logprobs
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(float(raw[row, token_id]), abs=1e-6)
        assert entry.rank == 1 + int((raw[row] > raw[row, token_id]).sum())
        assert len(entry.top) == n
        assert [t for t, _ in entry.top] == (raw[row].topk(n).indices.tolist() if n else [])
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)


def test_prompt_logprobs_match_log_softmax_gather() -> None:
    torch.manual_seed(6)
    length, vocab = 700, 50  # more rows than one chunk
    logits = torch.randn(length, vocab)
    targets = torch.randint(0, vocab, (length,))
    entries = Sampler(vocab).prompt_logprobs(logits, targets, num_top=4)
    raw = torch.log_softmax(logits, dim=1)
    assert len(entries) == length
    for row in (0, 1, 511, 512, 699):
        entry = entries[row]
        assert entry.token_id == int(targets[row])
        assert entry.logprob == pytest.approx(float(raw[row, targets[row]]), abs=1e-6)
        assert entry.rank == 1 + int((raw[row] > raw[row, targets[row]]).sum())
        assert [t for t, _ in entry.top] == raw[row].topk(4).indices.tolist()


# ---- validation ---------------------------------------------------------------------------------


def test_out_of_vocabulary_ids_are_rejected() -> None:
    sampler = Sampler(10)
    with pytest.raises(InvalidRequestError) as info:
        sampler.validate(SamplingParams(logit_bias={10: 1.0}))
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError):
        sampler.validate(SamplingParams(stop_token_ids=[-1]))
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, 9), [make_request(SamplingParams())] * 2)


# ---- property: never a masked token -------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[Request]]:
    vocab = draw(st.integers(2, 40))
    size = draw(st.integers(1, 6))
    values = st.floats(-30.0, 30.0, allow_nan=False, width=32)
    logits = torch.tensor([draw(st.lists(values, min_size=vocab, max_size=vocab)) for _ in range(size)])
    requests = []
    token = st.integers(0, vocab - 1)
    for i in range(size):
        stop_ids = draw(st.lists(token, max_size=3, unique=True))
        eos = draw(st.one_of(st.none(), token))
        if len(set(stop_ids) | {eos}) >= vocab:  # min_tokens must leave something to sample
            stop_ids = []
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 1e-6, 0.05, 0.7, 1.0, 3.0])),
            top_k=draw(st.integers(0, vocab + 2)),
            top_p=draw(st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 1e-4])),
            min_p=draw(st.sampled_from([0.0, 0.05, 0.5, 1.0])),
            repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
            frequency_penalty=draw(st.floats(-2.0, 2.0)),
            presence_penalty=draw(st.floats(-2.0, 2.0)),
            logit_bias=draw(st.dictionaries(token, st.floats(-50.0, 50.0), max_size=3)),
            min_tokens=draw(st.integers(0, 3)),
            stop_token_ids=stop_ids,
            ignore_eos=draw(st.booleans()),
            seed=draw(st.one_of(st.none(), st.integers(0, 2**32))),
            logprobs=draw(st.one_of(st.none(), st.integers(0, 5))),
        )
        output = draw(st.lists(token, max_size=6))
        requests.append(make_request(params, prompt=draw(st.lists(token, min_size=1, max_size=6)),
                                     output=output, eos=eos, request_id=str(i)))
    return logits, requests


@settings(max_examples=100, deadline=None)
@given(batches(), st.integers(0, 2**16))
def test_sampled_token_is_never_masked(batch: tuple[torch.Tensor, list[Request]], seed: int) -> None:
    logits, requests = batch
    sampler = Sampler(logits.shape[1], seed=seed)
    processed = sampler.process(logits, requests)
    out = sampler.sample(logits, requests)
    for row, token_id in enumerate(out.token_ids):
        assert 0 <= token_id < logits.shape[1]
        assert processed[row, token_id] > NEG_INF
        assert float(torch.softmax(processed[row], dim=0)[token_id]) > 0
        if requests[row].sampling_params.temperature < sampler_module.GREEDY_TEMPERATURE:
            assert token_id == int(processed[row].argmax())
        if requests[row].sampling_params.logprobs is not None:
            assert out.logprobs[row] is not None and out.logprobs[row].token_id == token_id


def test_inverse_cdf_edges_never_pick_zero_probability_tokens() -> None:
    vocab = 1000  # four draw blocks, the last one padded
    probs = torch.zeros(1, vocab)
    probs[0, [3, 300, 301, 999]] = torch.tensor([1e-30, 0.5, 1e-12, 0.25])
    positive = {3, 300, 301, 999}
    one_below = 1.0 - 2.0 ** -53
    for u in (0.0, 1e-31, 0.3, 0.6666, 0.9999999, one_below):
        tokens, drawable = sampling_ops.inverse_cdf(probs, torch.tensor([u], dtype=torch.float64))
        assert bool(drawable[0]) and int(tokens[0]) in positive, u
    tokens, _ = sampling_ops.inverse_cdf(probs, torch.tensor([one_below], dtype=torch.float64))
    assert int(tokens[0]) == 999
    _, drawable = sampling_ops.inverse_cdf(torch.zeros(2, 10), torch.zeros(2, dtype=torch.float64))
    assert not bool(drawable.any())


def test_draws_across_draw_blocks_follow_softmax() -> None:
    vocab = 3000  # several draw blocks, the last one padded
    logits = torch.full((vocab,), -4.0)
    picked = [5, 255, 256, 1000, 2047, 2048, 2999]
    logits[picked] = torch.tensor([0.0, 1.0, 2.0, 0.5, 1.5, -1.0, 2.5])
    probs = torch.softmax(logits.double(), dim=0)
    expected = probs[picked].tolist() + [1.0 - float(probs[picked].sum())]
    tokens = Sampler(vocab, seed=1).sample(logits.expand(3000, -1).contiguous(),
                                           [make_request(SamplingParams()) for _ in range(3000)]).token_ids
    counts = [tokens.count(t) for t in picked] + [sum(t not in picked for t in tokens)]
    assert_follows(counts, expected)


@settings(max_examples=50, deadline=None)
@given(batches(), st.integers(0, 2**16))
def test_a_sampling_batch_samples_as_its_request_list_does(batch: tuple[torch.Tensor, list[Request]],
                                                           seed: int) -> None:
    logits, requests = batch
    from_list = Sampler(logits.shape[1], seed=seed).sample(logits, requests)
    # Fresh requests: seeded rows' generators must start from the same state in both runs.
    again = [make_request(r.sampling_params, prompt=r.prompt_token_ids, output=r.output_token_ids,
                          eos=r.eos_token_ids, request_id=r.request_id) for r in requests]
    built = sampler_module.SamplingBatch.from_requests(again, logits.shape[1])
    from_batch = Sampler(logits.shape[1], seed=seed).sample(logits, built)
    assert from_batch == from_list
