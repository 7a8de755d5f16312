"""Packed 4-bit and Q8_0 weights for our int8 dot-product kernels (csrc/int8_dot_matmul.cpp: AVX512-VNNI,
or AVX2 with the same layouts and the same exact integer sums; the forms keep their `_vnni` names on both).

The kernels quantize each call's activations per block of 32 values to two int8 codes per value and one float
scale (x ~= dx q + (dx / 254) r, dx = max |x| / 127: ~15 bits per block; one code alone, as llama.cpp does,
cost 6% of greedy top-1 agreement here), multiply codes by codes in exact int32 sums and apply the weights'
per-block fp16 scales once per block: Q4 (w = d q + m) as d (dx sum(q' xq) + dx/254 sum(q' r)) + m sum(x), Q8_0
likewise without the m term. The weights keep the file's values exactly (codes and fp16 d, m; Q4_K's d and m
are products of fp16 and 6-bit scales, rounded to fp16 here); the only extra rounding is the activations'.

Layouts (see the C++ file): N in tiles of 16 output columns, K in blocks of 32. Q4 `codes` [tiles, blocks,
256] uint8, `scales` [tiles, blocks, 2, 16] fp16 (d, m); Q8_0 `codes` [tiles, blocks, 512] uint8 (code + 128),
`scales` [tiles, blocks, 16] fp16. Without the compiled kernels `matmul` runs the same arithmetic in PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.ggml_tensor import GGMLTensor

if TYPE_CHECKING:
    import numpy as np

GROUP_SIZE = 32  # ggml's block, and the activations' quantization block
TILE = 16  # output columns per tile
REMAINDER_STEPS = 254.0  # a remainder of up to dx / 2, in steps of dx / 254: codes -127..127
_SLICE_TILES = 256  # the PyTorch path's columns at a time (x 16): bounds its [M, N, blocks] partial sums


def int8_dot_available() -> bool:
    """Whether the compiled int8-dot kernels run natively (AVX512-VNNI or AVX2) here: only then are they the fast
    form (their plain loops are not)."""
    kernel = paged_decode_kernels()
    return kernel is not None and hasattr(kernel, "int8_dot_native") and bool(kernel.int8_dot_native())


@dataclass
class QuantizedActivations:
    """What the kernels make of x [M, K] per block of 32 (K zero-padded): x ~= dx q + (dx / 254) r. All float32;
    `codes` and `remainders` [M, blocks, 32] hold integers in -127..127; `scales` (dx) and `sums` (the blocks'
    float sums of x, for Q4's m term) are [M, blocks]."""

    codes: torch.Tensor
    remainders: torch.Tensor
    scales: torch.Tensor
    sums: torch.Tensor

    def terms(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(codes, their scale) for each of the two code sets."""
        return [(self.codes, self.scales), (self.remainders, self.scales / REMAINDER_STEPS)]


def check_q8_codes(codes: torch.Tensor, scales: torch.Tensor) -> tuple[int, int]:
    """(N, K) of Q8_0 codes [N, K] int8 (K a multiple of 32) with scales [N, K / 32]; ValueError otherwise."""
    n, k = codes.shape
    if codes.dtype != torch.int8 or k % GROUP_SIZE or tuple(scales.shape) != (n, k // GROUP_SIZE):
        raise ValueError(f"Q8_0 weight: int8 codes [N, K] with K a multiple of {GROUP_SIZE} and scales "
                         f"[N, K / {GROUP_SIZE}] expected, got {codes.dtype} {tuple(codes.shape)} and "
                         f"{tuple(scales.shape)}")
    return n, k


def quantize_activations(x: torch.Tensor, blocks: int) -> QuantizedActivations:
    """x [M, K] -> its codes as the kernels compute them."""
    x = torch.nn.functional.pad(x.float(), (0, blocks * GROUP_SIZE - x.shape[1])).view(x.shape[0], blocks,
                                                                                       GROUP_SIZE)
    amax = x.abs().amax(-1)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))[..., None]
    scales = amax / 127.0
    codes = (x * inverse).round().clamp(-127, 127)
    remainders = ((x - codes * scales[..., None]) * (inverse * REMAINDER_STEPS)).round().clamp(-127, 127)
    return QuantizedActivations(codes, remainders, scales, x.sum(-1))


def tile_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """ggml's Q4 bytes [N, B, 16] uint8 (value j of a block in the low nibble of byte j, j + 16 in the high one) ->
    the kernels' tiles [ceil(N / 16), B, 256], N padded with zero bytes."""
    n, blocks, _ = nibbles.shape
    tiles = -(-n // TILE)
    padded = torch.nn.functional.pad(nibbles, (0, 0, 0, 0, 0, tiles * TILE - n)) if tiles * TILE > n else nibbles
    # [tile, lane, block, chunk, byte] -> [tile, block, chunk, lane, byte]: byte j of a block (values j and
    # j + 16) sits in chunk j / 4 at byte j % 4, beside the same bytes of the tile's 15 other rows. A chunk's
    # 4 bytes move together: permuted as one int32 (4x fewer elements to move).
    words = padded.contiguous().view(torch.int32).view(tiles, TILE, blocks, 4)
    return words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(tiles, blocks, -1)


def _pad_rows_and_blocks(values: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """[N, B] (or [N, K] with K padded to blocks x 32) zero-padded to N = rows, last dim = blocks."""
    return torch.nn.functional.pad(values, (0, blocks - values.shape[1], 0, rows - values.shape[0]))


@dataclass
class Int4DotWeight:
    """4-bit codes (w = d q + m per block of 32) in the Q4 int8-dot layout; multiplies float32 into float32."""

    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    form: ClassVar[str] = "int4_vnni"

    @classmethod
    def from_codes(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Int4DotWeight:
        """codes [N, K] in 0..15, d and m [N, ceil(K / 32)]; N and K are padded with zero weights."""
        n, k = codes.shape
        blocks = -(-k // GROUP_SIZE)
        grouped = _pad_rows_and_blocks(codes.to(torch.uint8), n, blocks * GROUP_SIZE).view(n, blocks, 2, 16)
        return cls.from_nibbles(grouped[:, :, 0] | (grouped[:, :, 1] << 4), d, m, k)

    @classmethod
    def from_nibbles(cls, nibbles: torch.Tensor, d: torch.Tensor, m: torch.Tensor, in_features: int
                     ) -> Int4DotWeight:
        """ggml's Q4 bytes [N, B, 16] uint8 (value j of a block in the low nibble of byte j, value j + 16 in
        the high one), d and m [N, B], for `in_features` <= 32 B columns; N is padded with zero weights."""
        n, blocks, _ = nibbles.shape
        tiles = -(-n // TILE)
        packed = tile_nibbles(nibbles)

        def tiled(values: torch.Tensor) -> torch.Tensor:  # [N, B] -> [tiles, B, 16]
            return _pad_rows_and_blocks(values.float(), tiles * TILE, blocks).view(tiles, TILE, blocks).transpose(1, 2)

        scales = torch.stack([tiled(d), tiled(m)], dim=2).to(torch.float16).contiguous()
        return cls(packed.contiguous(), scales, n, in_features)

    @classmethod
    def from_q4(cls, tensor: GGMLTensor, q4_codes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
                ) -> Int4DotWeight:
        if q4_codes is None and tensor.stores_nibble_pairs:
            nibbles, d, m = tensor.q4_nibbles()  # already the layout's byte pairs: no unpacking
            return cls.from_nibbles(torch.from_numpy(nibbles), torch.from_numpy(d), torch.from_numpy(m),
                                    tensor.shape[1])
        codes, d, m = q4_codes if q4_codes is not None else tensor.q4_codes()
        return cls.from_codes(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4DotWeight:
        """Asymmetric 4-bit round-to-nearest of a float matrix [N, K] per block of 32 (tests; ragged K)."""
        n, k = weight.shape
        groups = torch.nn.functional.pad(weight.float(), (0, -k % GROUP_SIZE)).view(n, -1, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        d = ((high - low) / 15).half().float()  # fp16, as stored, before the codes are chosen
        m = low.half().float()
        step = torch.where(d > 0, d, torch.ones_like(d))  # a constant block: every code 0
        codes = ((groups - m[..., None]) / step[..., None]).round().clamp(0, 15)
        return cls.from_codes(codes.view(n, -1)[:, :k], d, m)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 2

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """codes [N_pad, K_pad] (0..15, int32), d and m [N_pad, blocks] float32, read back from the layout."""
        tiles, blocks, _ = self.codes.shape
        packed = self.codes.view(tiles, blocks, 4, TILE, 4).to(torch.int32)
        halves = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # [tile, block, chunk, lane, byte, half]
        codes = halves.permute(0, 3, 1, 5, 2, 4).reshape(tiles * TILE, blocks * GROUP_SIZE)
        scales = self.scales.float().permute(0, 3, 1, 2).reshape(tiles * TILE, blocks, 2)
        return codes, scales[..., 0], scales[..., 1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K]: d q + m, the kernel's values."""
        codes, d, m = self.unpack()
        n_pad, k_pad = codes.shape
        weights = codes.view(n_pad, -1, GROUP_SIZE).float() * d[..., None] + m[..., None]
        return weights.view(n_pad, k_pad)[:self.out_features, :self.in_features]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ W.T [M, N] float32."""
        return _dot_matmul(self, x, "int4_dot_matmul")

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's arithmetic in PyTorch (the no-compiler path): quantized activations, exact code sums."""
        codes, d, m = self.unpack()
        quantized = quantize_activations(x, codes.shape[1] // GROUP_SIZE)
        n = self.out_features
        grouped = codes[:n].view(n, -1, GROUP_SIZE).float()
        return _blockwise(quantized, grouped, d[:n]) + quantized.sums @ m[:n].t()


class BlockTiles:
    """Packs whose `codes` are [tiles, K / 32, bytes per block] uint8 beside fp16 `scales`: width and size."""

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * GROUP_SIZE

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 2


@dataclass
class Q8DotWeight(BlockTiles):
    """Q8_0 codes and fp16 scales in the int8-dot layout; multiplies float32 into float32. Its `rows` serve an
    embedding lookup: one copy for a tied embedding and LM head."""

    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int
    form: ClassVar[str] = "q8_0_vnni"

    @classmethod
    def from_q8(cls, tensor: GGMLTensor) -> Q8DotWeight:
        codes, d = tensor.q8_codes()
        return cls.from_codes(torch.from_numpy(codes), torch.from_numpy(d))

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor) -> Q8DotWeight:
        """codes [N, K] int8 (K a multiple of 32), scales [N, K / 32] (fp16 values) -> the tiled layout."""
        n, k = check_q8_codes(codes, scales)
        tiles, blocks = -(-n // TILE), k // GROUP_SIZE
        unsigned = codes.view(torch.uint8) ^ 0x80  # q + 128: flipping the sign bit of the two's complement
        if tiles * TILE > n:
            unsigned = torch.nn.functional.pad(unsigned, (0, 0, 0, tiles * TILE - n), value=128)  # code 0
        # [tile, lane, block, chunk, byte] -> [tile, block, chunk, lane, byte], a chunk's 4 bytes as one int32
        words = unsigned.contiguous().view(torch.int32).view(tiles, TILE, blocks, 8)
        packed = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(tiles, blocks, -1)
        tiled = _pad_rows_and_blocks(scales.float(), tiles * TILE, blocks).view(tiles, TILE, blocks).transpose(1, 2)
        return cls(packed.contiguous(), tiled.to(torch.float16).contiguous(), n)

    def rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `ids` of the untiled matrix: codes [T, K] int8 and scales [T, K / 32] float32."""
        tile, lane = ids // TILE, ids % TILE
        picked = torch.arange(len(ids))
        blocks = self.codes.shape[1]
        # index_select first: `codes[tile, ..., lane]` walks all of codes (the 262k-row Gemma 3 head: ms a lookup)
        layout = self.codes.index_select(0, tile).view(len(ids), blocks, 8, TILE, 4)
        codes = layout[picked, :, :, lane, :].reshape(len(ids), -1)
        return (codes.to(torch.int16) - 128).to(torch.int8), self.scales.index_select(0, tile)[picked, :, lane].float()

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weights [N, K] (or the rows of `rows`, step 1): code x scale, exact."""
        codes, scales = self.rows(torch.arange(self.out_features)[rows])
        return (codes.view(len(codes), -1, GROUP_SIZE).float() * scales[..., None]).view(codes.shape)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ W.T [M, N] float32."""
        return _dot_matmul(self, x, "q8_0_dot_matmul")

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's arithmetic in PyTorch (the no-compiler path), a slice of columns at a time."""
        out = torch.empty(x.shape[0], self.out_features)
        quantized = quantize_activations(x, self.codes.shape[1])
        step = _SLICE_TILES * TILE
        for start in range(0, self.out_features, step):
            ids = torch.arange(start, min(start + step, self.out_features))
            codes, scales = self.rows(ids)
            out[:, ids] = _blockwise(quantized, codes.view(len(ids), -1, GROUP_SIZE).float(), scales)
        return out


def _blockwise(x: QuantizedActivations, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """sum over blocks and code sets of (xq . codes) dx d: codes [N, B, 32], d [N, B] -> [M, N]. Each block's
    code sum is an integer below 2^24, exact in float32."""
    total = 0
    for xq, dx in x.terms():
        sums = torch.einsum("mbk,nbk->mnb", xq, codes)
        total = total + (sums * (dx[:, None, :] * d[None])).sum(-1)
    return total


def _dot_matmul(weight: Int4DotWeight | Q8DotWeight, x: torch.Tensor, kernel_name: str) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"{weight.form} matmul: x [M, {weight.in_features}] expected, got {tuple(x.shape)}")
    x = x.float().contiguous()
    kernel = paged_decode_kernels()
    if kernel is None or not hasattr(kernel, kernel_name):
        return weight.reference(x)
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    getattr(kernel, kernel_name)(x, weight.codes, weight.scales, out)
    return out
