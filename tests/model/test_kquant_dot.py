"""Q4_K, Q5_K and Q6_K packed for the int8-dot kernels (model/kquant_dot.py, csrc/kquant_dot_blocks.inc): the file's
values bit for bit, products within the activations' rounding of the dequantized fp32 product (native build,
AVX2 build and PyTorch twin), and a tiny model of K-quant weights generating the dequantized model's tokens."""

from __future__ import annotations

import platform
from types import ModuleType

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.model.paged_harness import PagedHarness, Sequence
from tests.model.test_int8_dot import _check_product
from tokenloop.config import ModelConfig
from tokenloop.model import cpu_kernels
from tokenloop.model.ggml_tensor import GGMLTensor
from tokenloop.model.int8_dot import int8_dot_available
from tokenloop.model.kquant_dot import KQuantDotWeight
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.quantized import (
    PackedLinear,
    PackThresholds,
    QuantizedEmbedding,
    RowStack,
    pack_fused,
    pack_linear,
)

_BLOCK_BYTES = {QType.Q5_K: 176, QType.Q6_K: 210, QType.Q4_K: 144}
_HEADERS = {QType.Q5_K: [0, 2], QType.Q6_K: [208], QType.Q4_K: [0, 2]}  # where each fp16 super-block scale sits
native = cpu_kernels.paged_decode_kernels()
_K_TYPES = st.sampled_from([QType.Q4_K, QType.Q5_K, QType.Q6_K])
needs_dot = pytest.mark.skipif(not int8_dot_available(), reason="int8-dot kernels do not run natively here")


