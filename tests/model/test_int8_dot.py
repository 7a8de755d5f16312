"""The int8 dot-product kernels (csrc/int8_dot_matmul.cpp): exact packing, and products within the rounding of
the activations' 8-bit codes of a dequantized fp32 reference, on random shapes (ragged N and K included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.ggml_tensor import GGMLTensor
from tokenloop.model.int8_dot import (
    Int4DotWeight,
    Q8DotWeight,
    int8_dot_available,
    quantize_activations,
)
from tokenloop.model.quantized import (
    PackedLinear,
    PackThresholds,
    QuantizedEmbedding,
    pack_linear,
)

kernels = paged_decode_kernels()
needs_kernels = pytest.mark.skipif(kernels is None or not hasattr(kernels, "int4_dot_matmul"),
                                   reason="C++ CPU kernels unavailable")


def _ggml(tensor_type: QType, rows: int, cols: int, seed: int) -> tuple[GGMLTensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2.0, (rows, 1))).astype(np.float32)
    values[:, :32] += 0.5  # blocks far from zero-centred: Q4_1's minimum matters
    blocks = quantize(values, tensor_type)
    return GGMLTensor(tensor_type, (rows, cols), blocks.reshape(rows, -1)), dequantize(blocks, tensor_type).reshape(
        rows, cols)


def _rounding_bound(x: torch.Tensor, weight: torch.Tensor, rounded: torch.Tensor, blocks: int) -> torch.Tensor:
    """How far the product may be from x @ W.T when each x value that multiplies `rounded` (the part of the
    weights the activations' codes meet: d q for Q4, whose m term takes the exact sums; all of W for Q8_0) moves
    by up to half its block's finest step (dx / 254 / 2), plus float32 rounding of the sums: [M, N]."""
    dx = quantize_activations(x, blocks).scales / 254  # the remainder codes' step
    k = weight.shape[1]
    r_abs = torch.nn.functional.pad(rounded.abs().double(), (0, blocks * 32 - k)).view(weight.shape[0], blocks, 32)
    steps = (dx.double() / 2 * (1 + 1e-6)) @ r_abs.sum(-1).t()
    magnitude = x.abs().double() @ (weight.abs().double() + rounded.abs().double()).t()
    return steps + 1e-5 * magnitude + 1e-30


@pytest.mark.parametrize("tensor_type", [QType.Q4_0, QType.Q4_1])
def test_q4_pack_keeps_the_files_codes_and_scales(tensor_type: QType) -> None:
    tensor, reference = _ggml(tensor_type, 40, 96, seed=1)  # 40 rows: the last tile is padded
    codes, d, m = tensor.q4_codes()
    packed = Int4DotWeight.from_q4(tensor)
    got_codes, got_d, got_m = packed.unpack()
    assert torch.equal(got_codes[:40, :96], torch.from_numpy(codes).to(torch.int32))
    assert torch.equal(got_d[:40], torch.from_numpy(d)) and torch.equal(got_m[:40], torch.from_numpy(m))
    assert not got_codes[40:].any() and not got_d[40:].any()  # padding: zero weights
    assert torch.equal(packed.dequantize(), torch.from_numpy(reference))  # d q + m: ggml's values, bit for bit


def test_q8_pack_rows_and_embedding_are_exact() -> None:
    tensor, reference = _ggml(QType.Q8_0, 50, 64, seed=2)
    packed = Q8DotWeight.from_q8(tensor)
    assert torch.equal(packed.dequantize(), torch.from_numpy(reference))
    ids = torch.tensor([3, 0, 49, 3, 16, 47])
    codes, scales = packed.rows(ids)
    file_codes, file_d = tensor.q8_codes()
    assert torch.equal(codes, torch.from_numpy(file_codes)[ids]) and torch.equal(scales, torch.from_numpy(file_d)[ids])
    embedding = QuantizedEmbedding(packed)
    assert torch.equal(embedding.index_select(0, ids), torch.from_numpy(reference)[ids])


def _check_product(weight: Int4DotWeight | Q8DotWeight, dense: torch.Tensor, rounded: torch.Tensor, rows: int,
                   seed: int) -> None:
    """The kernel against its PyTorch twin (same arithmetic, float32 sums in another order) and against the
    dequantized fp32 product (within the activations' rounding); the twin against the fp32 product too."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dense.shape[1], generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[:, :5] *= 30  # an outlier or two per row, as activations have
    blocks = weight.codes.shape[1]
    expected = x.double() @ dense.double().t()
    bound = _rounding_bound(x, dense, rounded, blocks)
    twin = weight.reference(x)
    assert ((twin.double() - expected).abs() <= bound).all()
    if kernels is None:
        return
    got = weight.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (rows, dense.shape[0])
    assert ((got.double() - expected).abs() <= bound).all()
    # Same codes, same exact integer sums: the two differ by float32 rounding, and where an activation's
    # remainder falls on a rounding tie, by one remainder step of that block (the kernel's x - q dx is fused,
    # the twin's is not, so they may round it apart: hypothesis found such cases).
    close = 1e-5 * (x.abs().double() @ (dense.abs().double() + rounded.abs().double()).t()) + 1e-30
    k = dense.shape[1]
    coded = torch.nn.functional.pad(rounded.abs().double(), (0, blocks * 32 - k)).view(dense.shape[0], blocks, 32)
    tie = (quantize_activations(x, blocks).scales.double() / 254) @ coded.amax(-1).t()
    assert ((got.double() - twin.double()).abs() <= close + tie).all()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 80), k=st.integers(1, 700), rows=st.integers(1, 40), seed=st.integers(0, 2**16))
@example(n=8, k=22, rows=3, seed=55)  # a remainder tie the kernel and the twin round apart
def test_int4_dot_matches_the_dequantized_product(n: int, k: int, rows: int, seed: int) -> None:
    """Any N (ragged against the 16-column tiles) and K (ragged against the 32-value blocks); rows across the
    1-2-row and 4-row register blocks."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    packed = Int4DotWeight.quantize(weight)
    codes, d, _ = packed.unpack()
    d_times_q = (codes.view(codes.shape[0], -1, 32) * d[..., None]).view(codes.shape)[:n, :k]
    _check_product(packed, packed.dequantize(), d_times_q, rows, seed)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 80), blocks=st.integers(1, 24), rows=st.integers(1, 40), seed=st.integers(0, 2**16))
