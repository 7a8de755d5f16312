"""Scheduling policies on crafted cases: orderings, victims, aging and fair-share counters."""

from __future__ import annotations

import pytest

from tokenloop.config import SCHEDULING_POLICIES, SchedulerConfig
from tokenloop.core.policy import FairSharePolicy, FCFSPolicy, Policy, PriorityPolicy, ShortestJobPolicy, make_policy
from tokenloop.errors import ConfigError
from tokenloop.request import NS_PER_S, Request, SamplingParams

MS = 1_000_000


def req(request_id: str, arrival_ms: int = 0, *, prompt_len: int = 4, max_tokens: int | None = 8,
        priority: int = 0, user: str | None = None) -> Request:
    return Request(request_id, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens),
                   arrival_ms * MS, priority=priority, user=user)


def arrive(policy: Policy, *requests: Request) -> list[Request]:
    for request in requests:
        policy.on_arrival(request, request.times.arrival)
    return list(requests)


def ids(requests) -> list[str]:  # type: ignore[no-untyped-def]
    return [request.request_id for request in requests]


# ---- construction ----------------------------------------------------------------------------------

def test_make_policy_by_name() -> None:
    kinds = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "sjf": ShortestJobPolicy, "fair": FairSharePolicy}
    assert set(kinds) == set(SCHEDULING_POLICIES)
    for name, kind in kinds.items():
        policy = make_policy(name, SchedulerConfig(policy=name))
        assert isinstance(policy, kind) and policy.name == name


def test_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="fcfs, priority, sjf, fair"):
        make_policy("lottery", SchedulerConfig())
    with pytest.raises(ConfigError, match="lottery"):
        SchedulerConfig(policy="lottery")


@pytest.mark.parametrize("field, value", [("priority_aging_per_s", -1.0), ("sjf_aging_tokens_per_s", -0.5),
                                          ("fair_prompt_token_weight", -1.0), ("fair_output_token_weight", -2.0)])
