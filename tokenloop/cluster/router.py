"""Router policies: which replica gets a request, pluggable by name like the scheduler's policies.

- `round-robin`: the next candidate in index order.
- `least-load`: vLLM's data-parallel balance, `4 x waiting + running` (the waiting count includes the
  requests routed since the replica's last stats).
- `cost`: the predicted time to first token on each replica, in seconds from its measured step costs:
  the wait for admission (free blocks and sequence slots, freed at the measured finish rate), then the
  prefill queued there plus this prompt's uncached part (exact prefix hits: the prompt's chained block
  hashes, computed with the engine's own `hash_block` and salt, looked up in the replica's KV mirror),
  chunked into steps that also carry its running decodes; plus what the decode rows beside it will add
  to its own decode. A hot prefix held by one replica stops winning there as soon as its queue (or its
  batch) costs more than recomputing the prefix elsewhere.

Ties (scores within `tie_epsilon` of the best, relatively) keep affinity, never a rotating tie-break
(that spread multi-turn sessions over ranks in vllm #52463): the session's last replica if it is among
them, else the one the prompt's first block hashes to (rendezvous hashing, stable as replicas come and
go). Only alive and admitting replicas are candidates; with none, `NoReplicaError`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenloop.cluster.load import LoadTracker, ReplicaLoad
from tokenloop.core.kv_cache import block_hash_chain, hash_block
from tokenloop.errors import CapacityError, InvalidRequestError

_MASK = (1 << 64) - 1


class NoReplicaError(CapacityError):
    """No replica is alive and admitting work; retry later."""


@dataclass(slots=True)
class RouteRequest:
    """What a router sees of a request: token ids, the cache salt, and a session for affinity."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None
    session: str | None = None  # the OpenAI `user` or a session id: affinity on ties
    block_hashes: list[int] | None = None  # the prompt's full-block chain, filled by `prompt_block_hashes`
    lora_name: str | None = None  # its LoRA adapter: `cost` prefers a replica that has it resident


@dataclass(slots=True)
class RouteDecision:
    """Where a request went and why (recorded in its trace)."""

    replica: int
    policy: str
    predicted_ttft_s: float | None
    cached_tokens: int  # the prefix the router expects the replica to hold
    scores: dict[int, float] = field(default_factory=dict)  # per candidate replica, lower is better


@dataclass(frozen=True)
class RouterConfig:
    """Router settings; `block_size` must be the replicas' (the hashes are per block)."""

    block_size: int = 16
    max_num_batched_tokens: int = 512  # the replicas' per-step token budget: prefill chunks into steps
    max_num_seqs: int = 64  # the replicas' sequence slots: beyond them a request waits for a finish
    typical_decode_steps: int = 128  # until finishes are measured: a running request's remaining steps
    # cost: how much the decode rows beside a request weigh against its TTFT. 0 is TTFT alone, which piles
    # a hot prefix onto its holders where a row is dear (CPU profile, hot trace: -7% throughput, 6x ITL);
    # 1 is its whole decode, which pushes hot prefixes off their holders where rows are cheap (H100
    # profile: +57% p90 TTFT). 0.1 won on p90 TTFT on every cluster trace of the sweep (BENCHMARKS.md).
    decode_weight: float = 0.1
    tie_epsilon: float = 0.02  # scores within this relative distance of the best are ties
    waiting_weight: float = 4.0  # least-load: waiting requests count this many running ones
    max_sessions: int = 100_000  # session -> last replica, least recently used dropped first
    # cost: what a request of a LoRA adapter not resident on a replica adds there (loading it into a slot,
    # maybe evicting another that its requests then reload): the slot load of a rank-16 adapter of the
    # default model, with margin (BENCHMARKS.md, LoRA).
    adapter_load_s: float = 0.05

    def __post_init__(self) -> None:
        if min(self.block_size, self.max_num_batched_tokens, self.max_num_seqs, self.max_sessions,
               self.typical_decode_steps) < 1:
            raise InvalidRequestError("block_size, max_num_batched_tokens, max_num_seqs, max_sessions and "
                                      "typical_decode_steps must be >= 1")
        if not 0 <= self.tie_epsilon < 1 or min(self.waiting_weight, self.decode_weight, self.adapter_load_s) < 0:
            raise InvalidRequestError("tie_epsilon must be in [0, 1), waiting_weight, decode_weight and "
                                      "adapter_load_s >= 0")


