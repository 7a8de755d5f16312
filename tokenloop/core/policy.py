"""Scheduling policies: in what order requests get tokens, and who is preempted when blocks run out.

The scheduler asks a policy to order its running requests and its waiting requests each step, and, when
a running request cannot get blocks, to name the victim among the running requests not yet scheduled
(the one it ranks last). `order` yields lazily, so a policy whose ranking depends on service received
(fair share) sees each `on_scheduled` before it picks the next request.

A waiting queue can hold 10^5 requests under overload, and sorting it every step would cost more than the
step. So the built-in policies also give each waiting request a `waiting_key`: a group (fair share: its
user) and a sort key that cannot change while it waits, and `pick_group` chooses which group's head comes
next; `core/waiting_queue.py` keeps the queue in that order, built once per request instead of once per step.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Protocol

from tokenloop.config import SCHEDULING_POLICIES, SchedulerConfig
from tokenloop.errors import ConfigError
from tokenloop.request import NS_PER_S, Request


class Policy(Protocol):
    """What the scheduler needs from a scheduling policy."""

    name: str

    def on_arrival(self, request: Request, now: int) -> None:
        """A request entered the scheduler."""

    def on_scheduled(self, request: Request, num_tokens: int, start: int | None = None) -> None:
        """`request` got `num_tokens` tokens this step (called before `num_computed_tokens` advances), from
        position `start` (None: `num_computed_tokens`; more: a second share of the same step)."""

    def on_finished(self, request: Request) -> None:
        """A request left the scheduler for good (finished, aborted or handed off)."""

    def charge(self, request: Request) -> float:
        """What the request's service so far has cost its account (a handoff carries it)."""
        ...

    def on_imported(self, request: Request, charge: float) -> None:
        """A request handed in from another engine, after its `on_arrival`, with its `charge` there."""

    def order(self, requests: Iterable[Request], now: int) -> Iterator[Request]:
        """The requests, best first."""
        ...

    def order_running(self, requests: Iterable[Request], now: int) -> Iterator[Request]:
        """The running requests in the order they get tokens and blocks. It must agree with `victim`: a
        request served earlier must never be the victim of one served later, or recompute can livelock."""
        ...

    def victim(self, candidates: Sequence[Request], now: int) -> Request:
        """The request to preempt among `candidates` (non-empty): the one ranked last."""
        ...


def _age_s(request: Request, now: int) -> float:
    return max(0, now - request.times.arrival) / NS_PER_S


class _RankedPolicy:
    """A policy whose ranking is a sort key per request; ties go to the earlier arrival."""

    name = "ranked"

    def __init__(self) -> None:
        # Arrival sequence numbers break ties between equal arrival timestamps deterministically.
        self._seq: dict[str, int] = {}
        self._next_seq = 0

    def _sequence(self, request: Request) -> int:
        seq = self._seq.get(request.request_id)
        if seq is None:
            seq = self._seq[request.request_id] = self._next_seq
            self._next_seq += 1
        return seq

    def key(self, request: Request, now: int) -> tuple[float, ...]:
        """The sort key: smaller ranks first."""
        raise NotImplementedError

    def _in_arrival_order(self, requests: Iterable[Request]) -> list[Request]:
        """Sorted by (arrival, arrival sequence): FCFS's key. The running queue is sorted so every step, so
        the sequence numbers are read from their dict in the sort key, not through a method call each."""
        requests = list(requests)
        seq = self._seq

        def key(request: Request) -> tuple[int, int]:
            return request.times.arrival, seq[request.request_id]

        try:
            return sorted(requests, key=key)
        except KeyError:  # one that never arrived here (rare): numbered now, in the order given
            for request in requests:
                if request.request_id not in seq:
                    self._sequence(request)
            return sorted(requests, key=key)

    def on_arrival(self, request: Request, now: int) -> None:
        self._sequence(request)

    def on_scheduled(self, request: Request, num_tokens: int, start: int | None = None) -> None:
        pass

    def on_finished(self, request: Request) -> None:
        self._seq.pop(request.request_id, None)

    def charge(self, request: Request) -> float:
        """What the request's service so far has cost its account (carried by a handoff)."""
        return 0.0

    def on_imported(self, request: Request, charge: float) -> None:
        """A request handed in from another engine, after its `on_arrival`, with its `charge` there."""

    def order(self, requests: Iterable[Request], now: int) -> Iterator[Request]:
        return iter(sorted(requests, key=lambda request: self.key(request, now)))

    def pick_group(self, heads: dict[Hashable, Request]) -> Hashable:
        """Which group's head goes next (one group here: every request is in it)."""
        return next(iter(heads))

    @property
    def waiting_keys_exact(self) -> bool:
        return True

    def order_running(self, requests: Iterable[Request], now: int) -> Iterator[Request]:
        return self.order(requests, now)  # the victim is the one ranked last: the two agree

    def victim(self, candidates: Sequence[Request], now: int) -> Request:
        if not candidates:
            raise ValueError("no candidate to preempt")
        return max(candidates, key=lambda request: self.key(request, now))


