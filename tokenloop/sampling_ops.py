"""The sampler's tensor kernels: the inverse-CDF draw, top-k / top-p thresholds, penalties, logprobs.

Each works on whole rows of a batch and reads nothing but its arguments; `tokenloop.sampler` decides
which rows go through which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenloop.request import Request

# Top-k/top-p look at this many best tokens per row first; only rows they do not settle get a full sort.
_CANDIDATE_STAGES = (64, 1024, 8192)
# Tokens per block of the two-level cumulative sum a draw searches.
_DRAW_BLOCK = 256
_NEG_INF = float("-inf")


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i's token t with chance probs[i, t] / sum(probs[i]), given a uniform u[i] in [0, 1) (float64).

    Also returns which rows had any mass to draw from (the others' tokens are meaningless).

    Two levels keep small probabilities accurate without a slow float64 pass over the vocabulary: a
    float32 cumsum inside blocks (exact to the block's mass), float64 across block masses. Both are
    sequential per row, so a row's token does not depend on the other rows. The chosen token's
    cumulative sum strictly increases at it, so its probability is never 0.
    """
    rows, vocab = probs.shape
    if vocab % _DRAW_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, _DRAW_BLOCK - vocab % _DRAW_BLOCK))
    within = probs.view(rows, -1, _DRAW_BLOCK).cumsum(dim=2)
    block_cdf = within[:, :, -1].double().cumsum(dim=1)
    total = block_cdf[:, -1:]
    # Strictly below the total, so the chosen block has mass > 0.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True).clamp_max(block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), torch.zeros_like(target))
    inside = within[torch.arange(rows, device=probs.device), block.squeeze(1)].double()
    mass = inside[:, -1:]
    residual = torch.minimum(target - before, torch.nextafter(mass, torch.zeros_like(mass))).clamp_min(0.0)
    offset = torch.searchsorted(inside, residual, right=True).clamp_max(_DRAW_BLOCK - 1)
    tokens = (block * _DRAW_BLOCK + offset).squeeze(1).clamp_max(vocab - 1)
    return tokens, total.squeeze(1) > 0


