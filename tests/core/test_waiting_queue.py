"""WaitingQueue against the straightforward reference: the policy's `order` over the same requests, sorted
at that instant. Arrivals on a grid of tenths of seconds with integer priorities make exact ties of the aged
keys (a priority 1 request 0.5 s before a priority 0 one at 2 levels per second), where the two forms round
apart (tenths are not binary fractions)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloop.config import SchedulerConfig
from tokenloop.core.kv_cache import KVCacheManager
from tokenloop.core.policy import (
    FairSharePolicy,
    FCFSPolicy,
    PriorityPolicy,
    ShortestJobPolicy,
)
from tokenloop.core.scheduler import Scheduler
from tokenloop.core.waiting_queue import WaitingQueue
from tokenloop.request import NS_PER_S, Request, RequestStatus, SamplingParams

POLICIES = {
    "fcfs": FCFSPolicy,
    "priority": lambda: PriorityPolicy(2.0),
    "priority-unaged": lambda: PriorityPolicy(0.0),
    "sjf": lambda: ShortestJobPolicy(50.0, max_model_len=400),
    "sjf-unaged": lambda: ShortestJobPolicy(0.0, max_model_len=400),
    "fair": FairSharePolicy,
}

request_specs = st.lists(st.tuples(
    st.integers(0, 40),  # arrival, in tenths of seconds from t0
    st.integers(-2, 3),  # priority
    st.integers(1, 80),  # prompt length
    st.sampled_from([1, 25, 50, 100, None]),  # max_tokens
    st.sampled_from(["ann", "bob", None]),  # user
    st.booleans(),  # leaves the queue before it is read
), min_size=0, max_size=40)

T0 = 1_234_567_891_011  # a monotonic clock's stamps are large: rounding is coarser there
TENTH = NS_PER_S // 10


def make_request(i: int, arrival_q: int, priority: int, prompt_len: int, max_tokens: int | None,
                 user: str | None) -> Request:
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   T0 + arrival_q * TENTH, priority=priority, user=user)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), specs=request_specs, later_ns=st.integers(4 * NS_PER_S, 40 * NS_PER_S),
       counters=st.lists(st.floats(0, 100, allow_nan=False), min_size=3, max_size=3))
def test_the_queue_orders_as_the_policy_sorts(name: str, specs: list, later_ns: int, counters: list[float]) -> None:
    policy = POLICIES[name]()
    queue = WaitingQueue(policy)
    live = []
    for i, (arrival_q, priority, prompt_len, max_tokens, user, leaves) in enumerate(specs):
        request = make_request(i, arrival_q, priority, prompt_len, max_tokens, user)
        policy.on_arrival(request, request.times.arrival)
        queue.add(request)
        if leaves:
            queue.remove(request.request_id)
        else:
            live.append(request)
    if isinstance(policy, FairSharePolicy):
        policy.counters.update(zip(["ann", "bob", ""], counters))
    now = T0 + later_ns  # any nanosecond: the aged keys round differently at each
    assert [r.request_id for r in queue.ordered(now)] == [r.request_id for r in policy.order(live, now)]
    assert len(queue) == len(live)


def test_exact_ties_of_the_aged_keys_go_as_the_policy_sorts_them() -> None:
    # Seeded rather than drawn: the ties that round apart need a "now" at an odd nanosecond, which
    # hypothesis rarely draws (about one queue in eight of these disagrees when near-ties are not re-ranked).
    rng = random.Random(0)
    for trial in range(300):
        policy = PriorityPolicy(2.0) if trial % 2 else ShortestJobPolicy(10.0, max_model_len=400)
        queue = WaitingQueue(policy)
        live = []
        for i in range(30):
            request = make_request(i, rng.randrange(0, 41), rng.randrange(-2, 4), rng.choice((1, 6)),
                                   rng.choice((5, 10)), None)
            policy.on_arrival(request, 0)
            queue.add(request)
            live.append(request)
        now = T0 + rng.randrange(4 * NS_PER_S, 40 * NS_PER_S)
        assert list(queue.ordered(now)) == list(policy.order(live, now)), trial


def test_a_request_removed_while_the_queue_is_read_is_skipped() -> None:
    policy = FCFSPolicy()
    queue = WaitingQueue(policy)
    requests = [make_request(i, i, 0, 4, 8, None) for i in range(5)]
    for request in requests:
        policy.on_arrival(request, 0)
        queue.add(request)
    seen = []
    for request in queue.ordered(T0 * 2):
        seen.append(request.request_id)
        queue.remove(request.request_id)  # admitted
        queue.remove("r3")  # failed while r0 was being admitted
    assert seen == ["r0", "r1", "r2", "r4"]
    assert len(queue) == 0 and list(queue.ordered(T0 * 2)) == []


def test_arrivals_stamped_after_now_fall_back_to_the_policy_sort() -> None:
    # The aged key clips a future arrival's age to 0; the once-computed key cannot know `now`.
    policy = PriorityPolicy(1.0)
    queue = WaitingQueue(policy)
    early = make_request(0, 0, 1, 4, 8, None)
    future = make_request(1, 40, 0, 4, 8, None)  # 4 s after t0
    for request in (early, future):
        policy.on_arrival(request, 0)
        queue.add(request)
    for now_q in (4, 8, 40, 60):  # tenths  # before and after the future stamp
        now = T0 + now_q * TENTH
        assert list(queue.ordered(now)) == list(policy.order([early, future], now))


def test_a_long_queue_keeps_its_order_through_admissions_and_preemptions() -> None:
    policy = ShortestJobPolicy(50.0, max_model_len=400)
    queue = WaitingQueue(policy)
    live: dict[str, Request] = {}
    for i in range(600):
        request = make_request(i, i % 97, 0, 1 + (i * 37) % 80, (i * 11) % 100 + 1, None)
        policy.on_arrival(request, 0)
        queue.add(request)
        live[request.request_id] = request
        if i % 3 == 0:  # admit the best two, as a step would
            for best in list(queue.ordered(T0 + 30 * NS_PER_S))[:2]:
                queue.remove(best.request_id)
                del live[best.request_id]
    now = T0 + 40 * NS_PER_S
    assert list(queue.ordered(now)) == list(policy.order(live.values(), now))


# ---- in the scheduler --------------------------------------------------------------------------------

def _scheduler(policy: object) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
    return Scheduler(config, KVCacheManager(32, 4), 128, clock=lambda: T0 + 10 * NS_PER_S,
                     policy=policy)  # type: ignore[arg-type]


class _NoWaitingKey:
    """A policy with only the Protocol's methods: the scheduler sorts its queue every step."""

    def __init__(self, policy: PriorityPolicy) -> None:
        self._policy = policy
        self.name = policy.name

    def __getattr__(self, name: str) -> object:
        if name in ("waiting_key", "pick_group", "waiting_keys_exact"):
            raise AttributeError(name)
        return getattr(self._policy, name)


