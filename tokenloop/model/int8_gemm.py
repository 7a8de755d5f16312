"""Many-row products of the int8-dot packs (csrc/int8_gemm.cpp): a prefill chunk's projections, a batched LM head.

The decode kernels (csrc/int8_dot_matmul.cpp) quantize the activations to two int8 code sets per block of 32
(x ~= dx q + dx / 254 r, ~15 bits) and walk every row per 16-column tile: right for a few rows, where the
weights' bytes decide. With many rows the integer multiplies decide, and one code set (x ~= dx q, as llama.cpp
quantizes its activations to Q8) halves them: the GEMM runs at ~1.8-1.9x the decode kernels' FLOP rate per
core (BENCHMARKS.md, issue 30). `project()` (model/quantized.py) sends calls of at least `GEMM_MIN_ROWS` rows
here with the pack's `gemm_passes`: 1 for the MLP's projections, 2 (the decode kernels' own sums, the same
values) where a caller keeps the extra precision. A many-row head (`RescoredLogits`) runs one set, then the
decode kernels' values for the columns near each row's top: its greedy tokens are those of a few-row step.

Every product has a PyTorch twin (`reference`): the same quantized activations, the pack's exact weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.int8_dot import GROUP_SIZE, TILE, Int4DotWeight, Q8DotWeight, quantize_activations
from tokenloop.model.kquant_dot import KQuantDotWeight

GemmPack = Int4DotWeight | Q8DotWeight | KQuantDotWeight
# Fewest rows a call sends to the GEMM; fewer go to the decode kernels. Not a speed crossover (one code set is
# ~1.4-1.9x faster from 2 rows up, BENCHMARKS.md): decode-sized calls keep the decode steps' two code sets.
GEMM_MIN_ROWS = 16
# Q/K/V and o_proj keep two; the MLP's gate/up and down, ~70% of a prefill's multiplies, take one. On the default
# model, every row count packed, teacher-forced top-1 agreement with fp32 (tests/model/test_quantized_real_model.py,
# 1,280 tokens; the test wants >= 98%), one set summing the coded values: one set everywhere 97.5%; in the MLP only
# 98.3% (1,258); in gate/up alone 99.2%, down alone 99.1%; the MLP and o_proj 98.0% (BENCHMARKS.md, issues 29, 30).
PROJECTION_PASSES = 2
MLP_PASSES = 1
# The logits keep two: on Gemma 3 270M's greedy continuations one set's top-1 agreed with the exact product's on
# 99.5% of rows (94.4% on random-token rows), two on 100% (BENCHMARKS.md, issue 29). A many-row head runs one set
# and then recomputes at two every logit that could be its row's top (`RescoredLogits`).
LOGITS_PASSES = 2
# One code set's rounding error is ~uniform in +-dx / 2 per value, so a logit's error has a standard deviation of at
# most sigma = sqrt(sum over blocks g of dx_g^2 / 12 * max over columns of the block's sum of w^2). A column is
# recomputed when its one-set logit is within 2 x RESCORE_SIGMAS sigma of the row's one-set maximum (the top's error
# and the maximum's, each within RESCORE_SIGMAS sigma). Gemma 3 270M's head over 256 rows of real decoding: the
# largest error was 3.1 sigma of 67M logits, and ~2 columns a row are recomputed (BENCHMARKS.md, issue 29).
RESCORE_SIGMAS = 6.0
_NORM_TILES = 1024  # tiles of 16 columns at a time for the column norms


def gemm_kind(pack: object) -> int | None:
    """The kernel's format number for a pack (4: Q4, 8: Q8_0, 5 / 6 / 7: Q5_K / Q6_K / Q4_K), None for other packs."""
    if isinstance(pack, Int4DotWeight):
        return 4
    if isinstance(pack, Q8DotWeight):
        return 8
    if isinstance(pack, KQuantDotWeight):
        return pack.kind
    return None


def gemm_available() -> bool:
    """Whether the compiled GEMM runs here (AVX512-VNNI builds only)."""
    kernel = paged_decode_kernels()
    return kernel is not None and hasattr(kernel, "int8_gemm_native") and bool(kernel.int8_gemm_native())


def gemm_matmul(pack: GemmPack, x: torch.Tensor, passes: int) -> torch.Tensor:
    """x [M, K] -> x @ W.T [M, N] float32 with `passes` activation code sets (1 or 2); the PyTorch twin where
    the kernel does not run."""
    kind = gemm_kind(pack)
    if kind is None:
        raise TypeError(f"int8 GEMM: no kernel for {type(pack).__name__}")
    if x.dim() != 2 or x.shape[1] != pack.in_features:
        raise ValueError(f"{pack.form} GEMM: x [M, {pack.in_features}] expected, got {tuple(x.shape)}")
    x = x.float().contiguous()
    if not gemm_available():
        return reference(pack, x, passes)
    out = torch.empty(x.shape[0], pack.out_features, dtype=torch.float32)
    paged_decode_kernels().int8_gemm(x, pack.codes, pack.scales, out, kind, passes)  # type: ignore[union-attr]
    return out


def takes_gemm(parts: Sequence[object], rows: int) -> bool:
    """Whether a call of `rows` rows on a projection's packs runs the GEMM: at least `GEMM_MIN_ROWS` rows, every
    part a pack it multiplies, and the kernel built here."""
    return rows >= GEMM_MIN_ROWS and all(gemm_kind(part) is not None for part in parts) and gemm_available()


