"""Rotary position embeddings: inverse frequencies (default, linear, llama3 scaling, llama.cpp's per-frequency
factors), cos/sin tables over positions, and the rotation, full or over the first `rotary_dim` of each head."""

from __future__ import annotations

import math

import torch

from tokenloop.config import RopeScaling


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling, freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim / 2], with default, linear or llama3 scaling (`head_dim`: the
    rotated part of a head)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        return (inv_freq / freq_factors.to(torch.float64)).float()
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        original = scaling.original_max_position_embeddings
        low_wavelen = original / scaling.low_freq_factor
        high_wavelen = original / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq, scaled)
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate half-split pairs (HF's rotate_half convention). x [T, heads, D]; cos/sin [T, 1, R/2] with
    R <= D: the first R dims of each head rotate, the rest pass through (partial rotary)."""
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryTables:
    """cos and sin of every position's angles [max_positions, R/2], in the activations' dtype. A model with
    per-layer theta holds one per distinct theta."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, device: torch.device, dtype: torch.dtype,
                 magnitude: float = 1.0) -> None:
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq.to(device))
        self.cos = (angles.cos() * magnitude).to(dtype)
        self.sin = (angles.sin() * magnitude).to(dtype)

    @property
    def rotary_dim(self) -> int:
        return 2 * self.cos.shape[1]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions` [T], shaped [T, 1, R/2] to broadcast over heads."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


def longrope_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling, context: int,
                         max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: (inverse frequencies, cos/sin magnitude). The long factors serve a context longer than
    the original training length, the short ones any other; the choice is made once for the configured
    context, as llama.cpp does, since the paged cache keeps K rotated (HF switches per sequence length)."""
    original = scaling.original_max_position_embeddings
    factors = scaling.long_factor if context > original else scaling.short_factor
    base = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base)
    magnitude = scaling.attention_factor
    if magnitude <= 0:
        stretch = max_position_embeddings / original
        magnitude = 1.0 if stretch <= 1.0 else math.sqrt(1 + math.log(stretch) / math.log(original))
    return inv_freq, magnitude
