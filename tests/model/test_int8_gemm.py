"""The many-row int8 GEMM (csrc/int8_gemm.cpp, model/int8_gemm.py) over the int8-dot packs (Q4, Q8_0, Q4_K, Q5_K, Q6_K):
against its PyTorch twin and the fp64 product of the packs' exact weights, with one and two activation code sets;
two code sets give the decode kernels' own values; `PackedLinear` sends many-row calls to it; a many-row LM head runs
one set and rescores each row's top at two."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.model.test_kquant_dot import _coded, k_quant
from tokenloop.model import int8_gemm
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.fused_cpu import decode_projection
from tokenloop.model.int8_dot import Int4DotWeight, Q8DotWeight, quantize_activations
from tokenloop.model.int8_gemm import GemmPack, gemm_available, gemm_matmul, reference
from tokenloop.model.kquant_dot import KQuantDotWeight
from tokenloop.model.layers.layer_weights import LayerWeights
from tokenloop.model.layers.linear import LMHead
from tokenloop.model.quantized import PackedLinear, RowStack

needs_gemm = pytest.mark.skipif(not gemm_available(), reason="the int8 GEMM runs on AVX512-VNNI builds only")
FORMATS = ["q4", "q8_0", "q4_k", "q5_k", "q6_k"]
_K_TYPES = {"q4_k": QType.Q4_K, "q5_k": QType.Q5_K, "q6_k": QType.Q6_K}


def make_pack(form: str, n: int, blocks: int, seed: int) -> tuple[GemmPack, torch.Tensor, torch.Tensor]:
    """A pack of `form` with N = n and about `blocks` blocks of 32 (whole super-blocks for the K-quants; a ragged
    K for Q4), its exact weights [N, K] as float32, and the part of them the activations' codes multiply (Q4's,
    Q4_K's and Q5_K's minimum terms multiply the blocks' float sums instead)."""
    gen = torch.Generator().manual_seed(seed)
    if form == "q4":
        k = 32 * blocks - seed % 31
        pack: GemmPack = Int4DotWeight.quantize(torch.randn(n, k, generator=gen))
        codes, d, _ = pack.unpack()
        coded = (codes[:n].view(n, -1, 32).float() * d[:n, :, None]).view(n, -1)[:, :k]
        return pack, pack.dequantize()[:n, :k], coded
    if form == "q8_0":
        codes = torch.randint(-128, 128, (n, 32 * blocks), generator=gen, dtype=torch.int8)
        q8 = Q8DotWeight.from_codes(codes, (torch.rand(n, blocks, generator=gen) * 0.02).half().float())
        return q8, q8.dequantize(), q8.dequantize()
    tensor, _ = k_quant(_K_TYPES[form], n, 256 * max(1, blocks // 8), seed)
    kquant = KQuantDotWeight.from_ggml(tensor.tensor_type, tensor.blocks, tensor.shape)
    return kquant, kquant.dequantize(), _coded(kquant)


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[:, :3] *= 30  # outlier channels, as a residual stream has
    return x


@settings(max_examples=40, deadline=None)
@given(form=st.sampled_from(FORMATS), n=st.integers(1, 70), blocks=st.integers(1, 24), rows=st.integers(1, 20),
       passes=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_gemm_matches_its_twin_and_the_exact_product(form: str, n: int, blocks: int, rows: int, passes: int,
                                                     seed: int) -> None:
    """Any N (ragged tiles), K and row count (full and partial register blocks and panels): the twin within the
    activations' rounding of the fp64 product, the kernel within float32 rounding of the twin."""
    pack, dense, coded = make_pack(form, n, blocks, seed)
    x = activations(rows, dense.shape[1], seed)
    blocks_k = pack.codes.shape[1]
    expected = x.double() @ dense.double().t()
    # |x - its codes| <= dx / 2 (one set) or dx / 508 (two) per value, times the weights' |w| (one set: the m terms
    # take the codes' sums too) or the coded weights' |d q| (two: they take x's float sums)
    weights = dense if passes == 1 else coded
    padded = torch.nn.functional.pad(weights.abs().double(), (0, blocks_k * 32 - weights.shape[1]))
    per_block = padded.view(n, blocks_k, 32)
    step = quantize_activations(x, blocks_k).scales.double() / (2 if passes == 1 else 2 * 254)
    bound = step @ per_block.sum(-1).t() * 1.01
    close = 2e-5 * (x.abs().double() @ (dense.abs().double() + coded.abs().double()).t()) + 1e-30
    twin = reference(pack, x, passes)
    assert ((twin.double() - expected).abs() <= bound + close).all()
    if not gemm_available():
        return
    got = gemm_matmul(pack, x, passes)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # The same integer sums, but a value whose x / dx lies within an ulp of a rounding tie may round apart (the
    # kernel's float steps differ from torch's by an ulp; hypothesis found such cases): one code step a block.
    tie = (step * 2) @ per_block.amax(-1).t()
    assert ((got.double() - twin.double()).abs() <= close + tie).all()


@needs_gemm
@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("rows", [1, 5, 23, 64])
def test_two_code_sets_give_the_decode_kernels_values(form: str, rows: int) -> None:
    """The same codes, integer sums and float steps in the same order: bit for bit the decode kernels' output."""
    pack, dense, _ = make_pack(form, 37, 16, seed=rows)
    x = activations(rows, dense.shape[1], seed=rows)
    assert torch.equal(gemm_matmul(pack, x, 2), pack.matmul(x))


@needs_gemm
def test_many_row_calls_run_the_gemm_and_fewer_the_decode_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    q4, q4_dense, _ = make_pack("q4", 40, 8, seed=31)
    q6, _, _ = make_pack("q6_k", 24, 8, seed=4)
    stack = PackedLinear(RowStack([q4, q6]), None, 1 << 62)
    few = activations(int8_gemm.GEMM_MIN_ROWS - 1, q4_dense.shape[1], seed=5)
    many = activations(int8_gemm.GEMM_MIN_ROWS + 9, q4_dense.shape[1], seed=6)
    assert torch.equal(stack.native(few), torch.cat([q4.matmul(few), q6.matmul(few)], dim=1))
    passes = int8_gemm.PROJECTION_PASSES
    expected = torch.cat([gemm_matmul(q4, many, passes), gemm_matmul(q6, many, passes)], dim=1)
    assert torch.equal(stack.native(many), expected)
    assert torch.equal(PackedLinear(q4, None, 1 << 62, gemm_passes=2).native(many), q4.matmul(many))
    monkeypatch.setattr(int8_gemm, "gemm_available", lambda: False)  # no kernel: the decode kernels serve all
    assert torch.equal(stack.native(many), torch.cat([q4.matmul(many), q6.matmul(many)], dim=1))


@needs_gemm
def test_kernel_refuses_mismatched_operands() -> None:
    kernel = paged_decode_kernels()
    assert kernel is not None
    pack, _, _ = make_pack("q6_k", 20, 8, seed=1)
    x, out = torch.ones(3, 256), torch.empty(3, 20)
    with pytest.raises(RuntimeError, match="kind 4, 5, 6, 7 or 8"):
        kernel.int8_gemm(x, pack.codes, pack.scales, out, 9, 1)
    with pytest.raises(RuntimeError, match="passes 1 or 2"):
        kernel.int8_gemm(x, pack.codes, pack.scales, out, 6, 3)
    with pytest.raises(RuntimeError, match="tiles of 352"):  # Q6_K codes called as Q5_K
        kernel.int8_gemm(x, pack.codes, pack.scales, out, 5, 1)
    with pytest.raises(RuntimeError, match="blocks of 32"):
        kernel.int8_gemm(torch.ones(3, 224), pack.codes, pack.scales, out, 6, 1)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.int8_gemm(x, pack.codes, pack.scales, torch.empty(3, 40), 6, 1)


@needs_gemm
@settings(max_examples=25, deadline=None)
@given(form=st.sampled_from(["q8_0", "q4_k", "q5_k", "q6_k"]), n=st.integers(1, 600), blocks=st.integers(1, 24),
       rows=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_the_lm_head_rescores_each_rows_top_at_two_code_sets(form: str, n: int, blocks: int, rows: int,
                                                             seed: int) -> None:
    """A many-row head runs one code set, then the decode kernels' values of the columns near each row's top: the
    greedy token and its logit are the decode kernels' bit for bit (a few-row step's), every other logit is one of
    the two; fewer rows run the decode kernels alone. The head shares the pack (a tied embedding's)."""
    pack, dense, _ = make_pack(form, n, blocks, seed)
    head = LMHead(PackedLinear(pack, None, 1 << 62))
    assert isinstance(head.weight, PackedLinear) and head.weight.packed is pack and head.rescored is not None
    x = activations(rows, dense.shape[1], seed)
    got, two = head(x), pack.matmul(x)
    if rows < int8_gemm.GEMM_MIN_ROWS:
        assert torch.equal(got, two)
        return
    one = gemm_matmul(pack, x, 1)
    top = two.argmax(-1, keepdim=True)
    assert torch.equal(got.gather(1, top), two.gather(1, top)) and torch.equal(got.argmax(-1), two.argmax(-1))
    assert ((got == one) | (got == two)).all()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), n=st.integers(1, 700), margin=st.floats(0, 3), seed=st.integers(0, 2**16))
def test_the_near_top_search_finds_every_column_within_the_margin(rows: int, n: int, margin: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, n, generator=gen).round(decimals=1)  # ties with the floor, too
    margins = torch.full((rows,), margin)
    expected = (logits >= (logits.amax(-1) - margins)[:, None]).nonzero(as_tuple=True)
    got = int8_gemm._near_top(logits, margins)
    assert sorted(zip(*(t.tolist() for t in got))) == sorted(zip(*(t.tolist() for t in expected)))


@pytest.mark.parametrize("form", ["q8_0", "q4_k", "q5_k", "q6_k"])
def test_the_heads_block_norms_bound_its_columns(form: str) -> None:
    """Q8_0: each block's largest sum of w^2 over the columns, exactly; a K-quant: a bound of it from the scales."""
    pack, dense, _ = make_pack(form, 70, 9, seed=5)
    norms = int8_gemm.RescoredLogits(pack).block_norms  # type: ignore[arg-type]
    expected = dense.view(70, -1, 32).square().sum(-1).amax(0)
    if form == "q8_0":
        assert torch.allclose(norms, expected, rtol=1e-6)
    else:
        assert (norms >= expected * (1 - 1e-6)).all() and (norms <= expected * 20).all()


@needs_gemm
def test_the_mlp_takes_one_code_set_and_leaves_the_decode_loop_at_many_rows() -> None:
    """A layer's gate/up and down run the GEMM's one set at many rows, so `decode_layers` (decode kernels, two sets)
    does not plan them there; Q/K/V and o_proj keep two sets and stay in the loop; few rows keep the loop."""
    q4, dense, _ = make_pack("q4_k", 64, 8, seed=9)

    def packed() -> PackedLinear:
        return PackedLinear(q4, None, 1 << 62)

    layer = LayerWeights(torch.ones(dense.shape[1]), packed(), None, packed(), torch.ones(dense.shape[1]), packed(),
                         packed())
    assert isinstance(layer.gate_up, PackedLinear) and isinstance(layer.down, PackedLinear)
    assert isinstance(layer.qkv, PackedLinear) and isinstance(layer.o_proj, PackedLinear)
    assert (layer.gate_up.gemm_passes, layer.down.gemm_passes) == (int8_gemm.MLP_PASSES,) * 2 == (1, 1)
    assert (layer.qkv.gemm_passes, layer.o_proj.gemm_passes) == (2, 2)
    many, few = int8_gemm.GEMM_MIN_ROWS, int8_gemm.GEMM_MIN_ROWS - 1
    assert decode_projection(layer.gate_up, many) is None and decode_projection(layer.down, many) is None
    assert decode_projection(layer.qkv, many) is not None and decode_projection(layer.gate_up, few) is not None
    hidden = activations(many, dense.shape[1], seed=10)
    assert torch.equal(layer.gate_up.native(hidden), gemm_matmul(q4, hidden, 1))
