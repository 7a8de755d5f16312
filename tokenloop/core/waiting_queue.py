"""The waiting queue in a policy's order, kept as requests come and go instead of sorted every step.

A waiting queue can hold 10^5 requests under overload. A policy that can rank a waiting request once
(`RanksWaiting`: every built-in one) gives it a `waiting_key` (a group and a key fixed while it waits);
`WaitingQueue` keeps each group sorted and merges the groups by the policy's `pick_group`, so the scheduler's
admission pass reads the policy's order without a sort. The policies themselves live in `core/policy.py`.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Hashable, Iterable, Iterator
from typing import Protocol

from tokenloop.request import Request

# Waiting keys of aged policies are computed in another form than `key` (see PriorityPolicy.waiting_key):
# mathematically the same order, but rounding can split or join near-ties differently. Entries whose
# first key parts are closer than this (relative: thousands of roundings) are re-ranked by `key`.
WAITING_KEY_SLACK = 1e-12


class RanksWaiting(Protocol):
    """A policy that can rank waiting requests once each (`waiting_key`) instead of once per step."""

    def waiting_key(self, request: Request) -> tuple[Hashable, tuple[float, ...]]: ...

    def pick_group(self, heads: dict[Hashable, Request]) -> Hashable: ...

    @property
    def waiting_keys_exact(self) -> bool:
        """False when `waiting_key` orders as `key` does only up to rounding (see WAITING_KEY_SLACK)."""
        ...

    def key(self, request: Request, now: int) -> tuple[float, ...]: ...

    def order(self, requests: Iterable[Request], now: int) -> Iterator[Request]: ...


class WaitingQueue:
    """Waiting requests in a policy's order, kept sorted per group as they come and go.

    Each group is a list of [key, request] entries sorted by key (keys end in the arrival sequence, so no
    two are equal). A request that leaves turns its entry into a tombstone (request None): removal is O(1)
    and safe while `ordered` is being iterated. Admissions leave tombstones at the front, which the next
    `ordered` cuts off; a group is rebuilt only once tombstones are half of it, so upkeep stays O(1) per
    request on average. Nothing may be added while `ordered` is being iterated.

    The order is exactly the policy's `order` at that instant: near-ties are re-ranked by `key` (see
    WAITING_KEY_SLACK), and while some request's arrival lies after `now` (a stamp from another clock,
    whose age `key` clips to 0) the queue is sorted by `order` as a whole.
    """

    def __init__(self, policy: RanksWaiting) -> None:
        self.policy = policy
        self._exact = policy.waiting_keys_exact
        self._groups: dict[Hashable, list[list]] = {}
        self._tombstones: dict[Hashable, int] = {}
        self._entries: dict[str, tuple[Hashable, list]] = {}  # request id -> (group, its entry)
        self._latest_arrival = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def add(self, request: Request) -> None:
        """Rank and insert a request (raises what the policy's `waiting_key` raises, changing nothing)."""
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already in the waiting queue")
        group, key = self.policy.waiting_key(request)
        entry = [key, request]
        if group not in self._groups:
            self._groups[group], self._tombstones[group] = [], 0
        insort(self._groups[group], entry, key=lambda e: e[0])
        self._entries[request.request_id] = (group, entry)
        self._latest_arrival = max(self._latest_arrival, request.times.arrival)

    def remove(self, request_id: str) -> None:
        """Take a request out (no-op when it is not here)."""
        found = self._entries.pop(request_id, None)
        if found is not None:
            group, entry = found
            entry[1] = None
            self._tombstones[group] += 1

    def ordered(self, now: int) -> Iterator[Request]:
        """The requests, best first, lazily; a request removed while this runs is skipped."""
        self._drop_tombstones()
        if self._latest_arrival > now:
            live = [entry[1] for entries in self._groups.values() for entry in entries if entry[1] is not None]
            yield from (r for r in self.policy.order(live, now) if r.request_id in self._entries)
            return
        if len(self._groups) == 1:
            (entries,) = self._groups.values()
            yield from self._group_order(entries, now)
            return
        # Merge the groups: the policy picks whose head goes next, before every yield.
        heads: dict[Hashable, Request] = {}
        orders = {group: self._group_order(entries, now) for group, entries in self._groups.items()}
        for group, order in orders.items():
            head = next(order, None)
            if head is not None:
                heads[group] = head
        while heads:
            group = self.policy.pick_group(heads) if len(heads) > 1 else next(iter(heads))
            yield heads[group]
            head = next(orders[group], None)
            if head is None:
                del heads[group]
            else:
                heads[group] = head

    def _group_order(self, entries: list[list], now: int) -> Iterator[Request]:
        if self._exact:
            for entry in entries:
                if entry[1] is not None:  # it may have left since this began
                    yield entry[1]
            return
        key = self.policy.key
        i, n = 0, len(entries)
        while i < n:
            # A run of near-ties (almost always one entry) goes out in `key` order.
            j = i + 1
            while j < n and _near(entries[j - 1][0][0], entries[j][0][0]):
                j += 1
            run = [entry[1] for entry in entries[i:j] if entry[1] is not None]
            if len(run) > 1:
                run.sort(key=lambda request: key(request, now))
            for request in run:
                if request.request_id in self._entries:  # it may have left since the run was cut
                    yield request
            i = j

    def _drop_tombstones(self) -> None:
        for group in [g for g, n in self._tombstones.items() if n]:
            entries = self._groups[group]
            front = 0
            while front < len(entries) and entries[front][1] is None:
                front += 1
            del entries[:front]
            left = self._tombstones[group] - front
            if left * 2 > len(entries):
                entries[:] = [entry for entry in entries if entry[1] is not None]
                left = 0
            self._tombstones[group] = left
            if not entries:
                del self._groups[group], self._tombstones[group]


def _near(a: float, b: float) -> bool:
    return b - a <= WAITING_KEY_SLACK * (1.0 + abs(a))
