"""The int8-dot kernels' AVX2 path (csrc/int8_dot_matmul.cpp, `vpmaddubsw` + `vpmaddwd`), tested on any x86-64
machine by building the kernels for `x86-64-v3` (AVX2 + FMA + F16C, no AVX-512) beside the native build: the
same products as the PyTorch twin of the kernels' arithmetic (and as the native build), on random shapes and
at the int16 saturation edges (Q8_0 codes -128 and 127 against activation codes of +-127)."""

from __future__ import annotations

import platform
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloop.model import cpu_kernels, int8_dot
from tokenloop.model.int8_dot import Int4DotWeight, Q8DotWeight

AVX2_MARCH = "x86-64-v3"
native = cpu_kernels.paged_decode_kernels()

needs_x86_kernels = pytest.mark.skipif(native is None or platform.machine() != "x86_64",
                                       reason="needs the C++ CPU kernels on x86-64")


@pytest.fixture(scope="module")
def avx2() -> ModuleType:
    """The kernels built for x86-64-v3 (once per source version in the kernel cache: ~1-4 min the first time),
    loaded beside the native build."""
    return cpu_kernels.build_kernels(AVX2_MARCH)


def _run(kernels: ModuleType, weight: Int4DotWeight | Q8DotWeight, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.out_features)
    name = "int4_dot_matmul" if isinstance(weight, Int4DotWeight) else "q8_0_dot_matmul"
    getattr(kernels, name)(x.float().contiguous(), weight.codes, weight.scales, out)
    return out


def _coded_part(weight: Int4DotWeight | Q8DotWeight) -> torch.Tensor:
    """|the weights the activations' codes multiply| [N, K]: d q for Q4 (its m term takes the float sums), all of
    W for Q8_0."""
    if isinstance(weight, Int4DotWeight):
        codes, d, _ = weight.unpack()
        d_q = (codes.view(codes.shape[0], -1, 32).float() * d[..., None]).view(codes.shape)
        return d_q[:weight.out_features, :weight.in_features].abs()
    return weight.dequantize().abs()


def _magnitude(weight: Int4DotWeight | Q8DotWeight, x: torch.Tensor) -> torch.Tensor:
    """|x| @ (|W| + |the coded part|).T: the scale of float32 rounding, [M, N]."""
    return x.abs().double() @ (weight.dequantize().abs() + _coded_part(weight)).double().t()


def _check(avx2: ModuleType, weight: Int4DotWeight | Q8DotWeight, x: torch.Tensor) -> None:
    """The AVX2 build against the native build (the same quantizer arithmetic, exact integer sums: float32
    rounding apart only) and against the PyTorch twin, which may round an activation's remainder code the other
    way at a tie (its x - q dx is not fused): allowed one remainder step per block. A saturated int16 sum of
    random codes would be off by many code steps."""
    got = _run(avx2, weight, x).double()
    close = 1e-5 * _magnitude(weight, x) + 1e-30
    assert ((got - _run(native, weight, x).double()).abs() <= close).all()
    blocks = weight.codes.shape[1]
    dense = torch.nn.functional.pad(_coded_part(weight), (0, blocks * 32 - weight.in_features))
    remainder_step = int8_dot.quantize_activations(x, blocks).scales.double() / int8_dot.REMAINDER_STEPS
    tie = remainder_step @ dense.view(dense.shape[0], blocks, 32).amax(-1).double().t()
    assert ((got - weight.reference(x).double()).abs() <= close + tie).all()


@needs_x86_kernels
@pytest.mark.slow
def test_the_avx2_build_reports_its_target(avx2: ModuleType) -> None:
    isa = cpu_kernels.compiled_isa(avx2)
    assert isa is not None and {"avx2", "fma", "f16c"} <= isa and "avx512f" not in isa
    assert avx2.int8_dot_native()
    assert cpu_kernels.kernel_build_dir(AVX2_MARCH) != cpu_kernels.kernel_build_dir("native")


@needs_x86_kernels
@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 80), k=st.integers(1, 700), rows=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_avx2_int4_dot_equals_the_reference(avx2: ModuleType, n: int, k: int, rows: int, seed: int) -> None:
    """Any N (ragged against the 16-column tiles and their 8-column halves), K (ragged against the blocks),
    rows across the 1- and 2-row register blocks."""
    gen = torch.Generator().manual_seed(seed)
    weight = Int4DotWeight.quantize(torch.randn(n, k, generator=gen) * 0.1)
    x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[:, :5] *= 30  # outliers, as activations have
    _check(avx2, weight, x)


