"""Fault isolation for the execute and sample stages: what raises for one request fails that request alone.

A forward that raises is bisected to find the requests it fails for; the others run again without them
(safe: a forward writes only the K/V of its own slots, and writes the same values again). A sampling call
that raises is retried row by row. The caller fails the culprits; nothing here touches request state.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from tokenloop.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenloop.logprobs import TokenLogprobs
from tokenloop.request import Request
from tokenloop.runner import ModelRunner, RunnerOutput
from tokenloop.sampler import Sampler, SamplingBatch

logger = logging.getLogger(__name__)

Failure = tuple[Request, str, BaseException]  # the request, the stage it failed in, the cause
Sampled = tuple[Request, int, TokenLogprobs | None]


def execute_isolated(runner: ModelRunner, schedule: SchedulerOutput,
                     ) -> tuple[SchedulerOutput, RunnerOutput | None, list[Failure]]:
    """One forward over the batch; on an error, the batch of the survivors, their result, and the failures."""
    try:
        return schedule, runner.execute(schedule), []
    except Exception as exc:  # isolate below
        logger.exception("model forward failed for a batch of %d request(s)", len(schedule.scheduled))
        first_error = exc
    items = schedule.scheduled
    middle = len(items) // 2
    failing = (_failing_items(runner, schedule, items[:middle]) + _failing_items(runner, schedule, items[middle:])
               if len(items) > 1 else [(items[0], first_error)])
    stage = "running the model on"
    failures: list[Failure] = [(item.request, stage, cause) for item, cause in failing]
    failed = {id(item) for item, _ in failing}
    survivors = [item for item in items if id(item) not in failed]
    if not survivors:
        return schedule, None, failures
    rest = _sub_schedule(schedule, survivors)
    try:
        return rest, runner.execute(rest), failures
    except Exception as exc:  # fails only together: give up on all of them
        logger.exception("model forward failed again for the remaining batch")
        return rest, None, failures + [(item.request, stage, exc) for item in survivors]


def _failing_items(runner: ModelRunner, schedule: SchedulerOutput, items: list[ScheduledRequest],
                   ) -> list[tuple[ScheduledRequest, BaseException]]:
    """The items whose forward fails, by bisection: one culprit in B costs ~2 log2(B) smaller forwards."""
    if not items:
        return []
    try:
        runner.execute(_sub_schedule(schedule, items))
        return []
    except Exception as exc:  # narrowed down below
        if len(items) == 1:
            logger.exception("model forward failed for request %s", items[0].request_id)
            return [(items[0], exc)]
    middle = len(items) // 2
    return _failing_items(runner, schedule, items[:middle]) + _failing_items(runner, schedule, items[middle:])


def _sub_schedule(schedule: SchedulerOutput, items: list[ScheduledRequest]) -> SchedulerOutput:
    return dataclasses.replace(schedule, scheduled=items, num_batched_tokens=sum(i.num_tokens for i in items))


def sample_isolated(sampler: Sampler, logits: torch.Tensor, requests: list[Request], vocab_size: int,
                    ) -> tuple[list[Sampled], list[Failure]]:
    """Sample every row at once; if that raises, row by row, failing only the rows that raise."""
    try:
        out = sampler.sample(logits, SamplingBatch.from_requests(requests, vocab_size))
        return list(zip(requests, out.token_ids, out.logprobs)), []
    except Exception:  # isolate below
        logger.exception("sampling failed for a batch of %d request(s)", len(requests))
    sampled: list[Sampled] = []
    failures: list[Failure] = []
    for row, request in enumerate(requests):
        try:
            out = sampler.sample(logits[row:row + 1], [request])
        except Exception as exc:  # this row's sampling fails: it ends with an error
            logger.exception("sampling failed for request %s", request.request_id)
            failures.append((request, "sampling", exc))
            continue
        sampled.append((request, out.token_ids[0], out.logprobs[0]))
    return sampled, failures
