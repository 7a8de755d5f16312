"""A GGUF tensor kept as the file stores it: rows of ggml blocks, and what its bytes decode to.

`GGMLTensor` is what the loader hands the model for a quantized checkpoint. Row operations (llama.cpp's Q/K
permutation undone, Q/K/V and gate/up fused) work on the raw rows, so no float copy is ever made; the packed
forms built from it live above (`quantized.py`, `int8_dot.py`, `kquant_dot.py`), and each names this type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tokenloop.model.cpu_kernels import paged_decode_kernels

GROUP_SIZE = 32  # ggml's Q4/Q8 block length, and the int4 kernel's group size
SUPER_BLOCK = 256  # the K-quants' super-block length
INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)
Q4_BYTE_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)  # 16 bytes of nibble pairs a block
Q8_EXACT_TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0)  # held exactly as Q8_0 (`as_q8_0`)
QType = GGMLQuantizationType


def split_nibbles(packed: np.ndarray, axis: int = -1) -> np.ndarray:
    """ggml's 4-bit pairs unpacked: each byte's low nibble, then (concatenated along `axis`) its high one."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=axis)


def k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes [..., 12] -> eight 6-bit scales and mins [..., 8] uint8. Sub-blocks 0-3 keep their 6
    bits in the low bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 take 4 bits from bytes 8-11 and their top
    2 bits from the spare top bits of bytes 0-7."""
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 63, (extra & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mn = np.concatenate([high & 63, (extra >> 4) | ((high >> 6) << 4)], axis=-1)
    return sc, mn


@dataclass
class GGMLTensor:
    """A 2-D weight in ggml encoding: `blocks` holds `rows` rows of `row_bytes` raw bytes."""

    tensor_type: GGMLQuantizationType
    shape: tuple[int, int]  # (rows, columns), columns contiguous
    blocks: np.ndarray  # uint8 [rows, row_bytes]; may be a read-only view of the mapped file

    @classmethod
    def from_raw(cls, tensor_type: GGMLQuantizationType, shape: tuple[int, ...],
                 raw: np.ndarray) -> GGMLTensor:
        """Wrap a tensor's raw bytes (any leading dimensions fold into rows)."""
        rows = int(np.prod(shape[:-1]))
        return cls(tensor_type, (rows, int(shape[-1])), raw.reshape(rows, -1))

    @property
    def dtype(self) -> str:
        return self.tensor_type.name

    def take_rows(self, order: np.ndarray) -> GGMLTensor:
        """The rows in `order`: exact, since ggml blocks never span rows."""
        return GGMLTensor(self.tensor_type, self.shape, np.ascontiguousarray(self.blocks[order]))

    @staticmethod
    def concat(parts: list[GGMLTensor]) -> GGMLTensor | None:
        """Rows of several same-width tensors stacked (Q5_0 and Q8_0 parts as Q8_0, exactly: llama-quantize's
        mixes give a layer's V projection Q8_0 beside Q5_0 Q and K); None when their encodings differ."""
        if len({p.tensor_type for p in parts}) > 1 and all(p.tensor_type in Q8_EXACT_TYPES for p in parts):
            parts = [p.as_q8_0() for p in parts]
        first = parts[0]
        if any(p.tensor_type != first.tensor_type or p.shape[1] != first.shape[1] for p in parts):
            return None
        blocks = np.concatenate([p.blocks for p in parts], axis=0)
        return GGMLTensor(first.tensor_type, (blocks.shape[0], first.shape[1]), blocks)

    def dequantize(self, dtype: torch.dtype = torch.float32,
                   q4_codes: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
        """The float values (ggml's reference dequantization), converted to `dtype`; `q4_codes`: this tensor's
        `q4_codes()`, when the caller has them already."""
        if self.tensor_type in INT4_TYPES + (QType.Q8_0,):  # torch is ~10x faster than gguf's numpy
            rows, cols = self.shape
            kernels = paged_decode_kernels()
            if self.tensor_type == QType.Q8_0:
                codes, d = self.q8_codes()
                m = None
                grouped = torch.from_numpy(codes).view(rows, -1, GROUP_SIZE).float()
            elif (q4_codes is None and self.stores_nibble_pairs and kernels is not None
                  and dtype in (torch.float32, torch.bfloat16)):  # one C++ pass from the file's bytes, not five
                nibbles, d, m = self.q4_nibbles()
                out = torch.empty(self.shape, dtype=dtype)
                kernels.q4_unpack(torch.from_numpy(nibbles), torch.from_numpy(d), torch.from_numpy(m), out)
                return out
            else:
                codes, d, m = q4_codes if q4_codes is not None else self.q4_codes()
                grouped = torch.from_numpy(codes).view(rows, -1, GROUP_SIZE).float()
            grouped *= torch.from_numpy(d)[..., None]
            if m is not None:
                grouped += torch.from_numpy(m)[..., None]
            return grouped.view(rows, cols).to(dtype)
        if self.tensor_type == QType.F32:
            values = self.blocks.view(np.float32)
        elif self.tensor_type == QType.F16:
            values = self.blocks.view(np.float16).astype(np.float32)
        else:
            values = dequantize(self.blocks, self.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(self.shape)).to(dtype)

    def q4_codes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q4_0 / Q4_1 / Q4_K: 4-bit codes [rows, cols] uint8, and d, m [rows, cols / 32] float32
        (w = d * q + m)."""
        if self.tensor_type == QType.Q4_K:
            return self._q4_k_codes()
        nibbles, d, m = self.q4_nibbles()
        return split_nibbles(nibbles).reshape(self.shape), d, m

    @property
    def stores_nibble_pairs(self) -> bool:
        """Q4_0 / Q4_1: 16 code bytes a block, each two 4-bit values (`q4_nibbles`)."""
        return self.tensor_type in Q4_BYTE_TYPES

    def q4_nibbles(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q4_0 / Q4_1 as stored: each block's 16 code bytes [rows, cols / 32, 16] uint8 (a copy), ggml's
        pairs of values j (low nibble) and j + 16 (high nibble), with d, m [rows, cols / 32] float32."""
        if not self.stores_nibble_pairs:
            raise ValueError(f"{self.tensor_type.name} does not store 4-bit codes in nibble pairs")
        rows, cols = self.shape
        header = 2 if self.tensor_type == QType.Q4_0 else 4
        block = self.blocks.reshape(rows, cols // GROUP_SIZE, header + GROUP_SIZE // 2)
        d = block[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = np.ascontiguousarray(block[..., header:])
        if self.tensor_type == QType.Q4_0:
            m = -8.0 * d
        else:
            m = block[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return nibbles, d, m

    def _q4_k_codes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Q4_K's 144-byte super-blocks of 256 values: fp16 d and dmin, 12 bytes holding eight 6-bit scales and
        mins, 128 bytes of codes. Sub-block j of 32 has d_j = d * sc_j and m_j = -dmin * mn_j, in float32 as
        ggml's dequantization computes them, so d_j * q + m_j is its value bit for bit."""
        rows, cols = self.shape
        block = self.blocks.reshape(rows, cols // SUPER_BLOCK, 144)
        d = block[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        dmin = block[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        sc, mn = (part.astype(np.float32) for part in k_scales_mins(block[..., 4:16]))
        # Each 32 bytes of codes hold two sub-blocks: the low nibbles the first, the high nibbles the next.
        qs = block[..., 16:].reshape(rows, cols // SUPER_BLOCK, 4, 1, GROUP_SIZE)
        codes = split_nibbles(qs, axis=3).reshape(rows, cols)
        scale = (d[..., None] * sc).reshape(rows, cols // GROUP_SIZE)
        minimum = (dmin[..., None] * mn).reshape(rows, cols // GROUP_SIZE)
        return codes, scale, -minimum

    def as_q8_0(self) -> GGMLTensor:
        """This tensor as Q8_0 blocks holding the same values, for Q8_0 (itself) and Q5_0 (w = d (q - 16), q of
        5 bits: the code q - 16 fits int8 beside the same fp16 d), so the Q8_0 kernels run it."""
        if self.tensor_type == QType.Q8_0:
            return self
        if self.tensor_type != QType.Q5_0:
            raise ValueError(f"{self.tensor_type.name} has no exact Q8_0 form")
        rows, cols = self.shape
        block = self.blocks.reshape(rows, cols // GROUP_SIZE, 22)  # fp16 d, 4 bytes of high bits, 16 of nibbles
        high = block[..., 2:6].copy().view("<u4")  # bit j: the fifth bit of value j
        bits = (high >> np.arange(GROUP_SIZE, dtype=np.uint32)) & 1
        nibbles = block[..., 6:]
        low = split_nibbles(nibbles)  # values j and j + 16 share byte j
        codes = (low | (bits.astype(np.uint8) << 4)).astype(np.int16) - 16
        q8 = np.empty((rows, cols // GROUP_SIZE, 2 + GROUP_SIZE), dtype=np.uint8)
        q8[..., 0:2] = block[..., 0:2]
        q8[..., 2:] = codes.astype(np.int8).view(np.uint8)
        return GGMLTensor(QType.Q8_0, self.shape, q8.reshape(rows, -1))

    def q8_codes(self) -> tuple[np.ndarray, np.ndarray]:
        """Q8_0: int8 codes [rows, cols] and d [rows, cols / 32] float32 (w = d * q)."""
        rows, cols = self.shape
        block = self.blocks.reshape(rows, cols // GROUP_SIZE, 2 + GROUP_SIZE)
        d = block[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = block[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return codes, d
