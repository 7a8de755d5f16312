"""Gemma 3 on the fused CPU path: a tiny random Gemma 3 whose sliding window (8 keys) is shorter than its prompts
gives the op path's logits and KV cache through the fused per-layer kernels and, for a pure decode step, the
one-call C++ loop (bit for bit the per-layer loop's), at prefill, mixed and decode steps, with the sliding
group's passed blocks released (id -1) and overwritten as another request would."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.model.test_families import write_tiny_family
from tests.model.test_loader import write_tiny_gguf
from tokenloop.model.attention import AttentionMetadata
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.loader import load_checkpoint
from tokenloop.model.models.gemma3 import Gemma3Model
from tokenloop.model.quantized import PackThresholds

kernels = paged_decode_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "gelu_tanh_mul"),
                                reason="C++ CPU kernels unavailable")
BLOCK_SIZE, NUM_BLOCKS = 4, 24  # per KV group: group g's block b is pool block b + g * NUM_BLOCKS


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_family(tmp_path_factory.mktemp("gemma3"), "gemma3_text")


@dataclass
class _Sequence:
    token_ids: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0


def _step(model: Gemma3Model, kv: list[tuple[torch.Tensor, torch.Tensor]], work: list[tuple[_Sequence, int]],
          kernels_on: bool) -> torch.Tensor:
    """One flat step of (sequence, new tokens): each group's table from the sequences' blocks, a sliding group's
    entries before its window released (-1) and their blocks filled with NaN (what a reuse would leave there:
    a read of one shows). The logits of each sequence's last token."""
    ids, positions, starts, seq_lens, rows = [], [], [0], [], []
    for row, (seq, n) in enumerate(work):
        end = seq.computed + n
        while len(seq.blocks) * BLOCK_SIZE < end:
            seq.blocks.append(len(seq.blocks) + row * 6)  # six blocks a sequence: disjoint, not in order
        ids += seq.token_ids[seq.computed:end]
        positions += range(seq.computed, end)
        rows += [row] * n
        starts.append(starts[-1] + n)
        seq_lens.append(end)
    width = max(len(seq.blocks) for seq, _ in work)
    table = torch.tensor([seq.blocks + [0] * (width - len(seq.blocks)) for seq, _ in work])
    pos = torch.tensor(positions)
    metas = []
    for g, group in enumerate(model.kv_groups()):
        group_table = table + g * NUM_BLOCKS
        window = group.window if group.kind == "sliding" else 0
        if window:  # a query at the step's first position sees keys from first - window + 1 on
            for row, (seq, _) in enumerate(work):
                passed = max(0, seq.computed - window + 1) // BLOCK_SIZE
                for block in group_table[row, :passed].tolist():
                    for key_cache, value_cache in kv:
                        key_cache[block] = value_cache[block] = float("nan")
                group_table[row, :passed] = -1
        slots = group_table[torch.tensor(rows), pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        metas.append(AttentionMetadata.build(starts, seq_lens, group_table, slots, BLOCK_SIZE,
                                             model.decode_kernel if kernels_on else None, window=window))
    for seq, n in work:
        seq.computed += n
    with torch.inference_mode():
        return model.forward(torch.tensor(ids), pos, metas, kv, torch.tensor(starts[1:]) - 1)


def _run(model: Gemma3Model, mode: str) -> list[torch.Tensor]:
    """Prefill, mixed (a decode, a chunk continuing past the window, a fresh prompt), then two pure decode
    steps, in `mode`: "cpp loop", "python loop" (the fused per-layer kernels) or "op path" (PyTorch ops,
    gather + SDPA attention). Each step's logits, then the KV cache."""
    ops, loop = model.fused_ops, model.fused_decode
    model.fused_ops = None if mode == "op path" else ops
    model.fused_decode = mode == "cpp loop"
    try:
        gen = torch.Generator().manual_seed(0)
        a, b, c = (_Sequence(torch.randint(model.config.vocab_size, (n,), generator=gen).tolist())
                   for n in (30, 30, 30))
        kv = model.allocate_kv_cache(NUM_BLOCKS * len(model.kv_groups()), BLOCK_SIZE)
        on = mode != "op path"
        results = [_step(model, kv, [(a, 19), (b, 7)], on),
                   _step(model, kv, [(a, 1), (b, 6), (c, 6)], on),
                   _step(model, kv, [(a, 1), (b, 1), (c, 1)], on),
                   _step(model, kv, [(a, 1), (b, 1), (c, 1)], on)]
        return results + [torch.stack([torch.stack(pair) for pair in kv]).nan_to_num(0.0)]
    finally:
        model.fused_ops, model.fused_decode = ops, loop


def _model(gemma_dir: Path, tmp_path: Path, form: str) -> Gemma3Model:
    if form == "q8_0":
        kept = load_checkpoint(str(write_tiny_gguf(gemma_dir, tmp_path / "g.gguf", QType.Q8_0)), keep_quantized=True)
        model = Gemma3Model.from_weights(kept.config, kept.weights, quantized=True, thresholds=PackThresholds())
    else:
        checkpoint = load_checkpoint(str(gemma_dir))
        bf16 = form == "bfloat16"
        model = Gemma3Model.from_weights(checkpoint.config, checkpoint.weights,
                                         weight_dtype=torch.bfloat16 if bf16 else None,
                                         kv_dtype=torch.bfloat16 if bf16 else None)
    assert isinstance(model, Gemma3Model)
    return model


@pytest.mark.parametrize("form", ["float32", "bfloat16", "q8_0"])
def test_fused_gemma3_equals_the_op_path_and_its_cpp_loop_the_python_loop(gemma_dir: Path, tmp_path: Path,
                                                                          form: str) -> None:
    model = _model(gemma_dir, tmp_path, form)
    kinds = [group.kind for group in model.kv_groups()]
    assert kinds == ["full", "sliding"] and model.config.sliding_window == 8
    assert model.fused_ops is not None and model.fused_decode
    assert model.decode_plan(3) is not None  # the pure decode steps run in the C++ loop
    cpp, python, reference = (_run(model, mode) for mode in ("cpp loop", "python loop", "op path"))
    for got, want in zip(cpp, python):
        assert torch.equal(got, want)
    tolerance = 1e-4 if form == "float32" else 5e-2
    for got, want in zip(cpp, reference):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert all(torch.isfinite(logits).all() for logits in cpp[:-1])
