"""Batched sampling: one row of logits per request in, one token per request out (stage 4 of the loop).

Processing follows vLLM's order: logit_bias, min_tokens (EOS and stop ids masked), repetition /
frequency / presence penalties, then temperature (0 means greedy: argmax of the penalised logits),
top-k, top-p, min-p, and a draw. Logprobs describe the raw model distribution, before any of that.

Everything is vectorised over the batch, and work nobody asked for is skipped: penalties touch only
the tokens that occurred, top-k/top-p sort only the rows a partial `topk` did not settle, and an
all-greedy batch without penalties costs one argmax.

A draw is inverse-CDF sampling with one uniform number per row. A seeded request takes its number
from its own generator and every per-row computation only reads that row, so its tokens do not
depend on what it is batched with or on its row position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from tokenloop.errors import InvalidRequestError
from tokenloop.request import Request, SamplingParams

if TYPE_CHECKING:
    from tokenloop.structured.matcher import BitmaskApplier

# Below this, dividing by the temperature overflows float32; such rows are greedy, as in vLLM.
GREEDY_TEMPERATURE = 1e-5
# Top-k/top-p look at this many best tokens per row first; only rows they do not settle get a full sort.
_CANDIDATE_STAGES = (64, 1024, 8192)
# Rows of the [L, V] log-softmax that prompt_logprobs holds at once, to bound memory on long prompts.
_PROMPT_LOGPROBS_CHUNK = 512
# Tokens per block of the two-level cumulative sum a draw searches.
_DRAW_BLOCK = 256
_NEG_INF = float("-inf")


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token's, its rank, and the best alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token (ties share the better rank)
    top: list[tuple[int, float]]  # the N most likely (token_id, logprob), best first


@dataclass
class SamplerOutput:
    """One sampled token per row, and its logprobs when the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Turns a step's logits into tokens under each request's `SamplingParams`.

    Unseeded rows draw from one engine-wide generator seeded with `seed`; seeded rows draw from
    `request.generator`.
    """

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self._grammar_masks: BitmaskApplier | None = None  # built when a constrained request first shows up

    def validate(self, params: SamplingParams) -> None:
        """Raise `InvalidRequestError` if `params` name token ids outside the vocabulary.

        The engine should call this when a request arrives; `sample` repeats the check, but failing
        there fails the whole step.
        """
        for token_id in params.logit_bias or {}:
            self._check_token_id(token_id, "logit_bias")
        for token_id in params.stop_token_ids or []:
            self._check_token_id(token_id, "stop_token_ids")

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """Sample one token per row; row i of `logits` [B, V] belongs to `requests[i]`."""
        logits = self._check_logits(logits, len(requests))
        token_ids = self._choose(self.process(logits, requests), requests)
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if any(r.sampling_params.logprobs is not None for r in requests):
            logprobs = self._sampled_logprobs(logits, token_ids, requests)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    @torch.inference_mode()
    def process(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The logits each row's token is drawn from, with excluded tokens at -inf.

        Greedy rows hold their penalised logits (their token is the argmax); the other rows are also
        divided by the temperature and truncated by top-k, top-p and min-p. May return `logits`
        itself when nothing changes it; never modifies it.
        """
        logits = self._check_logits(logits, len(requests))
        if any(r.structured is not None for r in requests):  # grammar bitmasks first, as vLLM applies them
            logits = self._apply_grammar(logits, requests)
        x = self._penalise(logits, requests)
        random_rows = [i for i, r in enumerate(requests) if not _is_greedy(r.sampling_params)]
        if not random_rows:
            return x
        if len(random_rows) == len(requests):
            return self._truncate(self._scale(x, requests), requests)
        rows = torch.tensor(random_rows)
        sub = [requests[i] for i in random_rows]
        if x is logits:
            x = logits.clone()
        x[rows] = self._truncate(self._scale(x[rows], sub), sub)
        return x

    @torch.inference_mode()
    def prompt_logprobs(self, logits: torch.Tensor, target_token_ids: torch.Tensor,
                        num_top: int) -> list[TokenLogprobs]:
        """Logprobs of each target token under the row predicting it: `logits` [L, V], targets [L]."""
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"expected logits [L, {self.vocab_size}], got {tuple(logits.shape)}")
        if target_token_ids.shape != (logits.shape[0],):
            raise ValueError(f"expected {logits.shape[0]} target ids, got {tuple(target_token_ids.shape)}")
        targets = target_token_ids.to(torch.long)
        out: list[TokenLogprobs] = []
        for start in range(0, logits.shape[0], _PROMPT_LOGPROBS_CHUNK):
            end = start + _PROMPT_LOGPROBS_CHUNK
            lp = torch.log_softmax(logits[start:end].float(), dim=-1)
            out.extend(_gather_logprobs(lp, targets[start:end], [num_top] * lp.shape[0]))
        return out

    def _apply_grammar(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        if self._grammar_masks is None:
            from tokenloop.structured.matcher import BitmaskApplier

            self._grammar_masks = BitmaskApplier(self.vocab_size)
        return self._grammar_masks.apply(logits, [r.structured for r in requests])

    # ---- checks -------------------------------------------------------------------------------

    def _check_logits(self, logits: torch.Tensor, batch_size: int) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape != (batch_size, self.vocab_size):
            raise ValueError(f"expected logits [{batch_size}, {self.vocab_size}], got {tuple(logits.shape)}")
        return logits.float().contiguous()

    def _check_token_id(self, token_id: int, param: str) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise InvalidRequestError(
                f"token id {token_id} in {param} is outside the vocabulary [0, {self.vocab_size})", param=param)

    # ---- logit processors before temperature --------------------------------------------------

    def _penalise(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """logit_bias, min_tokens, then repetition/frequency/presence penalties; copies only if needed."""
        x = logits
        # logit_bias and min_tokens both touch a few (row, token) cells: collect them, write once each.
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        penalty_rows: list[int] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            for token_id, bias in (p.logit_bias or {}).items():
                self._check_token_id(token_id, "logit_bias")
                bias_rows.append(i)
                bias_cols.append(token_id)
                bias_vals.append(bias)
            if r.num_output_tokens < p.min_tokens:
                stops = list(p.stop_token_ids or [])
                if r.eos_token_id is not None and not p.ignore_eos:
                    stops.append(r.eos_token_id)
                for token_id in stops:
                    self._check_token_id(token_id, "stop_token_ids")
                    mask_rows.append(i)
                    mask_cols.append(token_id)
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                penalty_rows.append(i)
        if bias_rows:
            x = x.clone()
            x.index_put_((torch.tensor(bias_rows), torch.tensor(bias_cols)),
                         torch.tensor(bias_vals, dtype=x.dtype), accumulate=True)
        if mask_rows:
            if x is logits:
                x = x.clone()
            x[torch.tensor(mask_rows), torch.tensor(mask_cols)] = _NEG_INF
        if penalty_rows:
            if x is logits:
                x = x.clone()
            if len(penalty_rows) == len(requests):
                _apply_penalties(x, requests)
            else:
                rows = torch.tensor(penalty_rows)
                sub = x[rows]
                _apply_penalties(sub, [requests[i] for i in penalty_rows])
                x[rows] = sub
        return x

    # ---- temperature and truncation (non-greedy rows only) -------------------------------------

    @staticmethod
    def _scale(x: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        temps = [r.sampling_params.temperature for r in requests]
        if all(t == 1.0 for t in temps):
            return x
        return x / torch.tensor(temps, dtype=x.dtype).unsqueeze(1)

    def _truncate(self, x: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Apply top-k, top-p, then min-p to temperature-scaled rows `x`; out of place."""
        vocab = x.shape[1]
        top_k = [r.sampling_params.top_k if 0 < r.sampling_params.top_k < vocab else 0 for r in requests]
        top_p = [r.sampling_params.top_p for r in requests]
        kp_rows = [i for i in range(len(requests)) if top_k[i] or top_p[i] < 1.0]
        if kp_rows:
            if len(kp_rows) == len(requests):
                thresholds = _top_k_top_p_thresholds(x, top_k, top_p)
                x = x.masked_fill(x < thresholds.unsqueeze(1), _NEG_INF)
            else:
                rows = torch.tensor(kp_rows)
                sub = x[rows]
                thresholds = _top_k_top_p_thresholds(sub, [top_k[i] for i in kp_rows], [top_p[i] for i in kp_rows])
                x = x.clone()
                x[rows] = sub.masked_fill_(sub < thresholds.unsqueeze(1), _NEG_INF)
        min_p = [r.sampling_params.min_p for r in requests]
        if any(m > 0.0 for m in min_p):
            # prob < min_p * max_prob  <=>  logit < max_logit + log(min_p); renormalising changes neither side.
            log_min_p = torch.tensor([math.log(m) if m > 0.0 else _NEG_INF for m in min_p], dtype=x.dtype)
            floor = x.amax(dim=1) + log_min_p
            x = x.masked_fill(x < floor.unsqueeze(1), _NEG_INF)
        return x

    # ---- the draw ---------------------------------------------------------------------------

    def _choose(self, processed: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Greedy rows take the argmax; the others draw from softmax of their processed logits."""
        greedy = [_is_greedy(r.sampling_params) for r in requests]
        if all(greedy):
            return processed.argmax(dim=1)
        if not any(greedy):
            return self._draw(processed, requests)
        tokens = torch.empty(len(requests), dtype=torch.long)
        greedy_rows = torch.tensor([i for i, g in enumerate(greedy) if g])
        random_rows = [i for i, g in enumerate(greedy) if not g]
        tokens[greedy_rows] = processed[greedy_rows].argmax(dim=1)
        tokens[torch.tensor(random_rows)] = self._draw(processed[random_rows], [requests[i] for i in random_rows])
        return tokens

    def _draw(self, x: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Inverse-CDF draw: one uniform per row, from the row's own generator when it has one."""
        u = torch.empty(len(requests), dtype=torch.float64)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator, dtype=torch.float64)
        for i, r in enumerate(requests):
            if r.generator is not None:
                u[i] = torch.rand(1, generator=r.generator, dtype=torch.float64)
        tokens, drawable = _inverse_cdf(torch.softmax(x, dim=1), u)
        if not bool(drawable.all()):  # every token masked (or NaN logits): fall back to the argmax
            tokens = torch.where(drawable, tokens, x.argmax(dim=1))
        return tokens

    # ---- logprobs ---------------------------------------------------------------------------

    @staticmethod
    def _sampled_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                          requests: Sequence[Request]) -> list[TokenLogprobs | None]:
        """Logprobs under the raw model distribution for the rows that asked for them."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(requests)
        if len(rows) == len(requests):
            lp = torch.log_softmax(logits, dim=1)
            targets = token_ids
        else:
            index = torch.tensor(rows)
            lp = torch.log_softmax(logits[index], dim=1)
            targets = token_ids[index]
        num_top = [requests[i].sampling_params.logprobs or 0 for i in rows]
        for i, entry in zip(rows, _gather_logprobs(lp, targets, num_top)):
            out[i] = entry
        return out


def _is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    inside = within[torch.arange(rows), block.squeeze(1)].double()
    mass = inside[:, -1:]
    residual = torch.minimum(target - before, torch.nextafter(mass, torch.zeros_like(mass))).clamp_min(0.0)
    offset = torch.searchsorted(inside, residual, right=True).clamp_max(_DRAW_BLOCK - 1)
    tokens = (block * _DRAW_BLOCK + offset).squeeze(1).clamp_max(vocab - 1)
    return tokens, total.squeeze(1) > 0


def _apply_penalties(x: torch.Tensor, requests: Sequence[Request]) -> None:
    """Repetition (prompt + output), frequency and presence (output only) penalties, in place.

    Only the (row, token) cells that occurred are touched: unique flat keys row * V + token with their
    counts cost O(tokens), where dense [B, V] count matrices would cost O(B * V) per step.
    """
    vocab = x.shape[1]
    params = [r.sampling_params for r in requests]
    flat = x.view(-1)
    out_keys, out_counts = torch.unique(_flat_keys([r.output_token_ids for r in requests], vocab),
                                        return_counts=True)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_keys = _flat_keys([r.prompt_token_ids for r in requests], vocab)
        seen = torch.unique(torch.cat([prompt_keys, out_keys]))
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype)[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=x.dtype)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=x.dtype)
    if out_keys.numel() and bool((frequency != 0).any() or (presence != 0).any()):
        rows = out_keys // vocab
        flat[out_keys] = flat[out_keys] - out_counts.to(x.dtype) * frequency[rows] - presence[rows]


def _flat_keys(sequences: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """row * vocab_size + token for every token of every row's sequence."""
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(sequences)), torch.tensor([len(s) for s in sequences]))
    return rows * vocab_size + ids


def _top_k_top_p_thresholds(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The smallest logit each row keeps under top-k then top-p (0 / 1.0: off); ties of it are kept too."""
    n = x.shape[0]
    thresholds = torch.full((n,), _NEG_INF, dtype=x.dtype)
    k_only = [i for i in range(n) if top_k[i] and top_p[i] >= 1.0]
    if k_only:
        k = torch.tensor([top_k[i] for i in k_only])
        # One topk as wide as the largest k: a k-th value does not depend on how many more are fetched.
        values = torch.topk(_rows(x, k_only), int(k.max()), dim=1).values
        thresholds[k_only] = values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    p_rows = [i for i in range(n) if top_p[i] < 1.0]
    if p_rows:
        thresholds[p_rows] = _top_p_thresholds(
            _rows(x, p_rows), torch.tensor([top_k[i] for i in p_rows]),
            torch.tensor([top_p[i] for i in p_rows], dtype=x.dtype))
    return thresholds


def _top_p_thresholds(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p cut-off logits (after top-k, 0 = off) for rows that all have top_p < 1.

    Each row first looks at its best few candidates (`torch.topk`); rows whose cut-off is not settled
    within them move to a bigger stage and finally a full sort. Stages give bit-identical thresholds:
    every quantity is a prefix (a sequential cumsum over values sorted by size) of the same sequence.
    """
    n, vocab = x.shape
    # Weights come from the full row's softmax, computed once, so every stage sees the same numbers.
    probs = torch.softmax(x, dim=1)
    thresholds = torch.full((n,), _NEG_INF, dtype=x.dtype)
    pending = torch.arange(n)
    for stage in (*_CANDIDATE_STAGES, vocab):
        width = min(stage, vocab)
        final = width == vocab
        # A row whose top_k exceeds this stage cannot read its k-th value here.
        here = pending if final else pending[top_k[pending] <= width]
        if here.numel() == 0:
            continue
        rows = here.tolist()
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
            settled = torch.ones(len(rows), dtype=torch.bool)
        else:
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


def _gather_logprobs(lp: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """TokenLogprobs for each row of log-probabilities `lp` at `targets`, with `num_top[i]` alternatives."""
    chosen = lp.gather(1, targets.unsqueeze(1))
    ranks = (lp > chosen).sum(dim=1) + 1
    most = max(num_top, default=0)
    top_values_list: list[list[float]] = []
    top_ids_list: list[list[int]] = []
    if most > 0:
        top_values, top_ids = torch.topk(lp, min(most, lp.shape[1]), dim=1)
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    out = []
    for i, (token_id, logprob, rank) in enumerate(zip(targets.tolist(), chosen.squeeze(1).tolist(), ranks.tolist())):
        top = list(zip(top_ids_list[i][:num_top[i]], top_values_list[i][:num_top[i]])) if num_top[i] else []
        out.append(TokenLogprobs(token_id=token_id, logprob=logprob, rank=rank, top=top))
    return out
