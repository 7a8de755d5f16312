"""The native LoRA products (csrc/lora_sgmv.cpp) and their PyTorch twin (LoRABatch.add_reference_), each against
the exact sum in float64 within the rounding it does: any shapes, ranks, adapters per slot and grouping of a
step's rows by adapter, in float32, bfloat16 and int8 slots (codes times row scales)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloop.config import ModelConfig
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.lora import FUSED_PROJECTIONS, LoRAAdapter, projection_shapes
from tokenloop.model.lora_slots import AdapterSlots, LoRABatch, quantize_rows

KERNELS = paged_decode_kernels()
needs_kernel = pytest.mark.skipif(KERNELS is None or not hasattr(KERNELS, "lora_sgmv"),
                                  reason="the C++ CPU kernels are not built here")
MODULES = [module for modules in FUSED_PROJECTIONS.values() for module in modules]


def _config(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=hidden, intermediate_size=inter,
                       num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


def _adapter(name: str, config: ModelConfig, rank: int, targets: list[str], dtype: torch.dtype,
             gen: torch.Generator) -> LoRAAdapter:
    shapes = projection_shapes(config)
    layers = [{module: (torch.randn(rank, shapes[module][1], generator=gen).to(dtype),
                        torch.randn(shapes[module][0], rank, generator=gen).to(dtype)) for module in targets}
              for _ in range(config.num_layers)]
    return LoRAAdapter(name, "-", rank, 1.0, tuple(targets), layers)


def _exact(batch: LoRABatch, base: torch.Tensor, x: torch.Tensor, layer: int, kind: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """base + each row's (x A^T) B^T in float64 from the inputs as given, and the same sum over the terms'
    absolute values (the scale of any path's rounding error)."""
    width, rank, columns = batch.slots.width[kind], batch.slots.max_rank, batch.slots.part_columns[kind]
    exact, magnitude = base.double(), base.double().abs()
    for row, slot in enumerate(batch.token_slots.tolist()):
        if slot < 0:
            continue
        a = batch.slots.a[layer][kind][slot * width:(slot + 1) * width].double()
        if batch.slots.quantized:  # int8 codes: row j's scale (A's times B^T's) applies to shrunk value j
            a *= batch.slots.scales[layer][kind][slot * width:(slot + 1) * width].double()[:, None]
        folded = batch.slots.bt[layer][kind][slot * rank:(slot + 1) * rank].double()
        bt = torch.zeros(width, folded.shape[1], dtype=torch.float64)  # B^T block-diagonal, unfolded
        for part, (first, end) in enumerate(zip(columns, columns[1:])):
            bt[part * rank:(part + 1) * rank, first:end] = folded[:, first:end]
        shrunk = x[row].double() @ a.T
        exact[row] += shrunk @ bt
        magnitude[row] += (x[row].double().abs() @ a.abs().T) @ bt.abs()
    return exact, magnitude


@needs_kernel
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), hidden=st.sampled_from([8, 32, 40]), heads=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([4, 8, 16]), inter=st.sampled_from([8, 24, 300]),
       max_rank=st.integers(1, 16), max_loras=st.integers(1, 5), tokens=st.integers(1, 19),
       weights=st.sampled_from([torch.float32, torch.bfloat16, torch.int8]),
       activations=st.sampled_from([torch.float32, torch.bfloat16]))