class FCFSPolicy(_RankedPolicy):
    """First come, first served; the latest arrival is preempted first."""

    name = "fcfs"

    def key(self, request: Request, now: int) -> tuple[float, ...]:
        return (request.times.arrival, self._sequence(request))

    def order(self, requests: Iterable[Request], now: int) -> Iterator[Request]:
        return iter(self._in_arrival_order(requests))  # by `key`, a cheaper way

    def waiting_key(self, request: Request) -> tuple[Hashable, tuple[float, ...]]:
        """(group, sort key) of a waiting request, fixed while it waits: its `key`, in one group."""
        return None, self.key(request, 0)


class PriorityPolicy(_RankedPolicy):
    """Lower `request.priority` first, ties by arrival; the lowest-ranked running request is the victim.

    Effective priority = priority - aging rate x age, so a request waiting long enough outranks any
    later arrival and nothing starves. Age counts from arrival, so the ranking of two requests never
    flips back and forth (their effective priorities drift at the same rate).
    """

    name = "priority"

    def __init__(self, aging_per_s: float = 0.0) -> None:
        super().__init__()
        self.aging_per_s = aging_per_s

    def effective_priority(self, request: Request, now: int) -> float:
        return request.priority - self.aging_per_s * _age_s(request, now)

    def key(self, request: Request, now: int) -> tuple[float, ...]:
        return (self.effective_priority(request, now), request.times.arrival, self._sequence(request))

    @property
    def waiting_keys_exact(self) -> bool:
        return self.aging_per_s == 0

    def waiting_key(self, request: Request) -> tuple[Hashable, tuple[float, ...]]:
        # Everyone ages at the same rate, so the effective priority at arrival + rate x arrival (s) orders
        # as the effective priority does at any instant after the arrivals: a key computed once.
        arrival = request.times.arrival
        aged = self.effective_priority(request, arrival) + self.aging_per_s * arrival / NS_PER_S
        return None, (aged, request.times.arrival, self._sequence(request))