def test_a_policy_without_waiting_keys_schedules_the_same() -> None:
    admitted = []
    for policy in (PriorityPolicy(2.0), _NoWaitingKey(PriorityPolicy(2.0))):
        scheduler = _scheduler(policy)
        for i in range(8):
            scheduler.add_request(make_request(i, (i * 7) % 10, i % 3, 4, 2, None))
        order = []
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            scheduler.update_from_output(out)
            for item in out.scheduled:
                if item.admitted:
                    order.append(item.request_id)
                scheduler.finish_request(item.request_id, RequestStatus.FINISHED_LENGTH)
        admitted.append(order)
    assert admitted[0] == admitted[1] and len(admitted[0]) == 8


def test_a_request_whose_waiting_key_raises_fails_alone() -> None:
    policy = PriorityPolicy(1.0)
    original = policy.effective_priority

    def effective_priority(request: Request, now: int) -> float:
        if request.priority == 777:
            raise OverflowError("a priority too large to rank")
        return original(request, now)

    policy.effective_priority = effective_priority  # type: ignore[method-assign]
    scheduler = _scheduler(policy)
    good = make_request(0, 0, 0, 4, 2, None)
    bad = make_request(1, 1, 777, 4, 2, None)
    scheduler.add_request(good)
    scheduler.add_request(bad)
    out = scheduler.schedule()
    assert [item.request_id for item in out.scheduled] == ["r0"]
    assert out.failed == [bad] and bad.status is RequestStatus.FINISHED_ERROR
    assert bad.error == "the server failed while ranking this request"
    assert scheduler.num_waiting == 0