def test_kernel_equals_pytorch_path(data: st.DataObject, hidden: int, heads: int, head_dim: int, inter: int,
                                    max_rank: int, max_loras: int, tokens: int, weights: torch.dtype,
                                    activations: torch.dtype) -> None:
    kv_heads = data.draw(st.sampled_from([h for h in (1, 2, heads) if heads % h == 0]), label="kv_heads")
    config = _config(hidden, heads, kv_heads, head_dim, inter)
    slots = AdapterSlots(config, max_loras, max_rank, weights, kernel=KERNELS)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    names = []
    for index in range(data.draw(st.integers(1, max_loras), label="adapters")):
        rank = data.draw(st.integers(1, max_rank), label="rank")
        targets = data.draw(st.lists(st.sampled_from(MODULES), min_size=1, unique=True), label="targets")
        host = torch.float32 if weights == torch.int8 else weights  # int8 slots quantize at the copy
        slots.register(_adapter(f"ad{index}", config, rank, targets, host, gen))
        names.append(f"ad{index}")
    slot_of = slots.slots_for(names)
    # Each token: the base model (-1) or one of the adapters, in any order (rows of one adapter need not touch).
    choice = data.draw(st.lists(st.integers(-1, len(names) - 1), min_size=tokens, max_size=tokens), label="rows")
    batch = slots.batch(np.array([-1 if c < 0 else slot_of[names[c]] for c in choice], dtype=np.int64))
    if batch is None:
        assert all(c < 0 for c in choice)
        return
    assert batch.kernel is KERNELS
    for layer in range(config.num_layers):
        for kind in FUSED_PROJECTIONS:
            width_in = slots.a[layer][kind].shape[1]
            out_features = slots.bt[layer][kind].shape[1]
            x = torch.randn(tokens, width_in, generator=gen).to(activations)
            base = torch.randn(tokens, out_features, generator=gen).to(activations)
            native = batch.add_(base.clone(), x, layer, kind)
            reference = batch.add_reference_(base.float().clone(), x.float(), layer, kind)
            exact, magnitude = _exact(batch, base, x, layer, kind)
            # Each path against the exact sum, within the rounding it does: the kernel sums in float32 from the
            # inputs as given (bf16 outputs round once at the end); the PyTorch path, with bf16 weights, rounds x
            # and x A^T to bf16 first, so its error scales with the sum of the terms' magnitudes, not the result.
            out_rounding = 2**-8 if activations == torch.bfloat16 else 0.0
            assert torch.all((native.double() - exact).abs() <= 1e-5 * magnitude + out_rounding * exact.abs()
                             + 1e-6), (layer, kind)
            terms_rounding = 2**-6 if weights == torch.bfloat16 else 1e-5  # int8: float32 sums of exact codes
            assert torch.all((reference.double() - exact).abs() <= terms_rounding * magnitude + 1e-6), (layer, kind)
            untouched = torch.tensor([c < 0 for c in choice])
            assert torch.equal(native[untouched], base[untouched])


@needs_kernel
def test_kernel_refuses_bad_slots() -> None:
    config = _config(8, 2, 1, 4, 8)
    slots = AdapterSlots(config, 2, 4, kernel=KERNELS)
    with pytest.raises(RuntimeError, match="not a slot"):
        KERNELS.lora_sgmv(torch.zeros(1, 16), torch.zeros(1, 8), slots.a[0]["qkv"], slots.bt[0]["qkv"],
                          torch.empty(0), torch.tensor([2]), slots.width["qkv"], slots.part_columns["qkv"])
    int8 = AdapterSlots(config, 2, 4, torch.int8, kernel=KERNELS)
    with pytest.raises(RuntimeError, match="need scales"):
        KERNELS.lora_sgmv(torch.zeros(1, 16), torch.zeros(1, 8), int8.a[0]["qkv"], int8.bt[0]["qkv"],
                          torch.empty(0), torch.tensor([0]), int8.width["qkv"], int8.part_columns["qkv"])


def test_int8_rows_round_each_value_to_its_rows_step() -> None:
    rows = torch.tensor([1e-3, 1, 50, 0, 2, 7])[:, None]
    values = torch.randn(6, 70, generator=torch.Generator().manual_seed(2)) * rows
    codes, scales = quantize_rows(values)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert torch.equal(scales, values.abs().amax(dim=1) / 127) and scales[3] == 0 and not codes[3].any()
    assert torch.all((codes.float() * scales[:, None] - values).abs() <= scales[:, None] / 2 * (1 + 1e-6))


