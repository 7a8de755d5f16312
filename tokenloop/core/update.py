"""The update stage of a step: sampled tokens become the requests' progress, and some requests end.

Each sampled token is appended and stamped, then the core's stop checks run in vLLM's order (EOS, a
complete grammar, a stop token id, the length); a speculative row first keeps the drafts the model agrees
with (`accept_greedy`) and appends them one by one under the same checks, so it stops exactly where plain
decoding would. A request whose execution, sampling or update failed ends with an error, alone. What
the step produced for each request collects in `pending`, one `CoreOutput` per request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tokenloop.core.isolation import Failure, Sampled
from tokenloop.core.messages import CoreOutput
from tokenloop.core.scheduler import Scheduler
from tokenloop.core.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenloop.core.speculative import accept_greedy
from tokenloop.errors import InvalidRequestError
from tokenloop.logprobs import TokenLogprobs
from tokenloop.request import Clock, Request, RequestStatus
from tokenloop.runner import RunnerOutput
from tokenloop.structured.engine_hooks import StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass
class StepUpdate:
    """What the update stage did: the tokens it appended (in a speculative step, the accepted ones) and
    how many drafts were accepted."""

    appended: list[Sampled] = field(default_factory=list)
    num_accepted: int = 0


def new_output(request: Request, token_ids: list[int]) -> CoreOutput:
    """A request's output of this step, with its counters now (the update stage never changes them)."""
    # Positional (no logprobs, no finish yet, then the counters): keywords cost twice the call, once a row a step.
    return CoreOutput(request.request_id, token_ids, None, None, None, None, None,
                      request.times.first_scheduled, request.num_cached_tokens, request.num_preemptions)


def touch(pending: dict[str, CoreOutput], request: Request) -> CoreOutput:
    """The request's output of this step, made empty if it has none yet."""
    output = pending.get(request.request_id)
    if output is None:
        output = pending[request.request_id] = new_output(request, [])
    return output


class Updater:
    """The update stage of one engine core: `update` once a step, after sampling."""

    def __init__(self, scheduler: Scheduler, structured: StructuredOutputs, max_model_len: int,
                 clock: Clock) -> None:
        self.scheduler = scheduler
        self.structured = structured
        self.max_model_len = max_model_len
        self.clock = clock

    def update(self, schedule: SchedulerOutput, result: RunnerOutput | None, sampled: list[Sampled],
               failures: list[Failure], pending: dict[str, CoreOutput], now: int) -> StepUpdate:
        """Append `sampled` (stamped `now`) with the stop checks, or verify a speculative step's drafts;
        then end every request in `failures` (and those the update itself failed) with an error."""
        if result is not None and schedule.num_draft_tokens > 0:
            update = self._verify([schedule.scheduled[i] for i in result.sample_indices], sampled, failures,
                                  now, pending)
        else:
            update = StepUpdate(sampled)
            for request, token, logprobs in sampled:
                try:
                    status = self._append(request, token, logprobs, now, pending)
                    if status is not None:
                        self.finish(request, status, now)
                except Exception as exc:  # noqa: BLE001 - one request's failure must not take the others down
                    _log_update_failure(request, exc)
                    failures.append((request, "updating", exc))
        for request, stage, cause in failures:
            self._fail_request(request, stage, cause)
        for request in [*schedule.failed, *(f[0] for f in failures)]:  # they end now, alone
            touch(pending, request)
        return update

    def finish(self, request: Request, status: RequestStatus, now: int) -> None:
        """End a request its update stopped (the stamp of the step's tokens is its end)."""
        request.times.finished = now
        self.scheduler.finish_request(request.request_id, status)

    def _verify(self, items: list[ScheduledRequest], sampled: list[Sampled], failures: list[Failure], now: int,
                pending: dict[str, CoreOutput]) -> StepUpdate:
        """A speculative step's update: per sampling row, the model's tokens after its real token and each
        draft; keep the drafts it agrees with plus its next token, appending them one by one with the stop
        checks, so a request stops exactly where plain decoding would."""
        rows: dict[str, list[tuple[int, TokenLogprobs | None]]] = {}
        for request, token, logprobs in sampled:
            rows.setdefault(request.request_id, []).append((token, logprobs))
        failed = {request.request_id for request, _, _ in failures}
        update = StepUpdate()
        for item in items:
            request = item.request
            targets = rows.get(request.request_id)
            if targets is None or request.request_id in failed:
                continue
            accepted = accept_greedy(item.draft_token_ids, [token for token, _ in targets])
            update.num_accepted += accepted
            try:
                status, num_appended = None, 0
                for token, logprobs in targets[:accepted + 1]:
                    status = self._append(request, token, logprobs, now, pending)
                    update.appended.append((request, token, logprobs))
                    num_appended += 1
                    if status is not None:
                        break
                if item.draft_token_ids:  # every appended token but the last was an input with its K/V computed
                    self.scheduler.accept_drafts(item, num_appended - 1)
                if status is not None:
                    self.finish(request, status, now)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not take the others down
                _log_update_failure(request, exc)
                failures.append((request, "updating", exc))
        return update

    def _append(self, request: Request, token: int, logprobs: TokenLogprobs | None, now: int,
                pending: dict[str, CoreOutput]) -> RequestStatus | None:
        """Append one token, stamp it, and run the core's stop checks in vLLM's order; the status it ends the
        request with, if any."""
        params = request.sampling_params
        request.append_output_token(token)
        request.times.record_token(now)
        output = pending.get(request.request_id)
        if output is None:
            output = pending[request.request_id] = new_output(request, [token])
        else:
            output.new_token_ids.append(token)
        if params.logprobs is not None and logprobs is not None:
            if output.new_logprobs is None:
                output.new_logprobs = []
            output.new_logprobs.append(logprobs)
        if request.structured is not None:  # (a call per token saved for the unconstrained rest)
            self.structured.accept(request, token)  # raises if the grammar refuses it: fails this request only
        num_output_tokens = len(request.output_token_ids)
        can_stop = num_output_tokens >= params.min_tokens
        status: RequestStatus | None = None
        if can_stop and not params.ignore_eos and token in request.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif request.structured is not None and request.structured.is_terminated:  # the grammar is complete
            status = RequestStatus.FINISHED_STOPPED
        elif can_stop and token in (params.stop_token_ids or ()):
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif num_output_tokens >= (params.max_tokens or self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        elif len(request.all_token_ids) >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        return status

    def _fail_request(self, request: Request, stage: str, cause: BaseException) -> None:
        if isinstance(cause, InvalidRequestError):  # the request's own content: the client is told why
            request.error, request.error_param = str(cause), cause.param
        else:  # the exception is this request's own (isolated): its text may help an offline caller
            detail = f" ({type(cause).__name__}: {str(cause)[:200]})" if cause is not None else ""
            request.error = f"the server failed while {stage} this request{detail}"
        if request.times.finished is None:
            request.times.finished = self.clock()
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)


def _log_update_failure(request: Request, exc: Exception) -> None:
    if isinstance(exc, InvalidRequestError):  # the request's own fault (its grammar's limits): no traceback
        logger.info("request %s failed: %s", request.request_id, exc)
    else:
        logger.exception("update of %s failed", request.request_id)
