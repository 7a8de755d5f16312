"""The MoE block in one native call (csrc/moe_experts.cpp) against its PyTorch twin (`grouped_moe_block`, the
packs' own matmuls): the same routing, and the same output within float32 summation order, over token counts,
expert counts, top k, renormalization and the experts' pack forms (Q4_K, Q8_0, Q5_K, Q6_K)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import quantize
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.model.test_kquant_dot import k_quant
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.fused_cpu import ProjectionForm
from tokenloop.model.ggml_tensor import GGMLTensor
from tokenloop.model.int8_dot import int8_dot_available
from tokenloop.model.layers.moe import (
    MoEWeights,
    grouped_moe_block,
    moe_block,
    native_moe_block,
    route,
)
from tokenloop.model.quantized import PackedLinear, PackThresholds, pack_linear

HIDDEN, WIDTH = 256, 256  # the K-quants' super-block is 256 values
_PACKED = PackThresholds(keep_dense=False)
kernels = paged_decode_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "moe_experts") or not int8_dot_available(),
                                reason="the native MoE kernel is not built here")


_POOL = 4  # distinct packs per form and shape: packing K-quants costs ~0.1 s each, so examples share them


@functools.cache
def _pooled_pack(kind: QType, rows: int, cols: int, index: int) -> PackedLinear:
    packed = pack_linear(_expert_matrix(kind, rows, cols, 1000 * index + rows), _PACKED)
    assert isinstance(packed, PackedLinear)
    return packed


def _expert(kind: QType, rows: int, cols: int, index: int) -> PackedLinear:
    """A pack of the pool, in a PackedLinear of its own (MoEWeights re-points its pack at a stack)."""
    pooled = _pooled_pack(kind, rows, cols, index % _POOL)
    return PackedLinear(dataclasses.replace(pooled.packed), None, pooled.packed_max_rows)


def _expert_matrix(kind: QType, rows: int, cols: int, seed: int) -> GGMLTensor:
    if kind == QType.Q8_0:
        values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * cols ** -0.5
        return GGMLTensor(kind, (rows, cols), quantize(values, kind).reshape(rows, -1))
    return k_quant(kind, rows, cols, seed, scale=0.002)[0]


def _random_moe(num_experts: int, top_k: int, normalize: bool, gate_up: QType, down: QType, seed: int) -> MoEWeights:
    router = torch.randn(num_experts, HIDDEN, generator=torch.Generator().manual_seed(seed)) * HIDDEN ** -0.5
    return MoEWeights(router=router,
                      gate_up=[_expert(gate_up, 2 * WIDTH, HIDDEN, seed + e) for e in range(num_experts)],
                      down=[_expert(down, HIDDEN, WIDTH, seed + 2 * e + 1) for e in range(num_experts)],
                      top_k=top_k, normalize=normalize)


_FORMS = st.sampled_from([QType.Q4_K, QType.Q8_0, QType.Q5_K, QType.Q6_K])


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 12), num_experts=st.integers(1, 8), data=st.data(), normalize=st.booleans(),
       gate_up=_FORMS, down=_FORMS, seed=st.integers(0, 2 ** 16))
def test_native_block_equals_the_grouped_ops(tokens: int, num_experts: int, data: st.DataObject, normalize: bool,
                                             gate_up: QType, down: QType, seed: int) -> None:
    top_k = data.draw(st.integers(1, num_experts), label="top_k")
    weights = _random_moe(num_experts, top_k, normalize, gate_up, down, seed)
    assert weights.native is not None
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    reference = route(x, weights.router, top_k, normalize)
    if top_k < num_experts and tokens:  # a near tie at the k-th place may fall either way in either path
        probs = torch.softmax(x @ weights.router.t(), dim=-1).sort(dim=-1, descending=True).values
        assume(bool((probs[:, top_k - 1] - probs[:, top_k] > 1e-5).all()))
    out, routing = native_moe_block(x, weights, kernels)
    assert torch.equal(routing.experts, reference.experts)
    torch.testing.assert_close(routing.weights, reference.weights, rtol=1e-5, atol=1e-7)
    expected = grouped_moe_block(x, weights)
    # SiLU's exp differs by an ulp between the paths, which can move one of down's activation codes by a step
    # (1/254 of its block's scale): far below the 8-bit quantization the two paths share.
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3 * scale + 1e-6)


def test_the_block_runs_native_and_the_packs_view_the_stacks() -> None:
    weights = _random_moe(4, 2, False, QType.Q4_K, QType.Q6_K, seed=5)
    assert weights.native is not None
    gate_up, down = weights.native
    assert (gate_up.form, down.form) == (ProjectionForm.Q4_K, ProjectionForm.Q6_K)
    for e, weight in enumerate(weights.down):  # no second copy of the experts' bytes
        assert weight.packed.codes.data_ptr() == down.codes[e].data_ptr()  # type: ignore[union-attr]
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(moe_block(x, weights), native_moe_block(x, weights, kernels)[0], rtol=0, atol=0)
    bf16 = moe_block(x.bfloat16(), weights)
    assert bf16.dtype == torch.bfloat16


def test_dense_or_mixed_experts_keep_the_op_path() -> None:
    weights = _random_moe(3, 2, True, QType.Q4_K, QType.Q4_K, seed=7)
    dense = MoEWeights(router=weights.router, gate_up=[torch.randn(2 * WIDTH, HIDDEN) for _ in range(3)],
                       down=weights.down, top_k=2, normalize=True)
    assert dense.native is None
    mixed = MoEWeights(router=weights.router, gate_up=weights.gate_up,
                       down=[_expert(QType.Q6_K if e else QType.Q4_K, HIDDEN, WIDTH, e) for e in range(3)],
                       top_k=2, normalize=True)
    assert mixed.native is None
    x = torch.randn(2, HIDDEN)
    torch.testing.assert_close(moe_block(x, mixed), grouped_moe_block(x, mixed))