class Router(Protocol):
    """Picks one replica among the alive and admitting ones."""

    name: str

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision: ...


def prompt_block_hashes(request: RouteRequest, block_size: int) -> list[int]:
    """The chain of the prompt's full blocks, exactly as the engine's KV cache hashes them (cached)."""
    if request.block_hashes is None:
        request.block_hashes = block_hash_chain(request.prompt_token_ids, block_size, request.cache_salt)
    return request.block_hashes


def _candidates(replicas: Sequence[ReplicaLoad]) -> list[ReplicaLoad]:
    candidates = [r for r in replicas if r.alive and r.admitting]
    if not candidates:
        states = ", ".join(f"{r.index}: {'draining' if r.alive else 'dead'}" for r in replicas) or "none"
        raise NoReplicaError(f"no replica is alive and admitting requests ({states})")
    return candidates


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value from any int."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _Affinity:
    """Tie-breaking that keeps a session, or a first block, on one replica."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._sessions: OrderedDict[str, int] = OrderedDict()

    def pick(self, request: RouteRequest, tied: Sequence[int]) -> int:
        if len(tied) == 1:
            return tied[0]
        if request.session is not None:
            last = self._sessions.get(request.session)
            if last in tied:
                return last  # type: ignore[return-value]
        hashes = prompt_block_hashes(request, self.config.block_size)
        # No full block: the whole prompt (or the session) stands in for the first block.
        key = hashes[0] if hashes else hash_block(None, request.prompt_token_ids, request.session)
        return max(tied, key=lambda index: _mix(key ^ _mix(index)))

    def remember(self, request: RouteRequest, replica: int) -> None:
        if request.session is None:
            return
        self._sessions[request.session] = replica
        self._sessions.move_to_end(request.session)
        if len(self._sessions) > self.config.max_sessions:
            self._sessions.popitem(last=False)

    def choose(self, request: RouteRequest, scores: dict[int, float]) -> int:
        best = min(scores.values())
        margin = abs(best) * self.config.tie_epsilon
        tied = [index for index, score in scores.items() if score <= best + margin]
        replica = self.pick(request, tied)
        self.remember(request, replica)
        return replica


class RoundRobinRouter:
    """The next alive and admitting replica after the last one chosen."""

    name = "round-robin"

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._next = 0

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
        candidates = _candidates(replicas)
        by_index = sorted(candidates, key=lambda r: r.index)
        chosen = next((r for r in by_index if r.index >= self._next), by_index[0])
        self._next = chosen.index + 1
        return RouteDecision(chosen.index, self.name, None, 0, {})


class LeastLoadRouter:
    """vLLM's balance: the smallest `waiting_weight x waiting + running`; ties keep affinity."""

    name = "least-load"

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._affinity = _Affinity(config)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
        weight = self.config.waiting_weight
        scores = {r.index: weight * r.num_waiting + r.num_running for r in _candidates(replicas)}
        # Integer loads: only an exact tie is a tie.
        best = min(scores.values())
        tied = [index for index, score in scores.items() if score == best]
        replica = self._affinity.pick(request, tied)
        self._affinity.remember(request, replica)
        return RouteDecision(replica, self.name, None, 0, {k: float(v) for k, v in scores.items()})


def admission_wait_s(load: ReplicaLoad, blocks_needed: int, config: RouterConfig) -> float:
    """Seconds before the replica can admit this request: while the blocks it and the requests routed
    ahead of it need exceed the free ones, or every sequence slot is taken, it waits for finishes (each
    frees a slot and, on average, `blocks_per_finish` blocks), at the replica's measured finish rate."""
    if load.num_free_blocks is None:
        return 0.0  # not reported yet: nothing known to wait for
    block_deficit = max(0, load.unadmitted_blocks + blocks_needed - load.num_free_blocks)
    seq_deficit = max(0, load.num_running + load.unadmitted + 1 - config.max_num_seqs)
    if not block_deficit and not seq_deficit:
        return 0.0
    rate = load.finish_rate_per_s
    if not rate:  # nothing finished lately: the running ones finish within a typical decode
        step = load.costs.step_s + load.num_running * load.costs.decode_row_s
        rate = max(1, load.num_running) / (config.typical_decode_steps * step)
    freed = load.blocks_per_finish or config.typical_decode_steps / config.block_size
    # Whole finishes: the first one is 1/rate away however many blocks it frees.
    return max(math.ceil(block_deficit / max(freed, 1.0)), seq_deficit) / rate