class ShortestJobPolicy(_RankedPolicy):
    """Least remaining work first, aged so long jobs do not starve.

    Remaining work = tokens still to compute (prompt, or everything again after a preemption) + output
    tokens still allowed by max_tokens (or by max_model_len when max_tokens is None). Effective work =
    remaining work - aging rate x age.
    """

    name = "sjf"

    def __init__(self, aging_tokens_per_s: float = 0.0, max_model_len: int | None = None) -> None:
        super().__init__()
        self.aging_tokens_per_s = aging_tokens_per_s
        self.max_model_len = max_model_len

    def remaining_work(self, request: Request) -> int:
        to_compute = request.num_tokens - request.num_computed_tokens
        max_tokens = request.sampling_params.max_tokens
        to_generate = 0 if max_tokens is None else max_tokens - request.num_output_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - request.num_tokens
            to_generate = room if max_tokens is None else min(to_generate, room)
        return to_compute + max(0, to_generate)

    def key(self, request: Request, now: int) -> tuple[float, ...]:
        effective = self.remaining_work(request) - self.aging_tokens_per_s * _age_s(request, now)
        return (effective, request.times.arrival, self._sequence(request))

    @property
    def waiting_keys_exact(self) -> bool:
        return self.aging_tokens_per_s == 0

    def waiting_key(self, request: Request) -> tuple[Hashable, tuple[float, ...]]:
        # A waiting request's remaining work stands still, and aging moves everyone alike (as priority's).
        aged = self.remaining_work(request) + self.aging_tokens_per_s * request.times.arrival / NS_PER_S
        return None, (aged, request.times.arrival, self._sequence(request))