@example(n=11, blocks=3, rows=3, seed=38963)  # likewise
def test_q8_dot_matches_the_dequantized_product(n: int, blocks: int, rows: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, blocks * 32), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, blocks, generator=gen) * 0.02).half().float()
    packed = Q8DotWeight.from_codes(codes, scales)
    dense = (codes.view(n, blocks, 32).float() * scales[..., None]).view(n, -1)
    assert torch.equal(packed.dequantize(), dense)
    _check_product(packed, dense, dense, rows, seed)


def test_without_the_compiler_matmul_runs_the_pytorch_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = Int4DotWeight.quantize(torch.randn(24, 100))
    x = torch.randn(3, 100)
    monkeypatch.setattr("tokenloop.model.int8_dot.paged_decode_kernels", lambda: None)
    assert torch.equal(weight.matmul(x), weight.reference(x))
    with pytest.raises(ValueError, match=r"x \[M, 100\]"):
        weight.matmul(torch.randn(3, 96))


@needs_kernels
def test_kernels_refuse_mismatched_operands() -> None:
    weight = Q8DotWeight.from_codes(torch.zeros(20, 64, dtype=torch.int8), torch.ones(20, 2))
    x, out = torch.ones(3, 64), torch.empty(3, 20)
    with pytest.raises(RuntimeError, match="float32 x"):
        kernels.q8_0_dot_matmul(x.double(), weight.codes, weight.scales, out)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.q8_0_dot_matmul(x, weight.codes, weight.scales, torch.empty(3, 40))
    with pytest.raises(RuntimeError, match="blocks of 32"):
        kernels.q8_0_dot_matmul(torch.ones(3, 96), weight.codes, weight.scales, out)
    four = Int4DotWeight.quantize(torch.randn(20, 64))
    with pytest.raises(RuntimeError, match="tiles of 256"):  # Q8_0 codes handed to the 4-bit kernel
        kernels.int4_dot_matmul(x, weight.codes, four.scales, out)


def test_pack_linear_picks_the_int8_dot_packs_where_they_run_natively() -> None:
    q4, _ = _ggml(QType.Q4_1, 32, 64, seed=3)
    q8, _ = _ggml(QType.Q8_0, 32, 64, seed=4)
    native = int8_dot_available()
    for tensor, dot_form, float_form in ((q4, "int4_vnni", "int4"), (q8, "q8_0_vnni", "q8_0")):
        packed = pack_linear(tensor, PackThresholds())
        assert isinstance(packed, PackedLinear) and packed.form == (dot_form if native else float_form)
        assert pack_linear(tensor, PackThresholds(int8_dot=False)).form == float_form
    dot = pack_linear(q4, PackThresholds(int4_max_rows=4))
    if native:
        assert dot.input_dtype_for(4) == torch.float32 and dot.native(torch.randn(2, 64)).dtype == torch.float32
        assert dot.form_for(5) == "bfloat16"
