"""Q4_K, Q5_K and Q6_K weights packed for the int8 dot-product kernels (csrc/kquant_dot_blocks.inc), exactly.

The K-quants' 256-value super-blocks are decoded once at load into integer codes and their two levels of
scales, and kept as they are (no float copy):

- Q6_K (210 bytes): 6-bit codes q, an int8 scale sc per 16 values, an fp16 d per 256: w = d sc (q - 32).
- Q5_K (176 bytes): 5-bit codes q, 6-bit sc and mn per 32 values, fp16 d and dmin per 256:
  w = d sc q - dmin mn.
- Q4_K (144 bytes): as Q5_K with 4-bit codes. Held so (4.63 bits a weight against the file's 4.5), not as the
  Q4 pack's per-32 fp16 d x sc and dmin x mn (5 bits, and those products rounded to fp16): one-stream decode
  reads every weight once a token, so its bytes set the speed.

In the kernels' tiles of 16 output rows the codes' low 4 bits sit in the Q4 int8-dot layout (model/int8_dot.py)
and each higher bit in a plane of its own (one bit per value, 6.56 and 5.63 bits per weight with the scales,
against the file's 6.56 and 5.5; Q4_K has none); the kernels rebuild the codes with byte masks, multiply them by the
activations' int8 codes in exact int32 sums and apply d x sc (exact in float32) per 16 or 32 values. The only
rounding beyond float32 sums is the activations' (x ~= dx q + dx / 254 r, as for Q4 and Q8_0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.ggml_tensor import k_scales_mins
from tokenloop.model.int8_dot import (
    GROUP_SIZE,
    TILE,
    BlockTiles,
    quantize_activations,
    tile_nibbles,
)

SUPER_BLOCK = 256
KQUANT_DOT_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
# The kernels' form numbers (decode_layers' `Form`): Q4_K took the next free one.
_KIND = {GGMLQuantizationType.Q5_K: 5, GGMLQuantizationType.Q6_K: 6, GGMLQuantizationType.Q4_K: 7}
_FORM = {5: "q5_k_vnni", 6: "q6_k_vnni", 7: "q4_k_vnni"}
_PLANES = {5: 1, 6: 2, 7: 0}  # code bits above the low nibble
_SLICE_TILES = 64  # the PyTorch twin's tiles at a time (x 16 columns): bounds its [M, N, blocks] partial sums


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def decode_q5_k(blocks: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K rows -> codes [rows, cols] uint8 (0..31), per 32 values (sc, mn) [rows, cols / 32, 2] uint8, per 256
    (d, dmin) [rows, cols / 256, 2] float32."""
    block = blocks.reshape(rows, cols // SUPER_BLOCK, 176)
    supers = np.stack([_fp16(block[..., 0:2]), _fp16(block[..., 2:4])], axis=-1)
    sc, mn = k_scales_mins(block[..., 4:16])
    qh = block[..., 16:48]  # bit j of byte l: the fifth bit of value l of sub-block j
    qs = block[..., 48:].reshape(rows, -1, 4, 1, 32)  # 32 bytes: sub-blocks 2i (low nibbles) and 2i + 1 (high)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1, 8, 32)
    high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    codes = (low | (high << 4)).reshape(rows, cols)
    return codes, np.stack([sc, mn], axis=-1).reshape(rows, -1, 2), supers


def decode_q4_k(blocks: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K rows -> codes [rows, cols] uint8 (0..15), per 32 values (sc, mn) [rows, cols / 32, 2] uint8, per 256
    (d, dmin) [rows, cols / 256, 2] float32."""
    block = blocks.reshape(rows, cols // SUPER_BLOCK, 144)
    supers = np.stack([_fp16(block[..., 0:2]), _fp16(block[..., 2:4])], axis=-1)
    sc, mn = k_scales_mins(block[..., 4:16])
    qs = block[..., 16:].reshape(rows, -1, 4, 1, 32)  # 32 bytes: sub-blocks 2i (low nibbles) and 2i + 1 (high)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols)
    return codes, np.stack([sc, mn], axis=-1).reshape(rows, -1, 2), supers


def decode_q6_k(blocks: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K rows -> codes [rows, cols] uint8 (0..63), per 32 values the two halves' sc [rows, cols / 32, 2] (int8
    bits as uint8), per 256 d [rows, cols / 256, 1] float32."""
    block = blocks.reshape(rows, cols // SUPER_BLOCK, 210)
    # Each half of 128 values: 64 bytes of low nibbles (values l and l + 32, then l + 64 and l + 96 in the high
    # nibbles) and 32 bytes of 2-bit pairs (value l + 32 m at bits 2m).
    ql = block[..., 0:128].reshape(rows, -1, 2, 2, 32)
    qh = block[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [rows, supers, half, m, 32]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    codes = (low | (high << 4)).reshape(rows, cols)
    sc = np.ascontiguousarray(block[..., 192:208]).reshape(rows, -1, 2)
    return codes, sc, _fp16(block[..., 208:210])[..., None]


@dataclass
class KQuantDotWeight(BlockTiles):
    """A Q4_K, Q5_K or Q6_K matrix in the kernels' layout: `codes` [tiles, K / 32, bytes] uint8 (nibbles, bit
    planes, sub-block scales per tile and block), `scales` [tiles, K / 256, S, 16] fp16 (d; Q4_K, Q5_K also
    dmin).
    Multiplies float32 into float32; `rows` serve an embedding lookup (one copy for a tied embedding and head)."""

    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int
    kind: int  # 5: Q5_K, 6: Q6_K, 7: Q4_K

    @property
    def form(self) -> str:
        return _FORM[self.kind]

    @classmethod
    def from_ggml(cls, tensor_type: GGMLQuantizationType, blocks: np.ndarray, shape: tuple[int, int]
                  ) -> KQuantDotWeight:
        """The file's rows [rows, row bytes] of a Q4_K, Q5_K or Q6_K matrix of `shape` (N, K)."""
        decode = {GGMLQuantizationType.Q4_K: decode_q4_k, GGMLQuantizationType.Q5_K: decode_q5_k,
                  GGMLQuantizationType.Q6_K: decode_q6_k}[tensor_type]
        codes, sub, supers = decode(blocks, *shape)
        return cls.from_parts(torch.from_numpy(codes), torch.from_numpy(sub), torch.from_numpy(supers),
                              _KIND[tensor_type])

    @classmethod
    def from_parts(cls, codes: torch.Tensor, sub: torch.Tensor, supers: torch.Tensor, kind: int) -> KQuantDotWeight:
        """codes [N, K] uint8, sub-block scales [N, K / 32, 2] uint8, super-block scales [N, K / 256, S] (fp16
        values) -> the tiled layout; N is padded to the tiles with zero weights (d = 0)."""
        n, k = codes.shape
        if k % SUPER_BLOCK or tuple(sub.shape) != (n, k // GROUP_SIZE, 2) or supers.shape[:2] != (n, k // SUPER_BLOCK):
            raise ValueError(f"K-quant weight: codes [N, K] with K a multiple of {SUPER_BLOCK}, sub-block scales "
                             f"[N, K / 32, 2] and super-block scales [N, K / 256, S] expected, got "
                             f"{tuple(codes.shape)}, {tuple(sub.shape)} and {tuple(supers.shape)}")
        tiles, blocks = -(-n // TILE), k // GROUP_SIZE
        pad = tiles * TILE - n
        codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
        sub = torch.nn.functional.pad(sub.to(torch.uint8), (0, 0, 0, 0, 0, pad))
        supers = torch.nn.functional.pad(supers.float(), (0, 0, 0, 0, 0, pad))
        grouped = (codes & 0x0F).view(-1, blocks, 2, 16)
        parts = [tile_nibbles(grouped[:, :, 0] | (grouped[:, :, 1] << 4))]
        # [tile, lane, block, half, chunk, byte] -> [tile, block, chunk, half, lane x byte]: bit i of a chunk's
        # (low or high nibbles') 64 bits is byte i of the chunk, lane i / 4.
        weights = 1 << torch.arange(8, dtype=torch.int32)  # bit i of each byte
        for plane in range(_PLANES[kind]):
            bits = ((codes >> (4 + plane)) & 1).view(tiles, TILE, blocks, 2, 4, 4).permute(0, 2, 4, 3, 1, 5)
            packed = (bits.reshape(tiles, blocks, 4, 2, 8, 8).to(torch.int32) * weights).sum(-1)
            parts.append(packed.to(torch.uint8).reshape(tiles, blocks, 64))
        parts.append(sub.view(tiles, TILE, blocks, 2).permute(0, 2, 3, 1).reshape(tiles, blocks, 2 * TILE))
        tiled_supers = supers.view(tiles, TILE, k // SUPER_BLOCK, -1).permute(0, 2, 3, 1)
        return cls(torch.cat(parts, dim=-1).contiguous(), tiled_supers.to(torch.float16).contiguous(), n, kind)

    def unpack(self, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `ids` (default: all, padding included) read back from the layout: codes [R, K] int32, sub-block
        scales [R, K / 32, 2] uint8, super-block scales [R, K / 256, S] float32."""
        if ids is None:
            ids = torch.arange(self.codes.shape[0] * TILE)
        tile, lane = ids // TILE, ids % TILE
        picked = torch.arange(len(ids))
        blocks = self.codes.shape[1]
        layout = self.codes.index_select(0, tile)  # [R, blocks, bytes] (`codes[tile]` walks all of codes: ~20 ms)
        nibbles = layout[..., :256].view(len(ids), blocks, 4, TILE, 4)[picked, :, :, lane].to(torch.int32)
        codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=2)  # [R, blocks, half, chunk, byte]
        for plane in range(_PLANES[self.kind]):
            raw = layout[..., 256 + 64 * plane:320 + 64 * plane].view(len(ids), blocks, 4, 2, 8).to(torch.int32)
            bits = (raw[..., None] >> torch.arange(8, dtype=torch.int32)) & 1  # [R, blocks, chunk, half, 64 bits]
            bits = bits.reshape(len(ids), blocks, 4, 2, TILE, 4)[picked, :, :, :, lane]
            codes = codes | (bits.permute(0, 1, 3, 2, 4) << (4 + plane))
        sub = layout[..., -2 * TILE:].view(len(ids), blocks, 2, TILE)[picked, :, :, lane]
        supers = self.scales.index_select(0, tile)[picked, :, :, lane].float()
        return codes.reshape(len(ids), blocks * GROUP_SIZE), sub, supers

    def block_scales(self, sub: torch.Tensor, supers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(d x sc per 16 (Q6_K) or 32 (Q5_K) values [R, blocks, halves], dmin x mn per 32 [R, blocks] or None), in
        float32 as ggml computes them (exact)."""
        per_super = sub.shape[1] // supers.shape[1]
        d = supers[..., 0].repeat_interleave(per_super, dim=1)
        if self.kind == 6:
            return d[..., None] * sub.view(torch.int8).float(), None
        return d[..., None] * sub[..., :1].float(), supers[..., 1].repeat_interleave(per_super, dim=1) * sub[..., 1]

    def dequantize(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weights [N, K] (or rows `ids`), bit for bit as ggml's dequantization gives them."""
        if ids is None:
            ids = torch.arange(self.out_features)
        codes, sub, supers = self.unpack(ids)
        scale, minimum = self.block_scales(sub, supers)
        halves = scale.shape[-1]
        grouped = codes.view(len(ids), self.codes.shape[1], halves, GROUP_SIZE // halves).float()
        if minimum is None:
            return (scale[..., None] * (grouped - 32)).view(codes.shape)
        return (scale[..., None] * grouped - minimum[..., None, None]).view(codes.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows `ids` as float32 [T, K]: exact."""
        return self.dequantize(ids)

    def block_square_bounds(self) -> torch.Tensor:
        """[K / 32]: per block of 32 inputs, a bound on any column's sum of w^2 from the scales alone (|q - 32| <= 32
        for Q6_K; w = d sc q - dmin mn with 0 <= q <= 15 or 31 for Q4_K / Q5_K). Reading the codes back would take
        seconds for a 128k-row head (`unpack` rebuilds the bit planes in PyTorch)."""
        tiles, blocks = self.codes.shape[:2]
        rows = tiles * TILE
        sub = self.codes[..., -2 * TILE:].view(tiles, blocks, 2, TILE).permute(0, 3, 1, 2).reshape(rows, blocks, 2)
        supers = self.scales.permute(0, 3, 1, 2).reshape(rows, -1, self.scales.shape[2]).float()
        scale, minimum = self.block_scales(sub, supers)  # [rows, blocks, halves], [rows, blocks] or None
        if minimum is None:  # Q6_K: two halves of 16 values
            return (GROUP_SIZE // 2 * 32.0 ** 2 * scale.square().sum(-1)).amax(0)
        top = 15 if self.kind == 7 else 31
        largest = torch.maximum((scale[..., 0] * top - minimum).abs(), minimum.abs())
        return (GROUP_SIZE * largest.square()).amax(0)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> x @ W.T [M, N] float32."""
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"{self.form} matmul: x [M, {self.in_features}] expected, got {tuple(x.shape)}")
        x = x.float().contiguous()
        kernel = paged_decode_kernels()
        if kernel is None or not hasattr(kernel, "kquant_dot_matmul"):
            return self.reference(x)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        kernel.kquant_dot_matmul(x, self.codes, self.scales, out, self.kind)
        return out

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernels' arithmetic in PyTorch (the no-compiler path): quantized activations, exact integer sums
        per 16 (Q6_K) or 32 (Q5_K) values, then the block scales; a slice of columns at a time."""
        blocks = self.codes.shape[1]
        quantized = quantize_activations(x, blocks)
        out = torch.empty(x.shape[0], self.out_features)
        step = _SLICE_TILES * TILE
        for start in range(0, self.out_features, step):
            ids = torch.arange(start, min(start + step, self.out_features))
            codes, sub, supers = self.unpack(ids)
            scale, minimum = self.block_scales(sub, supers)
            halves = scale.shape[-1]
            grouped = codes.view(len(ids), blocks, halves, -1).float() - (32 if minimum is None else 0)
            total = torch.zeros(x.shape[0], len(ids))
            for xq, dx in quantized.terms():
                sums = torch.einsum("mbhk,nbhk->mnbh", xq.view(x.shape[0], blocks, halves, -1), grouped)
                total = total + (sums * dx[:, None, :, None] * scale[None]).sum((-1, -2))
            if minimum is not None:
                total = total - quantized.sums @ minimum.t()
            out[:, ids] = total
        return out