@dataclass
class PenaltyHistory:
    """The penalised rows' parameters and token histories (references to the requests' own lists)."""

    repetition: list[float]
    frequency: list[float]
    presence: list[float]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]

    @classmethod
    def of(cls, requests: Sequence[Request]) -> PenaltyHistory:
        params = [r.sampling_params for r in requests]
        return cls([p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                   [p.presence_penalty for p in params], [r.prompt_token_ids for r in requests],
                   [r.output_token_ids for r in requests])


def apply_penalties(x: torch.Tensor, history: PenaltyHistory) -> None:
    """Repetition (prompt + output), frequency and presence (output only) penalties, in place.

    Only the (row, token) cells that occurred are touched: unique flat keys row * V + token with their
    counts cost O(tokens), where dense [B, V] count matrices would cost O(B * V) per step.
    The keys are made and deduplicated on the host (they come from the requests' Python lists) and copied
    to the logits' device once.
    """
    vocab = x.shape[1]
    device = x.device
    flat = x.view(-1)
    out_keys, out_counts = torch.unique(_flat_keys(history.output_token_ids, vocab), return_counts=True)
    if any(p != 1.0 for p in history.repetition):
        prompt_keys = _flat_keys(history.prompt_token_ids, vocab)
        seen = torch.unique(torch.cat([prompt_keys, out_keys]))
        penalty = torch.tensor(history.repetition, dtype=x.dtype)[seen // vocab].to(device)
        seen = seen.to(device)
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if out_keys.numel() and (any(f != 0 for f in history.frequency) or any(p != 0 for p in history.presence)):
        frequency = torch.tensor(history.frequency, dtype=x.dtype)
        presence = torch.tensor(history.presence, dtype=x.dtype)
        rows = out_keys // vocab
        by_count = (out_counts.to(x.dtype) * frequency[rows]).to(device)
        out_keys = out_keys.to(device)
        flat[out_keys] = flat[out_keys] - by_count - presence[rows].to(device)


def _flat_keys(sequences: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """row * vocab_size + token for every token of every row's sequence."""
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor([len(s) for s in sequences]))
    return rows * vocab_size + ids


def top_k_top_p_thresholds(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The smallest logit each row keeps under top-k then top-p (0 / 1.0: off); ties of it are kept too."""
    n = x.shape[0]
    device = x.device
    thresholds = torch.full((n,), _NEG_INF, dtype=x.dtype, device=device)
    k_only = [i for i in range(n) if top_k[i] and top_p[i] >= 1.0]
    if k_only:
        k = torch.tensor([top_k[i] for i in k_only], device=device)
        # One topk as wide as the largest k: a k-th value does not depend on how many more are fetched.
        values = torch.topk(_rows(x, k_only), max(top_k[i] for i in k_only), dim=1).values
        thresholds[k_only] = values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    p_rows = [i for i in range(n) if top_p[i] < 1.0]
    if p_rows:
        thresholds[p_rows] = _top_p_thresholds(
            _rows(x, p_rows), torch.tensor([top_k[i] for i in p_rows], device=device),
            torch.tensor([top_p[i] for i in p_rows], dtype=x.dtype, device=device))
    return thresholds


def _top_p_thresholds(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p cut-off logits (after top-k, 0 = off) for rows that all have top_p < 1.

    Each row first looks at its best few candidates (`torch.topk`); rows whose cut-off is not settled
    within them move to a bigger stage and finally a full sort. Stages give bit-identical thresholds:
    every quantity is a prefix (a sequential cumsum over values sorted by size) of the same sequence.
    Off the CPU there are no stages: deciding which rows move on would read flags back from the device,
    and one full sort is cheap there.
    """
    n, vocab = x.shape
    on_cpu = x.device.type == "cpu"
    # Weights come from the full row's softmax, computed once, so every stage sees the same numbers.
    probs = torch.softmax(x, dim=1)
    thresholds = torch.full((n,), _NEG_INF, dtype=x.dtype, device=x.device)
    pending = torch.arange(n, device=x.device)
    for stage in (*_CANDIDATE_STAGES, vocab) if on_cpu else (vocab,):
        width = min(stage, vocab)
        final = width == vocab
        # A row whose top_k exceeds this stage cannot read its k-th value here.
        here = pending if final else pending[top_k[pending] <= width]
        if here.numel() == 0:
            continue
        rows = here.tolist() if on_cpu else list(range(n))  # off the CPU: the one stage, every row
        if final:
            values, order = torch.sort(_rows(x, rows), dim=1, descending=True)
        else:
            values, order = torch.topk(_rows(x, rows), width, dim=1)
        k, p = top_k[here], top_p[here]
        k_on = k > 0
        kth = values.gather(1, (k - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
        in_k = (values >= kth.unsqueeze(1)) | ~k_on.unsqueeze(1)
        num_in_k = in_k.sum(dim=1)
        sorted_probs = _rows(probs, rows).gather(1, order)
        cumulative = torch.cumsum(sorted_probs, dim=1)
        # Mass of the top-k set, so top-p works on the renormalised distribution, as vLLM's does.
        mass_k = cumulative.gather(1, (num_in_k - 1).unsqueeze(1)).squeeze(1)
        mass_k = torch.where(k_on, mass_k, torch.ones_like(mass_k))
        # Keep the smallest prefix whose mass reaches p: a token stays if the mass before it is < p.
        keep = ((cumulative - sorted_probs) < (p * mass_k).unsqueeze(1)) & in_k
        num_keep = keep.sum(dim=1).clamp_min(1)
        cut = values.gather(1, (num_keep - 1).unsqueeze(1)).squeeze(1)
        if final:
            thresholds[here] = cut
            break
        # Settled only if the prefix and the top-k set both end inside this stage's candidates.
        settled = (num_keep < width) & (~k_on | (num_in_k < width))
        thresholds[here[settled]] = cut[settled]
        done = torch.zeros(n, dtype=torch.bool)
        done[here[settled]] = True
        pending = pending[~done[pending]]
        if pending.numel() == 0:
            break
    return thresholds


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], without a copy when that is every row in order."""
    return x if rows == list(range(x.shape[0])) else x[rows]