def test_policy_settings_are_validated(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        SchedulerConfig(**{field: value})


def test_fair_weights_cannot_both_be_zero() -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig(fair_prompt_token_weight=0.0, fair_output_token_weight=0.0)


def test_settings_reach_the_policies() -> None:
    config = SchedulerConfig(priority_aging_per_s=2.0, sjf_aging_tokens_per_s=7.0,
                             fair_prompt_token_weight=3.0, fair_output_token_weight=5.0)
    priority = make_policy("priority", config)
    sjf = make_policy("sjf", config, max_model_len=99)
    fair = make_policy("fair", config)
    assert isinstance(priority, PriorityPolicy) and priority.aging_per_s == 2.0
    assert isinstance(sjf, ShortestJobPolicy) and (sjf.aging_tokens_per_s, sjf.max_model_len) == (7.0, 99)
    assert isinstance(fair, FairSharePolicy) and (fair.prompt_weight, fair.output_weight) == (3.0, 5.0)


# ---- fcfs ------------------------------------------------------------------------------------------

def test_fcfs_orders_by_arrival_and_preempts_the_latest() -> None:
    policy = FCFSPolicy()
    a, b, c = arrive(policy, req("a", 0), req("b", 5), req("c", 9))
    assert ids(policy.order([c, a, b], now=10 * MS)) == ["a", "b", "c"]
    assert policy.victim([a, c, b], now=10 * MS) is c


def test_fcfs_breaks_equal_timestamps_by_arrival_sequence() -> None:
    policy = FCFSPolicy()
    first, second = arrive(policy, req("z", 3), req("a", 3))
    assert ids(policy.order([second, first], now=3 * MS)) == ["z", "a"]
    assert policy.victim([first, second], now=3 * MS) is second


# ---- priority --------------------------------------------------------------------------------------

def test_priority_order_lower_value_first_ties_by_arrival() -> None:
    policy = PriorityPolicy(aging_per_s=0.0)
    requests = arrive(policy, req("p2", 0, priority=2), req("p0-late", 8, priority=0),
                      req("p1", 2, priority=1), req("p0", 4, priority=0), req("p-1", 9, priority=-1))
    assert ids(policy.order(requests, now=10 * MS)) == ["p-1", "p0", "p0-late", "p1", "p2"]


def test_priority_victim_is_the_lowest_priority_latest_among_ties() -> None:
    policy = PriorityPolicy(aging_per_s=0.0)
    high, low_early, low_late, mid = arrive(policy, req("high", 9, priority=0), req("low-early", 0, priority=5),
                                            req("low-late", 3, priority=5), req("mid", 1, priority=2))
    assert policy.victim([high, low_early, low_late, mid], now=10 * MS) is low_late
    assert policy.victim([high, mid, low_early], now=10 * MS) is low_early
    assert policy.victim([high, mid], now=10 * MS) is mid


def test_priority_aging_lets_an_old_request_overtake() -> None:
    policy = PriorityPolicy(aging_per_s=1.0)  # one priority level per second waited
    old_low, = arrive(policy, req("old-low", 0, priority=3))
    new_high, = arrive(policy, req("new-high", 2500, priority=0))
    # At 2.5 s: old-low has effective priority 0.5, new-high 0: still behind.
    assert ids(policy.order([old_low, new_high], now=2500 * MS)) == ["new-high", "old-low"]
    newer_high, = arrive(policy, req("newer-high", 3500, priority=0))
    # At 3.5 s: old-low -0.5, new-high -1, newer-high 0.
    assert ids(policy.order([old_low, new_high, newer_high], now=3500 * MS)) == ["new-high", "old-low", "newer-high"]
    assert policy.victim([old_low, new_high, newer_high], now=3500 * MS) is newer_high
    unaged = PriorityPolicy(aging_per_s=0.0)
    arrive(unaged, old_low, new_high, newer_high)
    assert ids(unaged.order([old_low, new_high, newer_high], now=3600 * NS_PER_S))[-1] == "old-low"


# ---- shortest job first ----------------------------------------------------------------------------

def test_sjf_orders_by_remaining_work() -> None:
    policy = ShortestJobPolicy(aging_tokens_per_s=0.0)
    long_prompt, long_output, short, mid = arrive(
        policy, req("long-prompt", 0, prompt_len=50, max_tokens=5),
        req("long-output", 1, prompt_len=4, max_tokens=100), req("short", 2, prompt_len=3, max_tokens=2),
        req("mid", 3, prompt_len=10, max_tokens=10))
    assert ids(policy.order([long_prompt, long_output, short, mid], now=5 * MS)) == \
        ["short", "mid", "long-prompt", "long-output"]
    assert policy.victim([long_prompt, short, mid], now=5 * MS) is long_prompt


def test_sjf_counts_progress_and_preemption() -> None:
    policy = ShortestJobPolicy(aging_tokens_per_s=0.0)
    request, = arrive(policy, req("r", 0, prompt_len=20, max_tokens=10))
    assert policy.remaining_work(request) == 30
    request.num_computed_tokens = 15  # chunked prefill under way
    assert policy.remaining_work(request) == 15
    request.num_computed_tokens = 20
    for token in range(4):
        request.append_output_token(token)
        request.num_computed_tokens += 1
    assert policy.remaining_work(request) == 6
    request.num_computed_tokens = 0  # preempted: everything is computed again
    assert policy.remaining_work(request) == 24 + 6


def test_sjf_without_max_tokens_uses_the_context_room() -> None:
    bounded = ShortestJobPolicy(max_model_len=100)
    request = req("r", 0, prompt_len=30, max_tokens=None)
    assert bounded.remaining_work(request) == 30 + 70
    capped = req("c", 0, prompt_len=90, max_tokens=50)
    assert bounded.remaining_work(capped) == 90 + 10


def test_sjf_aging_lets_a_long_job_overtake() -> None:
    policy = ShortestJobPolicy(aging_tokens_per_s=100.0)
    long_job, = arrive(policy, req("long", 0, prompt_len=400, max_tokens=100))
    fresh_short, = arrive(policy, req("short", 4000, prompt_len=10, max_tokens=10))
    assert ids(policy.order([long_job, fresh_short], now=4000 * MS)) == ["short", "long"]  # 100 vs 20
    later_short, = arrive(policy, req("short2", 6000, prompt_len=10, max_tokens=10))
    assert ids(policy.order([long_job, later_short], now=6000 * MS)) == ["long", "short2"]  # -100 vs 20


# ---- fair share ------------------------------------------------------------------------------------

def test_fair_alternates_between_users_with_unequal_demand() -> None:
    policy = FairSharePolicy(prompt_weight=1.0, output_weight=2.0)
    heavy = arrive(policy, *[req(f"heavy{i}", i, user="heavy") for i in range(6)])
    light = arrive(policy, *[req(f"light{i}", 10 + i, user="light") for i in range(2)])
    picked = []
    for request in policy.order(heavy + light, now=20 * MS):
        picked.append(request.request_id)
        policy.on_scheduled(request, request.num_tokens)  # the whole prompt, and a sample
    # Equal requests, so the users take turns until the light user runs out of work.
    assert picked == ["heavy0", "light0", "heavy1", "light1", "heavy2", "heavy3", "heavy4", "heavy5"]
    assert policy.counter("heavy") == 6 * (4 * 1.0 + 2.0) and policy.counter("light") == 2 * 6.0


def test_fair_counts_prompt_and_output_tokens_with_weights() -> None:
    policy = FairSharePolicy(prompt_weight=1.0, output_weight=3.0)
    request, = arrive(policy, req("r", 0, prompt_len=10, user="u"))
    policy.on_scheduled(request, 6)  # prompt chunk, no sample
    assert policy.counter("u") == 6.0
    request.num_computed_tokens = 6
    policy.on_scheduled(request, 4)  # rest of the prompt, samples
    assert policy.counter("u") == 6.0 + 4.0 + 3.0
    request.num_computed_tokens = 10
    request.append_output_token(1)
    policy.on_scheduled(request, 1)  # decode: output only
    assert policy.counter("u") == 16.0


def test_fair_lifts_a_returning_user_to_the_active_minimum() -> None:
    policy = FairSharePolicy()
    a1, b1 = arrive(policy, req("a1", 0, user="a"), req("b1", 0, user="b"))
    policy.counters.update(a=100.0, b=40.0)
    newcomer, = arrive(policy, req("c1", 1, user="c"))
    assert policy.counter("c") == 40.0  # no credit for having been away
    policy.on_finished(a1)
    policy.on_finished(b1)
    policy.on_finished(newcomer)
    policy.counters["b"] = 60.0
    returning, = arrive(policy, req("a2", 2, user="a"))
    assert policy.counter("a") == 100.0  # lifting never lowers a counter
    fresh, = arrive(policy, req("d1", 3, user="d"))
    assert policy.counter("d") == 100.0


def test_fair_idle_system_lifts_to_the_last_user_who_left() -> None:
    policy = FairSharePolicy()
    a, = arrive(policy, req("a1", 0, user="a"))
    policy.on_scheduled(a, a.num_tokens)
    policy.on_finished(a)
    b, = arrive(policy, req("b1", 5, user="b"))
    assert policy.counter("b") == policy.counter("a") > 0


def test_fair_victim_is_the_latest_arrival_whatever_the_counters() -> None:
    """Fairness acts on admission order; a victim that followed the counters could livelock."""
    policy = FairSharePolicy()
    a1, b1, a2, b2 = arrive(policy, req("a1", 0, user="a"), req("b1", 1, user="b"),
                            req("a2", 2, user="a"), req("b2", 3, user="b"))
    policy.counters.update(a=10.0, b=30.0)
    assert policy.victim([a1, b1, a2, b2], now=5 * MS) is b2
    assert policy.victim([a1, a2, b1], now=5 * MS) is a2
    assert ids(policy.order([b2, a2, b1, a1], now=5 * MS)) == ["a1", "a2", "b1", "b2"]
    policy.counters.update(a=50.0)
    assert policy.victim([a1, a2, b1], now=5 * MS) is a2


def test_fair_treats_users_without_a_name_as_one_account() -> None:
    policy = FairSharePolicy()
    x, y = arrive(policy, req("x", 0), req("y", 1))
    policy.on_scheduled(x, x.num_tokens)
    assert policy.counter(None) == policy.counter("") > 0


# ---- fair share: counters keyed by `user` are bounded ------------------------------------------------

class _RememberEveryone(FairSharePolicy):
    """The reference: fair share that never forgets an idle user."""

    def _forget_idle(self) -> None:
        pass


def test_fair_forgetting_idle_users_changes_no_counter_a_request_sees() -> None:
    """Random arrivals, service and departures of 300 users: every arriving user gets the counter it would
    get if no idle user were ever forgotten, while the map holds far fewer users than ever came."""
    import random

    rng = random.Random(34)
    pruned, reference = FairSharePolicy(max_idle_users=10**9), _RememberEveryone()
    live: list[tuple[Request, Request]] = []
    seen: set[str] = set()
    for step in range(6000):
        if live and rng.random() < 0.5:
            pair = live.pop(rng.randrange(len(live)))
            for policy, request in zip((pruned, reference), pair):
                policy.on_finished(request)
        else:
            user = f"u{rng.randrange(300)}" if rng.random() < 0.9 else f"new{step}"
            seen.add(user)
            pair = (req(f"p{step}", step, user=user), req(f"r{step}", step, user=user))
            for policy, request in zip((pruned, reference), pair):
                policy.on_arrival(request, request.times.arrival)
            assert pruned.counter(user) == reference.counter(user), f"step {step}: {user}"
            live.append(pair)
        for pair in live[:3]:
            tokens = rng.randrange(1, 8)
            for policy, request in zip((pruned, reference), pair):
                policy.on_scheduled(request, tokens)
    assert len(pruned.counters) < len(reference.counters) == len(seen)


def test_fair_keeps_at_most_max_idle_users_above_the_floor() -> None:
    """An active user with nothing served holds the floor at 0: every idle user is above it, and the
    longest idle are forgotten past the cap."""
    policy = FairSharePolicy(max_idle_users=10)
    anchor, = arrive(policy, req("anchor", 0, user="anchor"))
    for i in range(500):
        request, = arrive(policy, req(f"r{i}", i + 1, user="x" * 200 + str(i)))
        policy.on_scheduled(request, 4)
        policy.on_finished(request)
    assert len(policy.counters) <= 10 + 1
    assert policy.counter("x" * 200 + "499") > 0  # the most recent idle user is remembered
    policy.on_finished(anchor)


def test_fair_max_idle_users_is_a_scheduler_setting() -> None:
    policy = make_policy("fair", SchedulerConfig(policy="fair", fair_max_idle_users=7))
    assert isinstance(policy, FairSharePolicy) and policy.max_idle_users == 7
    with pytest.raises(ConfigError, match="fair_max_idle_users"):
        SchedulerConfig(fair_max_idle_users=-1)