@needs_x86_kernels
@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 80), blocks=st.integers(1, 24), rows=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_avx2_q8_dot_equals_the_reference(avx2: ModuleType, n: int, blocks: int, rows: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, blocks * 32), dtype=torch.int8, generator=gen)
    scales = (torch.rand(n, blocks, generator=gen) * 0.02).half().float()
    x = torch.randn(rows, blocks * 32, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    _check(avx2, Q8DotWeight.from_codes(codes, scales), x)


def _extreme_activations(rows: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows whose blocks quantize to codes of +-127: every value +-1 (remainders 0), or one +-1 and the rest
    +-126.5/127 (codes +-126, remainders +-127)."""
    signs = torch.where(torch.rand(rows, k, generator=gen) < 0.5, -1.0, 1.0)
    x = signs.clone()
    x[rows // 2:] *= 126.5 / 127
    x[rows // 2:, ::32] = signs[rows // 2:, ::32]  # each block's maximum, so dx = 1/127
    return x


@needs_x86_kernels
@pytest.mark.slow
@pytest.mark.parametrize("extreme", [-128, 127, "mixed"])
def test_avx2_q8_dot_is_exact_at_the_saturation_edges(avx2: ModuleType, extreme: int | str) -> None:
    """Stored codes 0 / 255 against +-127: the stored-code product (2 x 255 x 127 per pair) would saturate
    `vpmaddubsw`; the kernel's |q| x sign-applied activations reach 2 x 128 x 127 = 32512, exact."""
    gen = torch.Generator().manual_seed(7)
    n, k, rows = 40, 4 * 32, 6
    if extreme == "mixed":
        codes = torch.where(torch.rand(n, k, generator=gen) < 0.5, -128, 127).to(torch.int8)
    else:
        codes = torch.full((n, k), extreme, dtype=torch.int8)
    weight = Q8DotWeight.from_codes(codes, torch.ones(n, k // 32))
    x = _extreme_activations(rows, k, gen)
    quantized = int8_dot.quantize_activations(x, k // 32)
    assert quantized.codes.abs().max() == 127 and quantized.remainders.abs().max() == 127
    # The kernels' arithmetic in float64: integer code sums, then the scales (dx = 1/127, d = 1).
    grouped = codes.double().view(n, -1, 32)
    expected = sum((torch.einsum("mbk,nbk->mnb", xq.double(), grouped) * dx.double()[:, None, :]).sum(-1)
                   for xq, dx in quantized.terms())
    got = _run(avx2, weight, x).double()
    # Float32 rounding of the block sums only; one saturated pair would be off by ~d dx x 10^2..10^4 (~1..100).
    close = 1e-6 * _magnitude(weight, x)
    assert ((got - expected).abs() <= close).all()
    assert ((got - _run(native, weight, x).double()).abs() <= close).all()
    assert (close < 0.05).all()


@needs_x86_kernels
@pytest.mark.slow
def test_avx2_int4_dot_is_exact_with_the_largest_codes(avx2: ModuleType) -> None:
    """Codes 15 against +-127: the block's 8 pair sums per int16 reach 8 x 2 x 15 x 127 = 30480, no overflow."""
    gen = torch.Generator().manual_seed(8)
    n, k, rows = 24, 3 * 32, 6
    codes = torch.full((n, k), 15, dtype=torch.uint8)
    weight = Int4DotWeight.from_codes(codes, torch.ones(n, k // 32), torch.zeros(n, k // 32))
    x = torch.ones(rows, k)  # every code and every product at its maximum, same sign
    x[rows // 2:] = _extreme_activations(rows - rows // 2, k, gen).abs()
    expected = weight.reference(x)
    got = _run(avx2, weight, x)
    assert torch.allclose(got, expected, rtol=1e-6)
    assert torch.allclose(got[0], torch.full((n,), 15.0 * k), rtol=1e-6)


@needs_x86_kernels
@pytest.mark.slow
def test_avx512_native_follows_the_loaded_build(avx2: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Q8_0 dense-copy rule reads what the kernels were compiled for, not the CPU's flags."""
    monkeypatch.setattr(cpu_kernels, "paged_decode_kernels", lambda: avx2)
    assert not cpu_kernels.avx512_native()
    monkeypatch.setattr(cpu_kernels, "paged_decode_kernels", lambda: None)  # no build: the CPU's flags
    assert cpu_kernels.avx512_native() == ("avx512f" in cpu_kernels._cpu_model().split())


def test_kernel_march_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENLOOP_KERNEL_MARCH", raising=False)
    assert cpu_kernels.kernel_march() == "native"
    default_dir = cpu_kernels.kernel_build_dir()
    monkeypatch.setenv("TOKENLOOP_KERNEL_MARCH", AVX2_MARCH)
    assert cpu_kernels.kernel_march() == AVX2_MARCH
    assert cpu_kernels.kernel_build_dir() == cpu_kernels.kernel_build_dir(AVX2_MARCH) != default_dir
    monkeypatch.setenv("TOKENLOOP_KERNEL_MARCH", "native -O0")
    with pytest.raises(ValueError, match="not a -march value"):
        cpu_kernels.kernel_march()
