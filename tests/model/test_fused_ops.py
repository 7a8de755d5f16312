"""The fused CPU layer kernels (csrc/fused_layer_ops.cpp) compute what the PyTorch ops they replace compute."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import write_tiny_llama
from tests.model.test_loader import write_tiny_gguf
from tokenloop.core.heartbeat import Progress
from tokenloop.model import quantized
from tokenloop.model.attention import AttentionMetadata, write_kv
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.fused_cpu import ProjectionForm, decode_projection, plan_decode
from tokenloop.model.ggml_tensor import QType
from tokenloop.model.int8_dot import int8_dot_available
from tokenloop.model.layers.norm import head_rms_norm_
from tokenloop.model.layers.rotary import apply_rope
from tokenloop.model.loader import load_checkpoint
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.quantized import PackThresholds

kernels = paged_decode_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "add_rms_norm"),
                                reason="C++ CPU kernels unavailable")
FLOATS = [torch.float32, torch.bfloat16]
NO_NORM = torch.empty(0)  # a place without a norm, for the kernels


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), hidden=st.sampled_from([8, 64, 576]), delta_dtype=st.sampled_from(FLOATS + [None]),
       out_dtype=st.sampled_from(FLOATS), delta_normed=st.booleans(), seed=st.integers(0, 2**16))
def test_add_rms_norm_equals_add_then_norm(rows: int, hidden: int, delta_dtype: torch.dtype | None,
                                           out_dtype: torch.dtype, delta_normed: bool, seed: int) -> None:
    """residual += delta, or += RMSNorm(delta) * delta_weight (Gemma's norms on a sublayer's output); then the
    next norm."""
    gen = torch.Generator().manual_seed(seed)
    residual = torch.randn(rows, hidden, generator=gen) * 3
    weight = 1 + torch.randn(hidden, generator=gen) * 0.1
    delta_weight = 1 + torch.randn(hidden, generator=gen) * 0.1 if delta_normed else NO_NORM
    delta = torch.randn(rows, hidden, generator=gen).to(delta_dtype) if delta_dtype else torch.empty(0)
    added = delta.float()
    if delta_dtype and delta_normed:
        added = F.rms_norm(added, (hidden,), delta_weight, 1e-5)
    expected_residual = residual + (added if delta_dtype else 0)
    expected = F.rms_norm(expected_residual, (hidden,), weight, 1e-5)
    out = torch.empty(rows, hidden, dtype=out_dtype)
    kernels.add_rms_norm(residual, delta, delta_weight, weight, 1e-5, out)
    torch.testing.assert_close(residual, expected_residual, rtol=1e-6, atol=1e-6)
    if out_dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding step at most (the fp32 sums may differ in their last bit)
        torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("in_dtype", FLOATS)
@pytest.mark.parametrize("out_dtype", FLOATS)
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_gated_activation_equals_activation_times_up(in_dtype: torch.dtype, out_dtype: torch.dtype, rows: int,
                                                     activation: str) -> None:
    """SwiGLU's silu_mul and GeGLU's gelu_tanh_mul (torch's tanh-approximate GELU)."""
    gate_up = (torch.randn(rows, 2 * 96) * 4).to(in_dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    activated = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    expected = (activated * up).to(out_dtype)
    out = torch.empty(rows, 96, dtype=out_dtype)
    getattr(kernels, f"{activation}_mul")(gate_up, out)
    tolerance = 1e-5 if out_dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("kv_dtype", FLOATS)
@pytest.mark.parametrize("qkv_dtype", FLOATS)
def test_rope_write_kv_equals_rotate_then_write(qkv_dtype: torch.dtype, kv_dtype: torch.dtype, qk_norm: bool) -> None:
    """Into an fp32 or a bf16 cache; with a bf16 cache K and V come back rounded as cached. With QK-norm
    weights each Q and K head is RMS-normalized first (Qwen3, Gemma 3)."""
    tokens, heads, kv_heads, head_dim, block_size, num_blocks = 7, 9, 3, 64, 4, 6
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(qkv_dtype)
    positions = torch.tensor([0, 5, 17, 3, 3, 99, 42])
    angles = torch.outer(torch.arange(128, dtype=torch.float32), torch.rand(head_dim // 2, generator=gen))
    cos, sin = angles.cos(), angles.sin()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=kv_dtype) for _ in range(4)]

    q_norm, k_norm = (1 + torch.randn(head_dim, generator=gen) * 0.2 for _ in "qk")
    wide = qkv.float().clone()  # normalized in place below: the kernel reads the raw qkv
    if qk_norm:
        head_rms_norm_(wide, q_norm, k_norm, heads, kv_heads, 1e-6)
    else:
        q_norm = k_norm = NO_NORM
    qk = apply_rope(wide[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim),
                    cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    q_ref, k_ref = qk.split([heads, kv_heads], dim=1)
    v_ref = wide[:, (heads + kv_heads) * head_dim:].reshape(tokens, kv_heads, head_dim)
    write_kv(k_ref, v_ref, caches[0], caches[1], slots)
    k_ref, v_ref = k_ref.to(kv_dtype).float(), v_ref.to(kv_dtype).float()

    q, k, v = torch.empty(tokens, heads, head_dim), torch.empty(tokens, kv_heads, head_dim), torch.empty(
        tokens, kv_heads, head_dim)
    kernels.rope_write_kv(qkv, positions, cos, sin, slots, q_norm, k_norm, 1e-6, caches[2], caches[3], q, k, v)
    for got, want in [(q, q_ref), (k, k_ref), (v, v_ref), (caches[2], caches[0]), (caches[3], caches[1])]:
        # bf16: an fp32 rotation differing in the last bit may round to the neighbouring bf16 value
        tolerance = 1e-5 if got.dtype == torch.float32 and kv_dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got, want, rtol=tolerance, atol=1e-5)


def test_rope_write_kv_refuses_a_slot_or_position_outside_its_table() -> None:
    qkv = torch.randn(1, 5 * 8)
    caches = [torch.zeros(2, 4, 1, 8) for _ in range(2)]
    cos = sin = torch.ones(16, 4)
    q, k, v = torch.empty(1, 3, 8), torch.empty(1, 1, 8), torch.empty(1, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 outside the cache"):
        kernels.rope_write_kv(qkv, torch.tensor([0]), cos, sin, torch.tensor([8]), NO_NORM, NO_NORM, 1e-6, *caches, q,
                              k, v)
    with pytest.raises(RuntimeError, match="position 16 outside the rope table"):
        kernels.rope_write_kv(qkv, torch.tensor([16]), cos, sin, torch.tensor([0]), NO_NORM, NO_NORM, 1e-6, *caches, q,
                              k, v)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    return load_checkpoint(str(write_tiny_llama(tmp_path_factory.mktemp("tiny"))))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_equals_the_op_path(tiny_checkpoint, weight_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """A mixed step (a fresh prefill, a chunk continuing a cached prefix, two decodes), then a decode step:
    the fused forward's logits and KV cache equal the op-by-op forward's (fp32 or bf16 KV cache)."""
    model = LlamaModel.from_weights(tiny_checkpoint.config, tiny_checkpoint.weights, weight_dtype=weight_dtype,
                                    kv_dtype=kv_dtype)
    assert model.fused_ops is not None
    block_size, gen = 4, torch.Generator().manual_seed(0)
    table = torch.arange(24).view(4, 6)
    results = []
    for fused in (True, False):
        ops, model.fused_ops = model.fused_ops, (model.fused_ops if fused else None)
        kv = model.allocate_kv_cache(24, block_size)
        gen.manual_seed(0)
        # Cache 8 tokens of sequences 1..3 first (sequence 1 will continue with a chunk, 2 and 3 decode).
        warm_ids = torch.randint(model.config.vocab_size, (24,), generator=gen)
        warm_pos = torch.arange(8).repeat(3)
        warm_slots = torch.cat([table[r, torch.arange(8) // block_size] * block_size + torch.arange(8) % block_size
                                for r in (1, 2, 3)])
        meta = AttentionMetadata.build([0, 8, 16, 24], [8, 8, 8], table[1:], warm_slots, block_size,
                                       model.decode_kernel)
        model.forward(warm_ids, warm_pos, meta, kv)
        ids = torch.randint(model.config.vocab_size, (6 + 3 + 1 + 1,), generator=gen)
        pos = torch.tensor([0, 1, 2, 3, 4, 5, 8, 9, 10, 8, 8])
        rows = torch.tensor([0] * 6 + [1] * 3 + [2, 3])
        slots = table[rows, pos // block_size] * block_size + pos % block_size
        meta = AttentionMetadata.build([0, 6, 9, 10, 11], [6, 11, 9, 9], table, slots, block_size, model.decode_kernel)
        logits = model.forward(ids, pos, meta, kv, torch.tensor([5, 8, 9, 10]))
        decode_pos = torch.tensor([6, 11, 9, 9])
        decode_slots = table[torch.arange(4), decode_pos // block_size] * block_size + decode_pos % block_size
        meta = AttentionMetadata.build([0, 1, 2, 3, 4], [7, 12, 10, 10], table, decode_slots, block_size,
                                       model.decode_kernel)
        decode_logits = model.forward(logits.argmax(-1), decode_pos, meta, kv)
        results.append((logits, decode_logits, torch.stack([torch.stack(pair) for pair in kv])))
        model.fused_ops = ops
    tolerance = 1e-4 if weight_dtype == torch.float32 and kv_dtype == torch.float32 else 5e-2
    for fused, reference in zip(*results):
        torch.testing.assert_close(fused, reference, rtol=tolerance, atol=tolerance)


def test_layers_the_kernels_cannot_read_keep_the_op_path(tiny_checkpoint) -> None:
    fp16 = LlamaModel.from_weights(tiny_checkpoint.config, tiny_checkpoint.weights, weight_dtype=torch.float16)
    assert fp16.fused_ops is None
    no_kernels = LlamaModel.from_weights(tiny_checkpoint.config, tiny_checkpoint.weights, use_cpu_kernels=False)
    assert no_kernels.fused_ops is None


def _decode_twice(model: LlamaModel, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One pure decode step of `batch` sequences with ragged contexts, run by the C++ layer loop and by the
    Python one on copies of the same cache: (logits, stacked KV cache) of each."""
    block_size, blocks_each = 4, 4
    gen = torch.Generator().manual_seed(batch)
    kv = model.allocate_kv_cache(batch * blocks_each, block_size)
    table = torch.arange(batch * blocks_each).view(batch, blocks_each)
    contexts = torch.randint(1, block_size * blocks_each - 1, (batch,), generator=gen)
    for row, context in enumerate(contexts.tolist()):
        pos = torch.arange(context)
        slots = table[row, pos // block_size] * block_size + pos % block_size
        meta = AttentionMetadata.build([0, context], [context], table[row:row + 1], slots, block_size)
        model.forward(torch.randint(model.config.vocab_size, (context,), generator=gen), pos, meta, kv)
    slots = table[torch.arange(batch), contexts // block_size] * block_size + contexts % block_size
    meta = AttentionMetadata.build(list(range(batch + 1)), (contexts + 1).tolist(), table, slots, block_size,
                                   model.decode_kernel)
    ids = torch.randint(model.config.vocab_size, (batch,), generator=gen)
    results = []
    for in_cpp in (True, False):
        model.fused_decode = in_cpp
        cache = [(k.clone(), v.clone()) for k, v in kv]
        logits = model.forward(ids, contexts, meta, cache)
        results.append((logits, torch.stack([torch.stack(pair) for pair in cache])))
    model.fused_decode = True
    return results


@pytest.mark.parametrize("form", ["float32", "bfloat16", "q4_1", "q4_1 torch int4", "q8_0", "q8_0 float32 kernel",
                                  "float32 bf16 KV"])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_decode_layers_in_cpp_equal_the_python_layer_loop(tiny_checkpoint, tiny_model_dir, tmp_path, monkeypatch,
                                                          form: str, batch: int) -> None:
    """A pure decode step through `decode_layers` (all layers in one C++ call) gives bit-identical logits and
    KV cache to the Python loop over the same kernels: for dense fp32 and bf16 weights, for packs (<= 16 rows:
    our int8-dot Q4 and Q8_0 packs where they run natively, torch's int4 pack, the float32 Q8_0 kernel's tiles)
    and their bf16 copies (17 rows)."""
    if form != "float32" and form != "bfloat16":
        if form == "q8_0 float32 kernel":  # as on an AVX-512 CPU, where Q8_0 tiles keep no dense copy
            monkeypatch.setattr(quantized, "avx512_native", lambda: True)
        tensor_type = QType.Q8_0 if form.startswith("q8_0") else QType.Q4_1
        kept = load_checkpoint(str(write_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", tensor_type)),
                               keep_quantized=True)
        thresholds = PackThresholds(int8_dot=form not in ("q4_1 torch int4", "q8_0 float32 kernel"))
        model = LlamaModel.from_weights(kept.config, kept.weights, quantized=True, thresholds=thresholds)
        if form == "q8_0" and model.layers[0].qkv.form != "q8_0_vnni":
            pytest.skip("the int8-dot kernels do not run natively here")
    else:
        model = LlamaModel.from_weights(tiny_checkpoint.config, tiny_checkpoint.weights,
                                        weight_dtype=getattr(torch, form.split()[0]),
                                        kv_dtype=torch.bfloat16 if form.endswith("bf16 KV") else None)
    assert model.fused_decode and model.decode_plan(batch) is not None  # the C++ loop really runs
    (cpp_logits, cpp_kv), (py_logits, py_kv) = _decode_twice(model, batch)
    assert torch.equal(cpp_logits, py_logits)
    assert torch.equal(cpp_kv, py_kv)


# A Q4_K_M-like mix over two layers of width 256 (K-quants need rows of 256): Q4_K Q and K beside a Q6_K V, a
# Q5_K o_proj, Q4_K gate beside a Q8_0 up, Q6_K down; then Q5_0 Q beside Q8_0 K and Q5_K V, Q8_0 o_proj, Q5_0
# down. Each stack of types is a `RowStack` of packs, run as one projection of several parts.
_MIXED_TYPES = {
    "blk.0.attn_q.weight": QType.Q4_K, "blk.0.attn_k.weight": QType.Q4_K, "blk.0.attn_v.weight": QType.Q6_K,
    "blk.0.attn_output.weight": QType.Q5_K, "blk.0.ffn_gate.weight": QType.Q4_K, "blk.0.ffn_down.weight": QType.Q6_K,
    "blk.1.attn_q.weight": QType.Q5_0, "blk.1.attn_v.weight": QType.Q5_K, "blk.1.ffn_gate.weight": QType.Q4_K,
    "blk.1.ffn_up.weight": QType.Q4_K, "blk.1.ffn_down.weight": QType.Q5_0, "output.weight": QType.Q6_K,
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory):
    hf_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny-256"), hidden=256, inter=512)
    path = write_tiny_gguf(hf_dir, tmp_path_factory.mktemp("mixed") / "mixed.gguf", QType.Q8_0, types=_MIXED_TYPES)
    return load_checkpoint(str(path), keep_quantized=True)


@pytest.mark.skipif(not int8_dot_available(), reason="the int8-dot and K-quant kernels do not run natively here")
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_decode_layers_run_k_quants_and_row_stacks_in_cpp(mixed_gguf, batch: int) -> None:
    """A GGUF mixing Q4_K, Q5_K, Q6_K, Q8_0 and Q5_0 decodes through `decode_layers`: K-quant packs and row stacks
    of packs (1 and 3 rows) and the stacks' bf16 copies (17 rows), bit for bit as the Python layer loop."""
    model = LlamaModel.from_weights(mixed_gguf.config, mixed_gguf.weights, quantized=True)
    first, second = model.layers
    assert (first.qkv.form, first.o_proj.form, first.gate_up.form, first.down.form) == (
        "q4_k_vnni+q6_k_vnni", "q5_k_vnni", "q4_k_vnni+q8_0_vnni", "q6_k_vnni")
    assert (second.qkv.form, second.o_proj.form, second.down.form) == (
        "q8_0_vnni+q8_0_vnni+q5_k_vnni", "q8_0_vnni", "q8_0_vnni")
    plan = model.decode_plan(batch)
    assert model.fused_decode and plan is not None  # the C++ loop really runs
    f = ProjectionForm
    packed = [2, f.Q4_K, 384, f.Q6_K, 128, 1, f.Q5_K, 256, 2, f.Q4_K, 512, f.Q8_DOT, 512, 1, f.Q6_K, 256,
              3, f.Q8_DOT, 256, f.Q8_DOT, 128, f.Q5_K, 128, 1, f.Q8_DOT, 256, 1, f.Q4_K, 1024, 1, f.Q8_DOT, 256]
    dense = [1, f.DENSE, 512, 1, f.DENSE, 256, 1, f.DENSE, 1024, 1, f.DENSE, 256] * 2
    assert plan.layout == (packed if batch <= 8 else dense)
    (cpp_logits, cpp_kv), (py_logits, py_kv) = _decode_twice(model, batch)
    assert torch.isfinite(cpp_logits).all() and cpp_logits.std() > 0
    assert torch.equal(cpp_logits, py_logits)
    assert torch.equal(cpp_kv, py_kv)


def test_decode_plan_leaves_forms_the_loop_cannot_run_to_python(tiny_checkpoint) -> None:
    """A projection in a form `decode_layers` does not run (an fp16 matrix) gives no plan: the step keeps the
    Python layer loop."""
    model = LlamaModel.from_weights(tiny_checkpoint.config, tiny_checkpoint.weights)
    assert plan_decode(model.layers, 1) is not None
    assert decode_projection(model.layers[1].down.half(), 1) is None
    layers = [*model.layers[:1], dataclasses.replace(model.layers[1], down=model.layers[1].down.half())]
    assert plan_decode(layers, 1) is None


def test_the_cpp_layer_loop_ticks_progress_per_layer_as_the_python_one(tiny_checkpoint) -> None:
    """The engine core's heartbeat counts layers during a step: the one-call loop (which releases the GIL) ticks
    the counter's `layer_ticks` once per layer, the Python loop its `tick`, so both steps count the same."""
    model = LlamaModel.from_weights(tiny_checkpoint.config, tiny_checkpoint.weights, weight_dtype=torch.float32)
    assert model.fused_decode and model.decode_plan(2) is not None
    progress = Progress(layer_ticks=torch.zeros(1, dtype=torch.int64))
    model.progress = progress
    _decode_twice(model, 2)  # one C++ step and one Python step, after the prefills (Python, a tick a layer)
    layers = model.config.num_layers
    assert int(progress.layer_ticks[0]) == layers  # the C++ step
    assert progress.count == progress.turns + layers
    assert progress.turns % layers == 0 and progress.turns >= 3 * layers  # 2 prefills + the Python step