def decode_rows_s(load: ReplicaLoad, config: RouterConfig) -> float:
    """Seconds the rows decoding beside this request add to its own decode: its expected output length
    (the replica's measured mean) times the decode rows of each step (the running, those admitted ahead
    of it, and its own), each at the replica's measured cost per row."""
    tokens = load.mean_output_tokens or config.typical_decode_steps
    return tokens * (load.num_running + load.unadmitted + 1) * load.costs.decode_row_s


def predicted_ttft_s(load: ReplicaLoad, num_prompt_tokens: int, cached_tokens: int,
                     config: RouterConfig) -> float:
    """Seconds until this prompt's first token on `load`: the wait for its admission, then the prefill
    queued ahead of it plus its own uncached part, cut into steps of the token budget left beside the
    running decodes, each step priced with the replica's measured costs (a bare step, per prefill token,
    per decode row)."""
    costs = load.costs
    uncached = max(1, num_prompt_tokens - cached_tokens)
    prefill = load.queued_prefill_tokens + uncached
    decode_rows = load.num_running
    budget = max(1, config.max_num_batched_tokens - decode_rows)
    steps = math.ceil(prefill / budget)
    wait = admission_wait_s(load, -(-uncached // config.block_size), config)
    return wait + prefill * costs.prefill_token_s + steps * (costs.step_s + decode_rows * costs.decode_row_s)


class CostRouter:
    """The replica with the least predicted TTFT (see the module docstring); ties keep affinity."""

    name = "cost"

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._affinity = _Affinity(config)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> RouteDecision:
        hashes = prompt_block_hashes(request, self.config.block_size)
        num_tokens = len(request.prompt_token_ids)
        # The engine computes at least the last prompt token: a hit never covers the whole prompt.
        max_blocks = max(0, (num_tokens - 1) // self.config.block_size)
        usable = hashes[:max_blocks]
        ttfts: dict[int, float] = {}
        decodes: dict[int, float] = {}
        cached: dict[int, int] = {}
        for load in _candidates(replicas):
            cached[load.index] = load.cached_blocks(usable) * self.config.block_size
            ttfts[load.index] = predicted_ttft_s(load, num_tokens, cached[load.index], self.config)
            if request.lora_name is not None and request.lora_name not in load.resident_adapters:
                ttfts[load.index] += self.config.adapter_load_s
            decodes[load.index] = decode_rows_s(load, self.config)
        # Its decode beside the others' is part of the request's own latency (and, where a row is dear,
        # of everyone's ITL): counted from the lightest candidate's, so the scores stay on the scale of a
        # TTFT and the tie margin with them, and weighed by `decode_weight`.
        lightest = min(decodes.values())
        weight = self.config.decode_weight
        scores = {index: ttfts[index] + weight * (decodes[index] - lightest) for index in ttfts}
        replica = self._affinity.choose(request, scores)
        return RouteDecision(replica, self.name, ttfts[replica], cached[replica], scores)


ROUTERS: dict[str, Callable[[RouterConfig], Router]] = {
    RoundRobinRouter.name: RoundRobinRouter,
    LeastLoadRouter.name: LeastLoadRouter,
    CostRouter.name: CostRouter,
}


def make_router(name: str, config: RouterConfig | None = None) -> Router:
    """The router called `name`; InvalidRequestError listing the known names."""
    factory = ROUTERS.get(name)
    if factory is None:
        raise InvalidRequestError(f"unknown router {name!r} (valid: {', '.join(ROUTERS)})", param="router")
    return factory(config or RouterConfig())


class Dispatcher:
    """A router and a load tracker together: route a request and count it where it went."""

    def __init__(self, router: Router, tracker: LoadTracker) -> None:
        self.router = router
        self.tracker = tracker

    def dispatch(self, request: RouteRequest) -> RouteDecision:
        decision = self.router.route(request, self.tracker.views())
        block_size = self.tracker.block_size
        self.tracker.on_routed(decision.replica, request.request_id, len(request.prompt_token_ids),
                               num_cached_tokens=decision.cached_tokens,
                               block_hashes=prompt_block_hashes(request, block_size), lora_name=request.lora_name)
        return decision
