"""Packed quantized weights: exact unpacking, GEMMs against dequantized fp32, form choice per batch size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.model.paged_harness import PagedHarness, Sequence
from tests.model.test_loader import write_tiny_gguf
from tokenloop.model import quantized
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.ggml_tensor import GGMLTensor
from tokenloop.model.loader import load_checkpoint
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.quantized import (
    Int4Weight,
    PackedLinear,
    PackThresholds,
    Q8Weight,
    QuantizedEmbedding,
    dense_linear,
    pack_linear,
    prepack_dense,
)


def _ggml(tensor_type: QType, rows: int, cols: int, seed: int = 0) -> tuple[GGMLTensor, np.ndarray]:
    """A random matrix quantized by gguf's reference quantizer, and its reference dequantization."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2.0, (rows, 1))).astype(np.float32)
    values[:, :32] += 0.5  # some blocks far from zero-centred, so Q4_1's minimum matters
    blocks = quantize(values, tensor_type)
    tensor = GGMLTensor(tensor_type, (rows, cols), blocks.reshape(rows, -1))
    return tensor, dequantize(blocks, tensor_type).reshape(rows, cols)


@pytest.mark.parametrize("tensor_type", [QType.Q4_0, QType.Q4_1, QType.Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_ggml_dequantize_is_bit_exact(tensor_type: QType, dtype: torch.dtype, kernel: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """ggml's values (rounded once to bf16), from the C++ one-pass unpack (Q4_0 / Q4_1) and torch's ops alike."""
    if kernel and paged_decode_kernels() is None:
        pytest.skip("C++ CPU kernels unavailable")
    if not kernel:
        monkeypatch.setattr(quantized, "paged_decode_kernels", lambda: None)
    tensor, reference = _ggml(tensor_type, 40, 96)
    assert torch.equal(tensor.dequantize(dtype), torch.from_numpy(reference).to(dtype))
    if tensor_type != QType.Q8_0:  # with the codes given (the unpack a pack shared), the same values
        assert torch.equal(tensor.dequantize(dtype, tensor.q4_codes()), torch.from_numpy(reference).to(dtype))


@pytest.mark.parametrize("tensor_type", [QType.Q4_0, QType.Q4_1])
@pytest.mark.parametrize("rows", [16, 40])  # 40: not a multiple of the packing's 16 rows
def test_int4_pack_keeps_codes_bit_exact(tensor_type: QType, rows: int) -> None:
    tensor, reference = _ggml(tensor_type, rows, 96, seed=rows)
    codes, d, m = tensor.q4_codes()
    packed = Int4Weight.from_q4(tensor)
    got_codes, scale, zero = packed.unpack()
    assert torch.equal(got_codes, torch.from_numpy(codes).to(torch.int32))  # the 4-bit codes, bit for bit
    # The kernel's scales are bf16: d and m + 8 d rounded once, nothing else.
    assert torch.equal(scale, torch.from_numpy(d).bfloat16().float())
    assert torch.equal(zero, torch.from_numpy(m + 8 * d).bfloat16().float())
    # ggml's w = d q + m is torch's (q - 8) scale + zero: equal to the reference up to that rounding.
    weights = packed.dequantize()
    bound = (torch.from_numpy(np.abs(d) * 16 + np.abs(m)) * 2.0 ** -8).repeat_interleave(32, dim=1)
    assert ((weights - torch.from_numpy(reference)).abs() <= bound).all()


@pytest.mark.parametrize("tensor_type", [QType.Q4_0, QType.Q4_1])
def test_int4_gemm_of_q4_matches_fp32_reference(tensor_type: QType) -> None:
    tensor, reference = _ggml(tensor_type, 48, 128, seed=3)
    packed = Int4Weight.from_q4(tensor)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    expected = x @ torch.from_numpy(reference).t()
    got = packed.matmul(x).float()
    scale = x.abs().max() * torch.from_numpy(reference).abs().max() * 128 ** 0.5
    assert (got - expected).abs().max() < 2e-2 * scale


@pytest.mark.parametrize("n,k", [(16, 32), (33, 40), (64, 100), (20, 192)])  # ragged N and K included
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_int4_gemm_random_shapes(n: int, k: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    weight = torch.randn(n, k, generator=gen)
    packed = Int4Weight.quantize(weight)
    dequantized = packed.dequantize()
    assert dequantized.shape == (n, k)
    # 4-bit round-to-nearest: at most half a step (range / 15 / 2) from the original, per group.
    step = (weight.abs().max() * 2 / 15)
    assert (dequantized - weight).abs().max() <= step * 0.51 + 1e-2
    x = torch.randn(rows, k, generator=gen)
    got = packed.matmul(x).float()
    assert got.shape == (rows, n)
    expected = x.bfloat16().float() @ dequantized.t()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("use_kernel", [True, False])
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 80), k_groups=st.integers(1, 32), rows=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_q8_gemm_matches_fp32_reference(n: int, k_groups: int, rows: int, seed: int, use_kernel: bool) -> None:
    """Any N (ragged against the 16-column tiles), K = 32..1024, M across the 4-row, 12-row and buffered
    blocks: the kernel (and the no-compiler fallback) equals a dequantized fp32 matmul to fp32 rounding."""
    k = k_groups * 32
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k_groups, generator=gen) * 0.02
    weight = Q8Weight.from_codes(codes, scales)
    reference = (codes.view(n, k_groups, 32).float() * scales[..., None]).view(n, k)
    assert torch.equal(weight.dequantize(), reference)  # code x scale, exact
    x = torch.randn(rows, k, generator=gen)
    with pytest.MonkeyPatch.context() as patch:
        if not use_kernel:  # the PyTorch fallback, as without a compiler
            patch.setattr("tokenloop.model.quantized.paged_decode_kernels", lambda: None)
        got = weight.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    expected = (x.double() @ reference.double().t())
    bound = 1e-5 * (x.double().abs() @ reference.double().abs().t()) + 1e-30
    assert ((got.double() - expected).abs() <= bound).all()


def test_q8_gemm_of_a_ggml_tensor_matches_its_dequantization() -> None:
    tensor, reference = _ggml(QType.Q8_0, 40, 96)
    packed = Q8Weight.from_q8(tensor)
    assert torch.equal(packed.dequantize(), torch.from_numpy(reference))
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(packed.matmul(x), x @ torch.from_numpy(reference).t(), rtol=1e-5, atol=1e-5)


def test_q8_rejects_bad_shapes_and_dtypes() -> None:
    codes = torch.zeros(20, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="multiple of 32"):
        Q8Weight.from_codes(torch.zeros(20, 40, dtype=torch.int8), torch.ones(20, 1))
    with pytest.raises(ValueError, match="int8 codes"):
        Q8Weight.from_codes(codes.float(), torch.ones(20, 2))
    with pytest.raises(ValueError, match="scales"):
        Q8Weight.from_codes(codes, torch.ones(20, 3))
    weight = Q8Weight.from_codes(codes, torch.ones(20, 2))
    with pytest.raises(ValueError, match=r"x \[M, 64\]"):
        weight.matmul(torch.ones(3, 32))
    kernel = paged_decode_kernels()
    if kernel is None:
        pytest.skip("no C++ kernels here")
    x, out = torch.ones(3, 64), torch.empty(3, 20)
    with pytest.raises(RuntimeError, match="float32 x"):
        kernel.q8_0_tiled_matmul(x.double(), weight.codes, weight.scales, out)
    with pytest.raises(RuntimeError, match="does not match"):
        kernel.q8_0_tiled_matmul(x, weight.codes, weight.scales, torch.empty(3, 40))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.q8_0_tiled_matmul(torch.ones(3, 48), weight.codes[:, :48].contiguous(), weight.scales, out)


def test_packed_linear_picks_the_form_by_rows() -> None:
    """torch's int4 kernel and our fp32 Q8_0 kernel (the int8-dot packs: tests/model/test_int8_dot.py)."""
    tensor, reference = _ggml(QType.Q4_1, 32, 64)
    linear = pack_linear(tensor, PackThresholds(int4_max_rows=4, int8_dot=False))
    assert isinstance(linear, PackedLinear) and linear.dense is not None
    assert [linear.form_for(r) for r in (1, 4, 5, 64)] == ["int4", "int4", "bfloat16", "bfloat16"]
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    expected = x @ torch.from_numpy(reference).t()
    for rows in (2, 8):  # packed, then dense: both close to the fp32 reference, in the caller's dtype
        out = linear(x[:rows])
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, expected[:rows], rtol=3e-2, atol=3e-2 * expected.abs().max().item())
    only = pack_linear(tensor, PackThresholds(1 << 62, 1 << 62, keep_dense=False, int8_dot=False))
    assert isinstance(only, PackedLinear) and only.dense is None and only.form_for(10_000) == "int4"
    q8, q8_reference = _ggml(QType.Q8_0, 32, 64)
    with pytest.MonkeyPatch.context() as patch:  # the Q8_0 tiled kernel's AVX-512 path
        patch.setattr(quantized, "avx512_native", lambda: True)
        # The LM head (fp32 logits): the Q8_0 kernel at every row count, no float32 copy of the weights.
        head = pack_linear(q8, PackThresholds(q8_max_rows=2, int8_dot=False), dense_dtype=torch.float32)
        assert isinstance(head, PackedLinear) and head.dense is None
        assert [head.form_for(r) for r in (2, 3, 512)] == ["q8_0"] * 3 and head.input_dtype_for(512) == torch.float32
        assert head(x).dtype == torch.float32
        # A Q8_0 layer (bf16 output is fine there) still keeps its bf16 copy for large batches.
        layer = pack_linear(q8, PackThresholds(q8_max_rows=2, int8_dot=False))
        assert isinstance(layer, PackedLinear) and [layer.form_for(r) for r in (2, 3)] == ["q8_0", "bfloat16"]
    with pytest.MonkeyPatch.context() as patch:  # without it the plain loops lose to the copy at every row count
        patch.setattr(quantized, "avx512_native", lambda: False)
        head = pack_linear(q8, PackThresholds(q8_max_rows=2, int8_dot=False), dense_dtype=torch.float32)
        assert isinstance(head, PackedLinear) and [head.form_for(r) for r in (1, 512)] == ["float32"] * 2
        torch.testing.assert_close(head(x), x @ torch.from_numpy(q8_reference).t(), rtol=1e-4, atol=1e-4)


def test_q8_embedding_rows_are_exact() -> None:
    tensor, reference = _ggml(QType.Q8_0, 50, 64)  # 50 rows: the last tile is padded
    ids = torch.tensor([3, 0, 49, 3, 16, 47])
    embedding = QuantizedEmbedding(Q8Weight.from_q8(tensor))
    assert embedding.shape == (50, 64)
    assert torch.equal(embedding.index_select(0, ids), torch.from_numpy(reference)[ids])
    for bad in (50, 63, -1):  # past the end, inside the padding, negative: errors, not padding or wrap-around
        with pytest.raises(IndexError, match=r"\[0, 50\)"):
            embedding.index_select(0, torch.tensor([1, bad]))
    with pytest.raises(ValueError, match="dim 1"):
        embedding.index_select(1, ids)


def test_row_permutation_and_fusion_on_raw_blocks_are_exact() -> None:
    a, ref_a = _ggml(QType.Q4_1, 16, 64, seed=1)
    b, ref_b = _ggml(QType.Q4_1, 32, 64, seed=2)
    order = np.random.default_rng(0).permutation(16)
    assert torch.equal(a.take_rows(order).dequantize(), torch.from_numpy(ref_a[order]))
    joined = GGMLTensor.concat([a, b])
    assert joined is not None
    assert torch.equal(joined.dequantize(), torch.from_numpy(np.concatenate([ref_a, ref_b])))
    assert GGMLTensor.concat([a, _ggml(QType.Q8_0, 16, 64)[0]]) is None


@pytest.mark.parametrize("source", ["quantized", "random-bytes"])
def test_q5_0_is_held_as_q8_0_bit_exact(source: str) -> None:
    """Q5_0 (w = d (q - 16), q of 5 bits split over a nibble and a high-bit word) as Q8_0 blocks: ggml's values,
    bit for bit; random bytes reach every code and high-bit pattern."""
    rows, cols = 24, 96
    if source == "quantized":
        tensor, reference = _ggml(QType.Q5_0, rows, cols)
    else:
        blocks = np.random.default_rng(3).integers(0, 256, size=(rows, cols // 32, 22), dtype=np.uint8)
        blocks[..., 0:2] = np.frombuffer(np.float16(0.0137).tobytes(), dtype=np.uint8)
        tensor = GGMLTensor(QType.Q5_0, (rows, cols), blocks.reshape(rows, -1))
        reference = dequantize(tensor.blocks, QType.Q5_0).reshape(rows, cols)
    as_q8 = tensor.as_q8_0()
    assert as_q8.tensor_type == QType.Q8_0 and as_q8.shape == tensor.shape
    got = dequantize(as_q8.blocks, QType.Q8_0).reshape(rows, cols)
    assert np.array_equal(got.view(np.uint32), reference.view(np.uint32))
    codes, _ = as_q8.q8_codes()
    assert codes.min() >= -16 and codes.max() <= 15


def test_q5_0_and_q8_0_parts_fuse_as_q8_0_and_run_the_q8_kernels() -> None:
    """llama-quantize's Q4_K_M of a model whose width is no multiple of 256 gives Q5_0 Q and K beside a Q8_0 V."""
    q, ref_q = _ggml(QType.Q5_0, 32, 64, seed=1)
    v, ref_v = _ggml(QType.Q8_0, 16, 64, seed=2)
    joined = GGMLTensor.concat([q, v])
    assert joined is not None and joined.tensor_type == QType.Q8_0
    reference = torch.from_numpy(np.concatenate([ref_q, ref_v]))
    assert torch.equal(joined.dequantize(), reference)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    for thresholds in (PackThresholds(), PackThresholds.always_packed()):
        weight = pack_linear(q, thresholds, dense_dtype=torch.float32)
        assert isinstance(weight, PackedLinear) and "q8" in weight.packed.form
        torch.testing.assert_close(weight.packed.matmul(x), x @ torch.from_numpy(ref_q).t(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tensor_type", [QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.Q5_0, QType.Q5_1])
def test_kept_quantized_gguf_runs_close_to_its_dequantized_model(tiny_model_dir: Path, tmp_path: Path,
                                                                 tensor_type: QType) -> None:
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", tensor_type)
    dense = load_checkpoint(str(path))
    kept = load_checkpoint(str(path), keep_quantized=True)
    assert kept.is_quantized and not dense.is_quantized
    for name, tensor in dense.weights.items():  # the raw-row unpermutation equals the float one, bit for bit
        value = kept.weights[name]
        assert torch.equal(value.dequantize() if isinstance(value, GGMLTensor) else value, tensor), name
    reference = LlamaModel.from_weights(dense.config, dense.weights)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(dense.config.vocab_size, (24,), generator=gen).tolist()
    expected = PagedHarness(reference, block_size=8).step([(Sequence(prompt), 24)])[0]
    for thresholds in (PackThresholds(), PackThresholds.always_packed()):
        model = LlamaModel.from_weights(kept.config, kept.weights, quantized=True, thresholds=thresholds)
        got = PagedHarness(model, block_size=8).step([(Sequence(prompt), 24)])[0]
        assert torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected) < 3e-2


def test_packed_weights_with_bf16_activations(tiny_model_dir: Path, tmp_path: Path) -> None:
    """dtype bfloat16 + weight_dtype quantized: the residual stream stays bf16 (no fp32 embedding rows)."""
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", QType.Q8_0)
    kept = load_checkpoint(str(path), keep_quantized=True)
    model = LlamaModel.from_weights(kept.config, kept.weights, dtype=torch.bfloat16, quantized=True)
    prompt = list(range(1, 20))
    logits = PagedHarness(model, block_size=8).step([(Sequence(prompt), len(prompt))])[0]
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def _q4_k(rows: int, cols: int, seed: int = 0) -> tuple[GGMLTensor, np.ndarray]:
    """Random Q4_K super-blocks (gguf-py cannot quantize to Q4_K, but every byte pattern with finite d and
    dmin is a valid block), and gguf's reference dequantization of them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(1e-4, 2e-2, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    blocks[..., 2:4] = rng.uniform(1e-4, 2e-2, (rows, cols // 256, 1)).astype(np.float16).view(np.uint8)
    blocks = blocks.reshape(rows, -1)
    return GGMLTensor(QType.Q4_K, (rows, cols), blocks), dequantize(blocks, QType.Q4_K).reshape(rows, cols)


@pytest.mark.parametrize("rows", [16, 40])
def test_q4_k_unpacks_to_ggml_values_and_packs_its_codes_bit_exact(rows: int) -> None:
    """Q4_K's 6-bit sub-block scales and mins become per-32 d and m exactly (ggml's own values, bit for bit),
    and the int4 pack keeps its codes, with d and m + 8 d rounded to bf16 only."""
    tensor, reference = _q4_k(rows, 512, seed=rows)
    assert torch.equal(tensor.dequantize(), torch.from_numpy(reference))
    codes, d, m = tensor.q4_codes()
    assert torch.equal(torch.from_numpy(codes.reshape(rows, -1, 32) * d[..., None] + m[..., None]).view(rows, 512),
                       torch.from_numpy(reference))
    packed = pack_linear(tensor, PackThresholds(1 << 62, 1 << 62, keep_dense=False, int8_dot=False))
    assert isinstance(packed, PackedLinear) and packed.form == "int4"
    got_codes, scale, zero = packed.packed.unpack()
    assert torch.equal(got_codes, torch.from_numpy(codes).to(torch.int32))
    assert torch.equal(scale, torch.from_numpy(d).bfloat16().float())
    assert torch.equal(zero, torch.from_numpy(m + 8 * d).bfloat16().float())
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    expected = x @ torch.from_numpy(reference).t()
    got = packed(x)
    assert torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 64])
def test_prepacked_dense_matrix_multiplies_like_the_plain_one(dtype: torch.dtype, rows: int) -> None:
    """oneDNN's blocked layout is a layout only. bf16: the same oneDNN kernel F.linear runs, bit for bit.
    fp32: F.linear is MKL's, and oneDNN may pick another kernel per row count, so sums differ in order only."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=gen).to(dtype)
    packed = prepack_dense(weight)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert packed is weight  # no oneDNN bf16 on this CPU: the plain matrix stays
    else:
        assert packed.is_mkldnn and packed.dtype == dtype and tuple(packed.shape) == (200, 96)
    x = torch.randn(rows, 96, generator=gen)
    got, plain = dense_linear(x, packed), torch.nn.functional.linear(x.to(dtype), weight)
    if dtype == torch.bfloat16:
        assert torch.equal(got, plain)
    else:
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