def k_quant(tensor_type: QType, rows: int, cols: int, seed: int, scale: float = 0.02) -> tuple[GGMLTensor, np.ndarray]:
    """Random K-quant super-blocks (gguf-py has no K-quant quantizer, but every byte pattern with finite fp16
    scales is a valid block) and gguf's reference dequantization of them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // 256, _BLOCK_BYTES[tensor_type]), dtype=np.uint8)
    for at in _HEADERS[tensor_type]:
        d = rng.uniform(0, scale, (rows, cols // 256, 1)) * rng.choice([-1, 1], (rows, cols // 256, 1))
        blocks[..., at:at + 2] = d.astype(np.float16).view(np.uint8)
    blocks = blocks.reshape(rows, -1)
    return GGMLTensor(tensor_type, (rows, cols), blocks), dequantize(blocks, tensor_type).reshape(rows, cols)


def _coded(weight: KQuantDotWeight) -> torch.Tensor:
    """The part of W the activations' codes multiply: all of it for Q6_K, d sc q (not dmin mn) for Q4_K, Q5_K."""
    codes, sub, supers = weight.unpack(torch.arange(weight.out_features))
    scale, _ = weight.block_scales(sub, supers)
    grouped = codes.view(codes.shape[0], -1, scale.shape[-1], 32 // scale.shape[-1]).float()
    return (scale[..., None] * (grouped - (32 if weight.kind == 6 else 0))).view(codes.shape)


@settings(max_examples=30, deadline=None)
@given(tensor_type=_K_TYPES, n=st.integers(1, 40), supers=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_pack_keeps_the_files_values_bit_for_bit(tensor_type: QType, n: int, supers: int, seed: int) -> None:
    tensor, reference = k_quant(tensor_type, n, 256 * supers, seed)
    packed = KQuantDotWeight.from_ggml(tensor.tensor_type, tensor.blocks, tensor.shape)
    assert torch.equal(packed.dequantize(), torch.from_numpy(reference))
    assert packed.nbytes <= tensor.blocks.nbytes * (1 + 16 / n) * 1.03  # ~the file's bytes, tiles padded to 16
    codes, _, _ = packed.unpack()
    assert not codes[n:].any() and not packed.dequantize(torch.arange(n, codes.shape[0])).any()  # zero padding
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(QuantizedEmbedding(packed).index_select(0, ids), torch.from_numpy(reference)[ids])


@settings(max_examples=30, deadline=None)
@given(tensor_type=_K_TYPES, n=st.integers(1, 70), supers=st.integers(1, 3),
       rows=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_product_matches_the_dequantized_one(tensor_type: QType, n: int, supers: int, rows: int, seed: int) -> None:
    """The native kernel and the PyTorch twin against the fp64 product of ggml's values, within the activations'
    rounding, and against each other: any N (ragged tiles), rows across the 1-2-row and 4-row register blocks."""
    tensor, reference = k_quant(tensor_type, n, 256 * supers, seed)
    packed = KQuantDotWeight.from_ggml(tensor.tensor_type, tensor.blocks, tensor.shape)
    _check_product(packed, torch.from_numpy(reference), _coded(packed), rows, seed)


def test_kernel_refuses_mismatched_operands() -> None:
    if native is None:
        pytest.skip("C++ CPU kernels unavailable")
    tensor, _ = k_quant(QType.Q6_K, 20, 256, seed=1)
    packed = KQuantDotWeight.from_ggml(tensor.tensor_type, tensor.blocks, tensor.shape)
    x, out = torch.ones(3, 256), torch.empty(3, 20)
    with pytest.raises(RuntimeError, match="kind 5"):
        native.kquant_dot_matmul(x, packed.codes, packed.scales, out, 4)
    with pytest.raises(RuntimeError, match="tiles of 352"):  # Q6_K codes called as Q5_K
        native.kquant_dot_matmul(x, packed.codes, packed.scales, out, 5)
    with pytest.raises(RuntimeError, match="super-blocks of 256"):
        native.kquant_dot_matmul(torch.ones(3, 224), packed.codes, packed.scales, out, 6)
    with pytest.raises(RuntimeError, match="does not match"):
        native.kquant_dot_matmul(x, packed.codes, packed.scales, torch.empty(3, 40), 6)


@pytest.fixture(scope="module")
def avx2() -> ModuleType:
    """The kernels built for x86-64-v3 (AVX2, no AVX-512) beside the native build."""
    if native is None or platform.machine() != "x86_64":
        pytest.skip("needs the C++ CPU kernels on x86-64")
    return cpu_kernels.build_kernels("x86-64-v3")


@settings(max_examples=15, deadline=None)
@given(tensor_type=_K_TYPES, n=st.integers(1, 40), rows=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_avx2_build_gives_the_native_products(avx2: ModuleType, tensor_type: QType, n: int, rows: int,
                                              seed: int) -> None:
    """The AVX2 blocks (byte-mask expansion of the high bits, int16 pair sums widened per chunk) against the native
    build: the same integer sums, float32 rounding apart. Codes of 63 / 31 against activation codes of +-127 (a
    constant row with an outlier) are the int16 sums' largest."""
    tensor, _ = k_quant(tensor_type, n, 512, seed)
    packed = KQuantDotWeight.from_ggml(tensor.tensor_type, tensor.blocks, tensor.shape)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 512, generator=gen)
    x[0] = 1.0
    x[0, ::32] = -1.0
    got, expected = torch.empty(rows, n), torch.empty(rows, n)
    avx2.kquant_dot_matmul(x, packed.codes, packed.scales, got, packed.kind)
    native.kquant_dot_matmul(x, packed.codes, packed.scales, expected, packed.kind)
    magnitude = x.abs().double() @ (packed.dequantize().abs() + _coded(packed).abs()).double().t()
    assert ((got.double() - expected.double()).abs() <= 1e-5 * magnitude + 1e-30).all()


@needs_dot
def test_pack_linear_and_mixed_fusion_run_the_k_quant_kernels() -> None:
    """Q4_K / Q5_K / Q6_K matrices pack for the kernels (no float32 copy for the logits); Q/K/V of different
    K-quants fuse into a row stack whose product (one kernel call) is the concatenated one of its parts."""
    q, _ = k_quant(QType.Q4_K, 32, 256, seed=2)
    v, ref_v = k_quant(QType.Q6_K, 16, 256, seed=3)
    head = pack_linear(v, PackThresholds(), dense_dtype=torch.float32)
    assert isinstance(head, PackedLinear) and head.form == "q6_k_vnni" and head.dense is None
    k, _ = k_quant(QType.Q4_K, 16, 256, seed=7)
    fused = pack_fused([q, k, v], PackThresholds.always_packed())  # Q and K of one type share a pack
    assert isinstance(fused, PackedLinear) and isinstance(fused.packed, RowStack)
    assert fused.form == "q4_k_vnni+q6_k_vnni" and fused.packed.out_features == 64
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    parts = [pack_linear(GGMLTensor.concat([q, k]), PackThresholds.always_packed()), head]
    assert torch.equal(fused(x), torch.cat([part.packed.matmul(x) for part in parts], dim=1))
    # The Q4_K part's int8-dot pack rounds d sc and dmin mn to fp16: compared with what it holds.
    held = torch.cat([fused.packed.parts[0].dequantize(), torch.from_numpy(ref_v)]).double()
    magnitude = x.abs().double() @ held.abs().t()
    assert ((fused(x).double() - x.double() @ held.t()).abs() <= 1e-3 * magnitude).all()
    with_copy = pack_fused([q, v], PackThresholds(int4_max_rows=2))
    assert with_copy.form_for(3) == "bfloat16" and with_copy.dense is not None


def _k_quant_llama(seed: int) -> tuple[ModelConfig, dict[str, GGMLTensor | torch.Tensor], dict[str, torch.Tensor]]:
    """A 2-layer Llama of width 256 whose projections and tied embedding are Q4_K / Q5_K / Q6_K blocks, as a
    Q4_K_M file mixes them, and the same weights dequantized."""
    config = ModelConfig("llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
    kinds = {"q_proj": (QType.Q4_K, 256, 256), "k_proj": (QType.Q5_K, 128, 256), "v_proj": (QType.Q6_K, 128, 256),
             "o_proj": (QType.Q5_K, 256, 256), "gate_proj": (QType.Q4_K, 512, 256),
             "up_proj": (QType.Q4_K, 512, 256), "down_proj": (QType.Q6_K, 256, 512)}
    kept: dict[str, GGMLTensor | torch.Tensor] = {}
    embed, _ = k_quant(QType.Q6_K, 512, 256, seed, scale=3e-4)  # logits of std ~4
    kept["model.embed_tokens.weight"] = embed
    kept["model.norm.weight"] = torch.ones(256)
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        kept[prefix + "input_layernorm.weight"] = torch.ones(256)
        kept[prefix + "post_attention_layernorm.weight"] = torch.ones(256)
        for index, (name, (kind, rows, cols)) in enumerate(kinds.items()):
            group = "self_attn." if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp."
            tensor, _ = k_quant(kind, rows, cols, seed * 100 + layer * 10 + index, scale=5e-4)
            kept[prefix + group + name + ".weight"] = tensor
    dense = {name: value.dequantize() if isinstance(value, GGMLTensor) else value for name, value in kept.items()}
    return config, kept, dense


@needs_dot
def test_k_quant_tiny_model_generates_the_dequantized_models_tokens() -> None:
    config, kept, dense = _k_quant_llama(seed=7)
    reference = LlamaModel.from_weights(config, dense)
    prompt = torch.randint(512, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    model = LlamaModel.from_weights(config, kept, quantized=True, thresholds=PackThresholds.always_packed())
    layer = model.layers[0]
    assert isinstance(layer.qkv, PackedLinear) and layer.qkv.form == "q4_k_vnni+q5_k_vnni+q6_k_vnni"
    assert layer.down.form == "q6_k_vnni" and model.lm_head.weight.form == "q6_k_vnni"
    assert isinstance(model.embed, QuantizedEmbedding)

    def greedy(model: LlamaModel) -> list[int]:
        harness, sequence = PagedHarness(model, block_size=8), Sequence(list(prompt))
        logits = harness.step([(sequence, len(prompt))])
        for _ in range(16):  # prefill, then decode steps: the packed kernels at 12 rows and at one
            sequence.token_ids.append(int(logits[0].argmax()))
            logits = harness.step([(sequence, 1)])
        return sequence.token_ids[len(prompt):]

    assert greedy(model) == greedy(reference)


@needs_dot
@settings(max_examples=20, deadline=None)
@given(widths=st.lists(st.integers(1, 200), min_size=2, max_size=3), rows=st.integers(1, 9),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_row_stack_in_one_call_equals_its_parts_one_by_one(widths: list[int], rows: int, threads: int,
                                                           seed: int) -> None:
    """`int8_dot_stack` (x quantized once, every part's tiles split over the threads by bytes, each part's columns
    written side by side) gives bit for bit its parts' own products, concatenated: ragged widths put a part's
    padded last tile next to the following part's first column."""
    kinds = [QType.Q4_K, QType.Q6_K, QType.Q5_K]
    tensors = [k_quant(kind, width, 512, seed + i)[0]
               for i, (kind, width) in enumerate(zip(kinds, widths, strict=False))]
    parts = [KQuantDotWeight.from_ggml(t.tensor_type, t.blocks, t.shape) for t in tensors]
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(seed))
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one_call = RowStack(list(parts)).matmul(x)
        one_by_one = torch.cat([part.matmul(x) for part in parts], dim=1)
    finally:
        torch.set_num_threads(saved)
    assert one_call.shape == (rows, sum(widths)) and torch.equal(one_call, one_by_one)


def test_dense_copies_only_within_the_models_budget() -> None:
    """A model keeps bf16 copies of its quantized matrices for large batches only while they fit the budget."""
    weights = [k_quant(QType.Q6_K, 32, 256, seed=5)[0], k_quant(QType.Q4_K, 16, 512, seed=6)[0], torch.ones(8)]
    copies = (32 * 256 + 16 * 512) * 2  # bf16 bytes
    assert PackThresholds(dense_copy_budget=copies).for_model(weights, torch.bfloat16).keep_dense
    assert not PackThresholds(dense_copy_budget=copies - 1).for_model(weights, torch.bfloat16).keep_dense
    assert not PackThresholds(dense_copy_budget=copies).for_model(weights, torch.float32).keep_dense
    assert PackThresholds.always_packed().for_model([], torch.bfloat16) == PackThresholds.always_packed()