def many_row_product(parts: Sequence[object], x: torch.Tensor, passes: int) -> torch.Tensor | None:
    """x @ W.T through the GEMM for a projection's packs (a `RowStack`'s parts side by side), or None where the
    call does not take it (`takes_gemm`)."""
    if not takes_gemm(parts, x.shape[0]):
        return None
    outs = [gemm_matmul(part, x, passes) for part in parts]  # type: ignore[arg-type]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def reference(pack: GemmPack, x: torch.Tensor, passes: int) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch: x's codes (the first `passes` sets) times the pack's exact weights;
    Q4's m and Q5_K's dmin mn terms multiply the blocks' float sums of x, as in the kernels."""
    blocks = pack.codes.shape[1]
    quantized = quantize_activations(x.float(), blocks)
    coded = sum((codes * scale[..., None] for codes, scale in quantized.terms()[:passes]), torch.zeros(()))
    sums = quantized.sums if passes == 2 else coded.sum(-1)  # one set: the coded values' sums (int8_gemm.cpp)
    quantized = replace(quantized, sums=sums)
    coded = coded.reshape(x.shape[0], blocks * GROUP_SIZE)
    if isinstance(pack, Int4DotWeight):
        codes, d, m = pack.unpack()
        n = pack.out_features
        weights = codes[:n].view(n, blocks, GROUP_SIZE).float() * d[:n, :, None]
        return coded @ weights.view(n, -1).t() + quantized.sums @ m[:n].t()
    if isinstance(pack, KQuantDotWeight) and pack.kind in (5, 7):  # Q5_K, Q4_K: d sc q - dmin mn
        codes, sub, supers = pack.unpack(torch.arange(pack.out_features))
        scale, minimum = pack.block_scales(sub, supers)
        weights = codes.view(len(codes), blocks, GROUP_SIZE).float() * scale
        assert minimum is not None
        return coded @ weights.view(len(codes), -1).t() - quantized.sums @ minimum.t()
    return coded @ pack.dequantize().t()


class RescoredLogits:
    """A many-row LM head: the logits at one activation code set (the GEMM's fast mode), then the decode kernels'
    two-set values, bit for bit, of every column within reach of its row's top (the tiles holding them, as a small
    pack). A greedy token is the one a few-row step would pick, the distribution's head is the decode kernels', and
    the tail keeps one set's error (sigma ~0.04 logit on Gemma 3)."""

    def __init__(self, pack: Q8DotWeight | KQuantDotWeight) -> None:
        self.pack = pack
        # [blocks]: the most any column's block holds of sum w^2 (a K-quant's: a bound from its scales)
        self.block_norms = _block_norms(pack) if isinstance(pack, Q8DotWeight) else pack.block_square_bounds()

    @staticmethod
    def of(pack: object) -> RescoredLogits | None:
        """For a Q8_0 or K-quant head (Gemma 3's and the default model's Q8_0; Llama 3.2's and Qwen3's Q6_K); None
        for a Q4 pack (it keeps two sets)."""
        return RescoredLogits(pack) if isinstance(pack, Q8DotWeight | KQuantDotWeight) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> logits [M, N] float32."""
        x = x.float().contiguous()
        logits = gemm_matmul(self.pack, x, 1)
        scales = quantize_activations(x, self.pack.codes.shape[1]).scales
        sigma = (scales.square() @ self.block_norms / 12).sqrt()
        rows, cols = _near_top(logits, 2 * RESCORE_SIGMAS * sigma)
        tiles, where = (cols // TILE).unique(return_inverse=True)
        near = replace(self.pack, codes=self.pack.codes.index_select(0, tiles),
                       scales=self.pack.scales.index_select(0, tiles), out_features=len(tiles) * TILE)
        logits[rows, cols] = near.matmul(x)[rows, where * TILE + cols % TILE]
        return logits


_SPAN = 128  # columns a chunk of the search for the near-top columns


def _near_top(logits: torch.Tensor, margin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of the logits within `margin` [M] of their row's maximum. A compare and `nonzero` over every
    logit take ~15 ms of one core at 32 x 262k; chunk maxima take one vectorized pass, then only the chunks that
    reach the floor are searched."""
    m, n = logits.shape
    whole = n - n % _SPAN
    maxima = logits[:, :whole].view(m, -1, _SPAN).amax(-1)
    if whole < n:
        maxima = torch.cat([maxima, logits[:, whole:].amax(-1, keepdim=True)], dim=1)
    floor = maxima.amax(-1) - margin
    rows, chunks = (maxima >= floor[:, None]).nonzero(as_tuple=True)
    cols = (chunks[:, None] * _SPAN + torch.arange(_SPAN)).clamp(max=n - 1)
    hit = logits[rows[:, None], cols] >= floor[rows, None]
    pairs = torch.unique(torch.stack([rows[:, None].expand_as(cols)[hit], cols[hit]]), dim=1)  # the tail's repeats
    return pairs[0], pairs[1]


def _block_norms(pack: Q8DotWeight) -> torch.Tensor:
    """[blocks]: per block of 32 inputs, the largest sum of w^2 over the pack's columns, from the tiles as they are
    (codes + 128 in [tile, block, chunk, lane, byte] order, scales [tile, block, lane]): ~1 s for a 262k-row head."""
    tiles, blocks, _ = pack.codes.shape
    norms = torch.zeros(blocks)
    for start in range(0, tiles, _NORM_TILES):
        codes = pack.codes[start:start + _NORM_TILES].view(-1, blocks, 8, TILE, 4).to(torch.int16) - 128
        sums = (codes * codes).sum((2, 4), dtype=torch.int32) * pack.scales[start:start + _NORM_TILES].float().square()
        norms = torch.maximum(norms, sums.amax(dim=(0, 2)))
    return norms
