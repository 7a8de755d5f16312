"""The packed CPU weights built from GGUF tensors kept in their quantized form.

A `GGMLTensor` (`model/ggml_tensor.py`) is a weight matrix as the file stores it: rows of ggml blocks.
`PackedLinear` turns it into the forms CPU kernels consume directly:

- Q4_0 / Q4_1 / Q4_K -> torch's CPU int4 layout (`aten._weight_int4pack_mm_for_cpu`, group 32, bf16
  activations). ggml's `w = d * q + m` over 32 values is torch's `(q - 8) * scale + zero` with scale = d and
  zero = m + 8 d (Q4_0: m = -8 d, so zero = 0; Q4_K: each 32-value sub-block of a 256-value super-block has
  d = d_super * sc and m = -dmin_super * mn, from its 6-bit sc and mn). The 4-bit codes are kept bit for
  bit; d and zero are rounded to bf16, the only scale type the kernel takes.
- Q8_0 -> its own int8 codes and per-block scales, tiled by 16 output rows for our C++ kernel, which
  multiplies them in float32 at any batch size (torch's int8 weight-only kernel wants one scale per row
  and returns bf16: both cost greedy agreement). The same tiles serve the embedding lookup of a tied
  embedding / LM head: one copy of the codes (the default model's: 28.3 MB of codes + 3.5 MB of scales).
- Q5_0 -> Q8_0 blocks with the same values (its 5-bit q - 16 is an int8 code beside the same fp16 d), then as
  Q8_0. llama-quantize's K-quant mixes fall back to Q5_0 / Q5_1 where a row is no multiple of 256 values
  (SmolLM2's 576: most of its Q4_K_M is Q5_0).
- Q4_K / Q5_K / Q6_K -> their integer codes and two levels of scales for our int8-dot kernels
  (`model/kquant_dot.py`), exactly, where those kernels run natively (else Q4_K goes to torch's int4 layout
  above); a projection whose parts differ in type (a Q4_K_M file's Q4_K Q and K beside a Q6_K V) is a
  `RowStack` of packs.
- anything else (Q5_1, Q2_K, Q3_K; K-quants without the int8-dot kernels) -> a dense bf16 matrix, dequantized
  one tensor at a time.

Where the compiled kernels run AVX512-VNNI or AVX2, Q4 and Q8_0 matrices are packed instead for our int8
dot-product kernels (`model/int8_dot.py`: the file's codes and fp16 scales, activations quantized per block of
32 at each call; fp32 in and out): fewer instructions per weight than either float kernel (BENCHMARKS.md).

Small batches are bandwidth-bound and want the fewest bytes; large ones are compute-bound and run faster
on dense bf16 (measured: BENCHMARKS.md), so a `PackedLinear` may also hold a bf16 copy and picks per call.
A Q8_0 matrix never gets a float32 copy: where the output must stay fp32 (the logits), the Q8_0 kernel
serves every batch size itself.

Long module: the packed forms and `PackedLinear`, which picks among them per call, change together (each
form's kernel call, its dense copy, its thresholds); the file's own tensor is `ggml_tensor.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from tokenloop.model.cpu_kernels import avx512_native, paged_decode_kernels
from tokenloop.model.ggml_tensor import GROUP_SIZE, INT4_TYPES, Q8_EXACT_TYPES, GGMLTensor, QType
from tokenloop.model.int8_dot import (
    Int4DotWeight,
    Q8DotWeight,
    check_q8_codes,
    int8_dot_available,
)
from tokenloop.model.int8_gemm import PROJECTION_PASSES, many_row_product, takes_gemm
from tokenloop.model.kquant_dot import KQUANT_DOT_TYPES, KQuantDotWeight


@dataclass(frozen=True)
class PackThresholds:
    """Most rows a call may have and still run the packed kernel when a bf16 copy exists.

    Measured on the 2-core AVX512-BF16 EPYC (BENCHMARKS.md): torch's int4 kernel beats bf16 up to ~16-24
    rows, our int8-dot kernel up to ~32 (it ties bf16 there); `q8_max_rows` applies to Q8_0 layers with a
    bf16 copy (the fp32 LM head keeps no copy).
    `always_packed()` never uses the copy (tests, least memory). `int8_dot`: pack for our int8 dot-product
    kernels where they run natively (AVX512-VNNI or AVX2); off, torch's int4 kernel and our fp32 Q8_0 kernel.
    `dense_copy_budget`: the most bytes the copies of a model's matrices may take (`for_model`): a small model
    keeps them (the default model's bf16 copies: ~0.3 GB beside a 0.1 GB file), a real-size one does not
    (Llama 3.2 1B's: 2.5 GB beside a 0.8 GB file; the resident-memory goal is 1.3x the file + KV pool).
    """

    int4_max_rows: int = 16
    q8_max_rows: int = 8
    keep_dense: bool = True
    int8_dot: bool = True
    dense_copy_budget: int = 1 << 30

    def for_model(self, weights: Iterable[object], dense_dtype: torch.dtype) -> PackThresholds:
        """These thresholds, without dense copies where the model's quantized matrices would need more than
        `dense_copy_budget` bytes of them in `dense_dtype`."""
        if not self.keep_dense:
            return self
        size = torch.empty(0, dtype=dense_dtype).element_size()
        total = sum(w.shape[0] * w.shape[1] * size for w in weights
                    if isinstance(w, GGMLTensor) and w.tensor_type not in (QType.F32, QType.F16, QType.BF16))
        return self if total <= self.dense_copy_budget else replace(self, keep_dense=False)

    @classmethod
    def always_packed(cls) -> PackThresholds:
        return cls(1 << 62, 1 << 62, keep_dense=False)
_INT4_N_MULTIPLE = 16  # torch's int4 packing wants the output dimension in multiples of 16
_TILE = 16  # the Q8_0 kernel's output columns per tile: one AVX-512 register of float32


# -- packed forms ---------------------------------------------------------------------------------

@dataclass
class Int4Weight:
    """torch's CPU int4 layout: `packed` [N_pad, K_pad / 2] uint8, `scales_zeros` [K_pad / 32, N_pad, 2]
    bf16."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    out_features: int
    in_features: int
    form: ClassVar[str] = "int4"

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Int4Weight:
        """codes [N, K] in 0..15, scale/zero [N, ceil(K / 32)]: w = (q - 8) * scale + zero per group of 32.

        Ragged shapes are padded with zero weights (code 8, zero 0): K to the group, N to 16.
        """
        n, k = codes.shape
        n_pad, k_pad = -n % _INT4_N_MULTIPLE, -k % GROUP_SIZE
        codes = codes.to(torch.int32)
        if n_pad or k_pad:
            codes = torch.nn.functional.pad(codes, (0, k_pad, 0, n_pad), value=8)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        # Padded rows get scale 1, zero 0: weight 0. (torch.stack of transposed views is ~10x slower.)
        scales_zeros = torch.zeros(scale.shape[1], n + n_pad, 2, dtype=torch.bfloat16)
        scales_zeros[..., 0] = 1.0
        scales_zeros[:, :n, 0] = scale.t()
        scales_zeros[:, :n, 1] = zero.t()
        return cls(packed, scales_zeros, n, k)

    @classmethod
    def from_q4(cls, tensor: GGMLTensor, q4_codes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
                ) -> Int4Weight:
        codes, d, m = q4_codes if q4_codes is not None else tensor.q4_codes()
        return cls.from_codes(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m + 8.0 * d))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        """Asymmetric 4-bit round-to-nearest of a float matrix [N, K], per group of 32 (tests, ragged K)."""
        n, k = weight.shape
        groups = torch.nn.functional.pad(weight.float(), (0, -k % GROUP_SIZE)).view(n, -1, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp_min(1e-8)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15)
        return cls.from_codes(codes.view(n, -1)[:, :k], scale, low + 8 * scale)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ W.T [M, N] in bf16."""
        x = x.to(torch.bfloat16)
        k_padded = self.packed.shape[1] * 2
        if x.shape[1] != k_padded:
            x = torch.nn.functional.pad(x, (0, k_padded - x.shape[1]))
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, GROUP_SIZE,
                                                         self.scales_zeros)
        return out if out.shape[1] == self.out_features else out[:, :self.out_features]

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored codes [N, K] (int32), scales and zeros [N, K_pad / 32] (float32), read back through the
        kernel itself (identity activations, unit scale, zero 8), so a test sees what the kernel uses."""
        k_padded = self.packed.shape[1] * 2
        n_padded = self.packed.shape[0]
        unit = torch.stack([torch.ones(k_padded // GROUP_SIZE, n_padded),
                            torch.full((k_padded // GROUP_SIZE, n_padded), 8.0)], dim=-1).to(torch.bfloat16)
        eye = torch.eye(k_padded, dtype=torch.bfloat16)
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP_SIZE, unit).t()
        scale = self.scales_zeros[..., 0].float().t()
        zero = self.scales_zeros[..., 1].float().t()
        n, k = self.out_features, self.in_features
        return codes[:n, :k].to(torch.int32), scale[:n], zero[:n]

    def dequantize(self) -> torch.Tensor:
        """The float32 weights the kernel multiplies by: (q - 8) * scale + zero."""
        codes, scale, zero = self.unpack()
        k = self.in_features

        def expand(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(GROUP_SIZE, dim=1)[:, :k]

        return (codes.float() - 8) * expand(scale) + expand(zero)


@dataclass
class Q8Weight:
    """Q8_0 with the file's values, tiled for the C++ kernel (csrc/q8_0_matmul.cpp): the N output rows in
    tiles of 16, `codes` [N_pad / 16, K, 16] int8 and `scales` [N_pad / 16, K / 32, 16] float32 (N padded
    to 16 with zero weights), multiplied with float32 activations into float32 output at any row count.
    The same tensors serve an embedding lookup (`rows`): one copy for a tied embedding and head."""

    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int
    form: ClassVar[str] = "q8_0"

    @classmethod
    def from_q8(cls, tensor: GGMLTensor) -> Q8Weight:
        codes, d = tensor.q8_codes()
        return cls.from_codes(torch.from_numpy(codes), torch.from_numpy(d))

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor) -> Q8Weight:
        """codes [N, K] int8, scales [N, K / 32] float32 (w = code * scale) -> the tiled layout."""
        n, k = check_q8_codes(codes, scales)
        pad = -n % _TILE
        codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
        scales = torch.nn.functional.pad(scales.float(), (0, 0, 0, pad))
        tiles = (n + pad) // _TILE
        return cls(codes.view(tiles, _TILE, k).transpose(1, 2).contiguous(),
                   scales.view(tiles, _TILE, -1).transpose(1, 2).contiguous(), n)

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ W.T [M, N] in float32."""
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Q8_0 matmul: x [M, {self.in_features}] expected, got {tuple(x.shape)}")
        x = x.float().contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        kernel = paged_decode_kernels()
        if kernel is not None:
            kernel.q8_0_tiled_matmul(x, self.codes, self.scales, out)
            return out
        step = 4096  # no compiler: dequantize a slice of rows at a time
        for start in range(0, self.out_features, step):
            rows = slice(start, min(start + step, self.out_features))
            out[:, rows] = x @ self.dequantize(rows).t()
        return out

    def rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `ids` of the untiled matrix: codes [T, K] int8 and scales [T, K / 32] float32."""
        tile, lane = ids // _TILE, ids % _TILE
        return self.codes[tile, :, lane], self.scales[tile, :, lane]

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weights [N, K] (or the rows of `rows`, step 1): code * scale, exact."""
        ids = torch.arange(self.out_features)[rows]
        codes, scales = self.rows(ids)
        grouped = codes.view(len(ids), -1, GROUP_SIZE).float() * scales.unsqueeze(-1)
        return grouped.view(codes.shape)


Pack = Int4Weight | Q8Weight | Int4DotWeight | Q8DotWeight | KQuantDotWeight  # one matrix's packed form
FLOAT32_OUT_PACKS = (Int4DotWeight, Q8DotWeight, KQuantDotWeight)  # the int8-dot packs: float32 in and out


def int8_dot_form(pack: Int4DotWeight | Q8DotWeight | KQuantDotWeight) -> int:
    """The number the int8-dot kernels know a pack's layout by (`int8_dot_stack`'s forms, decode_layers' `Form`):
    3 Q4, 4 Q8_0, 5 Q5_K, 6 Q6_K."""
    if isinstance(pack, KQuantDotWeight):
        return pack.kind
    return 3 if isinstance(pack, Int4DotWeight) else 4


@dataclass
class PackedLinear:
    """One projection held as a packed quantized form, optionally with a dense copy for large batches.

    Calls with at most `packed_max_rows` rows (or all calls, without a dense copy) run the packed kernel.
    The dense copy is bf16, or for an int4 LM head (fp32 logits) fp32, prepacked for oneDNN; a Q8_0 head
    has none (its kernel serves every batch size).
    """

    packed: Pack | RowStack
    dense: torch.Tensor | None
    packed_max_rows: int
    gemm_passes: int = PROJECTION_PASSES  # activation code sets of a many-row call's GEMM (model/int8_gemm.py)

    @property
    def form(self) -> str:
        return self.packed.form

    def form_for(self, rows: int) -> str:
        """Which form a call with `rows` rows runs."""
        if self.dense is None or rows <= self.packed_max_rows:
            return self.form
        return str(self.dense.dtype).removeprefix("torch.")

    def input_dtype_for(self, rows: int) -> torch.dtype:
        """The activations' dtype the kernel for `rows` rows consumes (others are cast to it first)."""
        if self.dense is None or rows <= self.packed_max_rows:
            return torch.bfloat16 if isinstance(self.packed, Int4Weight) else torch.float32  # torch's kernel: bf16
        return self.dense.dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> x @ W.T in x's dtype."""
        return self.native(x).to(x.dtype)

    def gemm_below_decode_precision(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the many-row GEMM with fewer activation code sets than the decode
        kernels keep (two), so the decode kernels would not give this call's values."""
        parts = self.packed.parts if isinstance(self.packed, RowStack) else [self.packed]
        return self.gemm_passes < 2 and (self.dense is None or rows <= self.packed_max_rows) and \
            takes_gemm(parts, rows)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] (any float dtype) -> x @ W.T in the kernel's own output dtype (bf16 for torch's int4 and bf16
        weights, fp32 for Q8_0, the int8-dot packs and fp32 weights), for consumers that read either without a
        cast."""
        if self.dense is None or x.shape[0] <= self.packed_max_rows:
            parts = self.packed.parts if isinstance(self.packed, RowStack) else [self.packed]
            out = many_row_product(parts, x, self.gemm_passes)
            return self.packed.matmul(x) if out is None else out
        return dense_linear(x, self.dense)


@dataclass
class RowStack:
    """Row blocks of one projection packed in different int8-dot forms (llama-quantize's Q4_K_M gives some
    layers' V projection Q6_K beside Q4_K Q and K): one kernel call (`int8_dot_stack`) quantizes x once and
    runs every block in one parallel region, writing their outputs side by side."""

    parts: list[Int4DotWeight | Q8DotWeight | KQuantDotWeight]

    @property
    def form(self) -> str:
        return "+".join(part.form for part in self.parts)

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ W.T [M, N] float32 (each part's kernel in turn where the compiled kernels are missing)."""
        kernel = paged_decode_kernels()
        if kernel is None or not hasattr(kernel, "int8_dot_stack"):
            return torch.cat([part.matmul(x) for part in self.parts], dim=1)
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"{self.form} matmul: x [M, {self.in_features}] expected, got {tuple(x.shape)}")
        out = torch.empty(x.shape[0], self.out_features)
        kernel.int8_dot_stack(x.float().contiguous(), [part.codes for part in self.parts],
                              [part.scales for part in self.parts], [int8_dot_form(part) for part in self.parts],
                              [part.out_features for part in self.parts], out)
        return out


def pack_fused(parts: list[GGMLTensor], thresholds: PackThresholds = PackThresholds(),
               dense_dtype: torch.dtype = torch.bfloat16) -> PackedLinear | torch.Tensor | None:
    """Several projections' rows as one (Q/K/V, gate/up): concatenated blocks where their encodings agree,
    else a `RowStack` of the int8-dot packs (a dense copy, if kept, of all rows); None where a part has none."""
    joined = GGMLTensor.concat(parts)
    if joined is not None:
        return pack_linear(joined, thresholds, dense_dtype)
    # Neighbours of one type share a pack (Q and K of Q4_K, V of Q6_K: two kernel calls, not three).
    runs = [GGMLTensor.concat(list(run)) for _, run in itertools.groupby(parts, key=lambda p: p.tensor_type)]
    alone = replace(thresholds, keep_dense=False)
    packs = [pack_linear(run, alone, dense_dtype) if run is not None else None for run in runs]
    if not all(isinstance(p, PackedLinear) and isinstance(p.packed, FLOAT32_OUT_PACKS) for p in packs):
        return None
    stack = RowStack([p.packed for p in packs])  # type: ignore[union-attr,misc]
    if not thresholds.keep_dense:
        return PackedLinear(stack, None, 1 << 62)
    dense = prepack_dense(torch.cat([part.dequantize(dense_dtype) for part in parts]).contiguous())
    return PackedLinear(stack, dense, thresholds.int4_max_rows)


def pack_linear(weight: GGMLTensor | torch.Tensor, thresholds: PackThresholds = PackThresholds(),
                dense_dtype: torch.dtype = torch.bfloat16) -> PackedLinear | torch.Tensor:
    """The fastest kept form of one projection: packed int4 / Q8_0 (+ a dense copy in `dense_dtype` for
    large batches), or the dense matrix alone where no packed kernel fits the encoding."""
    dot = thresholds.int8_dot and int8_dot_available()
    q4_codes = None
    if isinstance(weight, GGMLTensor) and weight.tensor_type in KQUANT_DOT_TYPES and dot:
        # Q4_K too: its own two levels of scales take fewer bytes than the Q4 pack's per-32 fp16 pairs
        packed: Pack = KQuantDotWeight.from_ggml(weight.tensor_type, weight.blocks, weight.shape)
        max_rows = thresholds.int4_max_rows
    elif isinstance(weight, GGMLTensor) and weight.tensor_type in INT4_TYPES:
        # Unpacked once for the pack and the dense copy, where the pack needs them: the int8-dot pack takes
        # Q4_0 / Q4_1 bytes as they are, and so does the dense copy's C++ unpack (a start's packing ~30% less).
        if not (dot and weight.stores_nibble_pairs):
            q4_codes = weight.q4_codes()
        packed = Int4DotWeight.from_q4(weight, q4_codes) if dot else Int4Weight.from_q4(weight, q4_codes)
        max_rows = thresholds.int4_max_rows
    elif isinstance(weight, GGMLTensor) and weight.tensor_type in Q8_EXACT_TYPES:
        weight = weight.as_q8_0()
        packed = Q8DotWeight.from_q8(weight) if dot else Q8Weight.from_q8(weight)
        max_rows = thresholds.q8_max_rows
    else:
        return dense_weight(weight, dense_dtype)
    dense = None
    if isinstance(packed, Q8Weight) and thresholds.keep_dense and not avx512_native():
        # The tiled kernel's plain loops lose to oneDNN at every row count (AVX2: 32 vs 18 ms at one row):
        # the copy runs every call; the codes stay for a tied embedding's lookup.
        return PackedLinear(packed, prepack_dense(dense_weight(weight, dense_dtype)), 0)
    # No float32 copy of a Q8_0 matrix: the tiled kernel computes the same fp32 product at every row count
    # as fast as oneDNN's fp32 GEMM (BENCHMARKS.md), and the copy was 4x the codes (113 MB for the head).
    # Likewise none of a K-quant (the LM head of a Q4_K_M file: a float32 copy was 1 GB at Llama 3.2 1B's shape).
    if thresholds.keep_dense and not (isinstance(packed, (Q8Weight, Q8DotWeight, KQuantDotWeight))
                                      and dense_dtype == torch.float32):
        dense = prepack_dense(weight.dequantize(dense_dtype, q4_codes).contiguous())
    return PackedLinear(packed, dense, max_rows)


def prepack_dense(weight: torch.Tensor) -> torch.Tensor:
    """A CPU float32 / bf16 matrix [N, K] reordered once into oneDNN's blocked layout (an opaque mkldnn
    tensor, the same bytes), for `dense_linear`; other matrices unchanged.

    A plain bf16 `F.linear` reorders the weights on every call: prepacked, the same oneDNN kernel gives the
    same results bit for bit, 5-35% faster at 17-100 rows here. The fp32 vocabulary projection also skips
    converting its [M, 49152] output from and to oneDNN's layout (25-45% faster at 9-64 rows; equal to the
    `to_mkldnn` path it replaced at those rows, within float rounding at others).
    """
    supported = weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                                  and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if weight.device.type != "cpu" or weight.is_mkldnn or not supported or not torch.backends.mkldnn.is_available():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight.T in the weight's dtype, for a plain or a prepacked (`prepack_dense`) matrix."""
    x = x.to(weight.dtype)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
    return torch.nn.functional.linear(x, weight)


def dense_weight(weight: GGMLTensor | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A plain contiguous matrix in `dtype`, dequantizing a ggml tensor on the way."""
    if isinstance(weight, GGMLTensor):
        return weight.dequantize(dtype).contiguous()
    return weight.to(dtype).contiguous()


class QuantizedEmbedding:
    """Token embedding rows looked up from Q8_0 codes (exact: an int8 code times an fp16 scale fits fp32)."""

    def __init__(self, weight: Q8Weight | Q8DotWeight | KQuantDotWeight) -> None:
        self.weight = weight  # shared with a tied LM head: one copy of the codes serves both
        self.shape = (weight.out_features, weight.in_features)

    def index_select(self, dim: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32 [T, hidden], like `Tensor.index_select(0, ids)`."""
        if dim != 0:
            raise ValueError(f"QuantizedEmbedding looks up rows (dim 0), not dim {dim}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]):
            raise IndexError(f"token ids must lie in [0, {self.shape[0]}), got {ids.min()}..{ids.max()}")
        if isinstance(self.weight, KQuantDotWeight):
            return self.weight.rows(ids)
        codes, scales = self.weight.rows(ids)
        rows = codes.float().view(len(ids), -1, GROUP_SIZE) * scales.unsqueeze(-1)
        return rows.view(len(ids), self.shape[1])