class FairSharePolicy(_RankedPolicy):
    """Virtual token counters per user (VTC, Sheng et al., "Fairness in Serving Large Language Models").

    Each user's counter grows by `prompt_weight` per prompt token computed and `output_weight` per token
    sampled. Requests of the user with the smallest counter go first (each user's own in arrival order).
    A user who becomes active after idling is lifted to the smallest counter among active users, so
    idling earns no credit.

    Counters are state keyed by what clients send, so they are bounded: an idle user (no unfinished
    request) whose counter is at or below the floor (the smallest active counter, which never decreases)
    would be lifted to the floor on return anyway and is forgotten, exactly; of the others, at most
    `max_idle_users` are kept, and past it the longest idle is forgotten (its excess service forgiven).

    The preemption victim is the latest arrival, and running requests are served in arrival order, as
    in FCFS: fairness acts on admission order (as in VTC). A counter-based victim flips as counters grow,
    and under recompute preemption two requests can then throw each other's work away forever (a livelock
    hypothesis found with a 6-block pool).
    """

    name = "fair"
    _ANONYMOUS = ""  # requests without `user` share one account

    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0,
                 max_idle_users: int = 4096) -> None:
        super().__init__()
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.max_idle_users = max_idle_users
        self.counters: dict[str, float] = {}
        self._active: dict[str, int] = {}  # user -> number of unfinished requests
        self._idle: OrderedDict[str, None] = OrderedDict()  # users with a counter and none active, oldest first
        self._left_since_sweep = 0
        self._last_left_counter = 0.0  # counter of the last user who went idle, the floor when none is active

    def _floor(self) -> float:
        """What a returning user is lifted to: the smallest active counter (never decreases)."""
        if not self._active:
            return self._last_left_counter
        return min(self.counters.get(other, 0.0) for other in self._active)

    def _forget_idle(self) -> None:
        """Drop idle users the floor has passed (a sweep every so many departures: O(1) amortized), then
        the longest idle past `max_idle_users`."""
        self._left_since_sweep += 1
        if self._left_since_sweep >= max(64, len(self._idle) // 2):
            self._left_since_sweep = 0
            floor = self._floor()
            for user in [u for u in self._idle if self.counters.get(u, 0.0) <= floor]:
                del self._idle[user]
                self.counters.pop(user, None)
        while len(self._idle) > self.max_idle_users:
            user, _ = self._idle.popitem(last=False)
            self.counters.pop(user, None)

    def _user(self, request: Request) -> str:
        return request.user if request.user is not None else self._ANONYMOUS

    def counter(self, user: str | None) -> float:
        return self.counters.get(user if user is not None else self._ANONYMOUS, 0.0)

    def on_arrival(self, request: Request, now: int) -> None:
        super().on_arrival(request, now)
        user = self._user(request)
        if self._active.get(user, 0) == 0:
            self._idle.pop(user, None)
            self.counters[user] = max(self.counters.get(user, 0.0), self._floor())
        self._active[user] = self._active.get(user, 0) + 1

    def on_finished(self, request: Request) -> None:
        if request.request_id not in self._seq:
            return  # never arrived here, or already finished
        super().on_finished(request)
        user = self._user(request)
        left = self._active.get(user, 0) - 1
        if left > 0:
            self._active[user] = left
        else:
            self._active.pop(user, None)
            self._last_left_counter = self.counters.get(user, 0.0)
            self._idle[user] = None
            self._forget_idle()

    def on_scheduled(self, request: Request, num_tokens: int, start: int | None = None) -> None:
        if start is None:
            start = request.num_computed_tokens
        prompt_tokens = max(0, min(start + num_tokens, request.num_prompt_tokens) - start)
        samples = start + num_tokens >= request.num_tokens
        user = self._user(request)
        self.counters[user] = (self.counters.get(user, 0.0) + self.prompt_weight * prompt_tokens
                               + (self.output_weight if samples else 0.0))

    def key(self, request: Request, now: int) -> tuple[float, ...]:
        return (self.counter(request.user), request.times.arrival, self._sequence(request))

    def charge(self, request: Request) -> float:
        prompt_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        return self.prompt_weight * prompt_tokens + self.output_weight * request.num_output_tokens

    def on_imported(self, request: Request, charge: float) -> None:
        # The user keeps paying here for what it was served there: a move must not reset its account.
        user = self._user(request)
        self.counters[user] = self.counters.get(user, 0.0) + charge

    def victim(self, candidates: Sequence[Request], now: int) -> Request:
        if not candidates:
            raise ValueError("no candidate to preempt")
        return max(candidates, key=lambda request: (request.times.arrival, self._sequence(request)))

    def order_running(self, requests: Iterable[Request], now: int) -> Iterator[Request]:
        # Arrival order, like the victim: served by counter, a later arrival could take the last blocks
        # and make an earlier one preempt itself, at every step, forever (hypothesis found it).
        return iter(self._in_arrival_order(requests))

    def waiting_key(self, request: Request) -> tuple[Hashable, tuple[float, ...]]:
        return self._user(request), (request.times.arrival, self._sequence(request))

    def pick_group(self, heads: dict[Hashable, Request]) -> Hashable:
        # As `order`: the least-served user, then the earliest head.
        def rank(user: Hashable) -> tuple[float, int, int]:
            head = heads[user]
            return self.counters.get(user, 0.0), head.times.arrival, self._sequence(head)  # type: ignore[call-overload]

        return min(heads, key=rank)

    def order(self, requests: Iterable[Request], now: int) -> Iterator[Request]:
        # Re-pick the least-served user before every yield: counters move as the caller schedules.
        queues: dict[str, deque[Request]] = {}
        for request in sorted(requests, key=lambda r: (r.times.arrival, self._sequence(r))):
            queues.setdefault(self._user(request), deque()).append(request)
        while queues:
            user = min(queues, key=lambda u: (self.counters.get(u, 0.0), queues[u][0].times.arrival,
                                              self._sequence(queues[u][0])))
            queue = queues[user]
            request = queue.popleft()
            if not queue:
                del queues[user]
            yield request


def make_policy(name: str, config: SchedulerConfig | None = None, *,
                max_model_len: int | None = None) -> Policy:
    """Build the policy called `name` with its settings from `config` (defaults when None)."""
    config = config if config is not None else SchedulerConfig()
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy(config.priority_aging_per_s)
    if name == "sjf":
        return ShortestJobPolicy(config.sjf_aging_tokens_per_s, max_model_len)
    if name == "fair":
        return FairSharePolicy(config.fair_prompt_token_weight, config.fair_output_token_weight,
                               config.fair_max_idle_users)
    raise ConfigError(f"unknown scheduling policy {name!r} (valid: {', '.join(SCHEDULING_POLICIES)})")