def test_int8_slots_products_stay_near_the_bf16_slots() -> None:
    """int8 slots (a packed base's) against bf16 ones from the same adapter: each product within a small
    share of its terms' magnitude (each A and B^T row rounds to 1/254 of its largest value)."""
    config = _config(64, 4, 2, 16, 96)
    gen = torch.Generator().manual_seed(7)
    adapter = _adapter("ad", config, 8, MODULES, torch.bfloat16, gen)
    results = []
    for dtype in (torch.bfloat16, torch.int8):
        slots = AdapterSlots(config, 2, 8, dtype, kernel=KERNELS if KERNELS is not None else None)
        slots.register(adapter)
        slot = slots.slots_for(["ad"])["ad"]
        batch = slots.batch(np.array([slot, -1, slot]))
        assert batch is not None
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
        results.append(batch.add_(torch.zeros(3, slots.bt[0]["qkv"].shape[1]), x, 1, "qkv"))
    bf16, int8 = results
    assert torch.equal(int8[1], torch.zeros_like(int8[1]))
    assert (int8 - bf16).abs().max() <= 0.02 * bf16.abs().max()


def test_a_reused_slot_holds_only_its_new_adapter() -> None:
    """A slot's rows are cleared only where the new adapter writes nothing (rank padding, projections it
    does not adapt): after a full-rank adapter on every projection, the slot equals a fresh one's."""
    config = _config(32, 4, 2, 8, 24)
    gen = torch.Generator().manual_seed(3)
    reused, fresh = AdapterSlots(config, 1, 8), AdapterSlots(config, 1, 8)
    reused.register(_adapter("full", config, 8, MODULES, torch.float32, gen))
    reused.slots_for(["full"])
    partial = _adapter("partial", config, 3, ["k_proj", "up_proj", "o_proj"], torch.float32, gen)
    reused.register(partial)
    fresh.register(partial)
    assert reused.slots_for(["partial"]) == fresh.slots_for(["partial"]) == {"partial": 0}
    assert (reused.num_loads, fresh.num_loads) == (2, 1) and reused.load_seconds > 0 and fresh.load_seconds > 0
    for layer in range(config.num_layers):
        for kind in FUSED_PROJECTIONS:
            assert torch.equal(reused.a[layer][kind], fresh.a[layer][kind])
            assert torch.equal(reused.bt[layer][kind], fresh.bt[layer][kind])


def test_adapter_bf16_rounding_equals_torch() -> None:
    from tokenloop.model.lora import _to_dtype

    values = torch.randn(64, 33, generator=torch.Generator().manual_seed(5)) * 100
    values[0, :5] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -1.0 - 2**-8, 3e38, -0.0])
    assert torch.equal(_to_dtype(values.numpy().copy(), torch.bfloat16), values.to(torch.bfloat16))


def test_int8_slots_on_a_packed_base_unless_dense_is_asked() -> None:
    from tokenloop.config import build_engine_config
    from tokenloop.core.adapters import adapter_dtype
    from tokenloop.errors import ConfigError
    from tokenloop.model.dtypes import DtypeChoice

    packed, fp32 = DtypeChoice("float32", "quantized", "-"), DtypeChoice("float32", "float32", "-")
    bf16 = DtypeChoice("float32", "bfloat16", "-")
    assert adapter_dtype(packed) == adapter_dtype(packed, "int8") == torch.int8
    assert adapter_dtype(packed, "dense") == torch.bfloat16  # the large-batch copy's dtype
    assert adapter_dtype(fp32) == adapter_dtype(fp32, "int8") == torch.float32
    assert adapter_dtype(bf16, "int8") == adapter_dtype(bf16, "dense") == torch.bfloat16
    from tokenloop.cli import _engine_options, build_parser

    args = build_parser().parse_args(["serve", "--lora", "a=/x", "--lora-dtype", "int8"])
    config = build_engine_config(**_engine_options(args)).lora
    assert config is not None and config.lora_dtype == "int8"
    default = build_engine_config(lora_modules={"a": "/x"}).lora
    assert default is not None and default.lora_dtype == "auto"
    with pytest.raises(ConfigError, match="lora_dtype"):
        build_engine_config(lora_modules={"a": "/x"}, lora_dtype="fp8")
