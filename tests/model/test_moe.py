"""The mixture-of-experts block: tokens grouped by expert give what every expert on every token, weighted
by the router, gives; and a step runs only the experts its tokens chose, each once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloop.model.layers import moe as moe_layer
from tokenloop.model.layers.moe import MoEWeights, active_expert_bytes, group_by_expert, moe_block, route

HIDDEN, WIDTH = 16, 8


def _random_moe(num_experts: int, top_k: int, normalize: bool, seed: int) -> MoEWeights:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * shape[-1] ** -0.5

    return MoEWeights(router=randn(num_experts, HIDDEN),
                      gate_up=[randn(2 * WIDTH, HIDDEN) for _ in range(num_experts)],
                      down=[randn(HIDDEN, WIDTH) for _ in range(num_experts)], top_k=top_k,
                      normalize=normalize)


def _every_expert_on_every_token(x: torch.Tensor, weights: MoEWeights) -> torch.Tensor:
    """The dense reference: all experts run on all tokens, combined by a [T, experts] gate that is zero
    outside each token's top k."""
    probs = torch.softmax(F.linear(x, weights.router).float(), dim=-1)  # in float32, as HF's routers
    top, chosen = probs.topk(weights.top_k, dim=-1)
    if weights.normalize:
        top = top / top.sum(-1, keepdim=True)
    gate = torch.zeros_like(probs).scatter(1, chosen, top).to(x.dtype)
    out = torch.zeros_like(x)
    for expert, (gate_up, down) in enumerate(zip(weights.gate_up, weights.down)):
        g, u = F.linear(x, gate_up).chunk(2, dim=-1)
        out += gate[:, expert:expert + 1] * F.linear(F.silu(g) * u, down)
    return out


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(0, 24), num_experts=st.integers(1, 9), data=st.data(), normalize=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_grouped_by_expert_equals_every_expert_weighted(tokens: int, num_experts: int, data: st.DataObject,
                                                        normalize: bool, seed: int) -> None:
    top_k = data.draw(st.integers(1, num_experts), label="top_k")
    weights = _random_moe(num_experts, top_k, normalize, seed)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    torch.testing.assert_close(moe_block(x, weights), _every_expert_on_every_token(x, weights),
                               rtol=1e-10, atol=1e-10)


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 30), num_experts=st.integers(1, 12), data=st.data())
def test_groups_hold_each_pair_once_sorted_by_expert(tokens: int, num_experts: int,
                                                     data: st.DataObject) -> None:
    top_k = data.draw(st.integers(1, num_experts), label="top_k")
    experts = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    groups = group_by_expert(experts, num_experts)
    flat = experts.reshape(-1)
    assert groups.counts == [int((flat == e).sum()) for e in range(num_experts)]
    assert sorted(groups.slots.tolist()) == list(range(tokens * top_k))  # every (token, expert) pair once
    sorted_experts = flat[groups.slots]
    assert torch.equal(sorted_experts, sorted_experts.sort().values)
    assert torch.equal(groups.tokens, groups.slots // top_k)


@pytest.mark.parametrize("normalize", [True, False])
def test_top_k_weights_sum_to_one_only_when_renormalized(normalize: bool) -> None:
    weights = _random_moe(8, 3, normalize, seed=3)
    routing = route(torch.randn(5, HIDDEN, dtype=torch.float64), weights.router, 3, normalize)
    sums = routing.weights.sum(-1)
    if normalize:
        torch.testing.assert_close(sums, torch.ones(5, dtype=torch.float64))
    else:
        assert bool((sums < 1).all())  # 3 of 8 softmax weights


def test_a_step_runs_only_the_chosen_experts_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    weights = _random_moe(16, 2, True, seed=5)
    x = torch.randn(3, HIDDEN, dtype=torch.float64)
    chosen = set(route(x, weights.router, 2, True).experts.reshape(-1).tolist())
    assert len(chosen) < 16
    calls: list[int] = []
    original = moe_layer.gated_mlp

    def recording(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        calls.append(next(e for e, w in enumerate(weights.gate_up) if w is gate_up))
        return original(rows, gate_up, down)

    monkeypatch.setattr(moe_layer, "gated_mlp", recording)
    moe_block(x, weights)
    assert sorted(calls) == sorted(chosen)
    read, total = active_expert_bytes(x, weights)
    assert read == total * len(chosen) // 16
