"""POST /v1/completions: prompts (text or token ids) in, completions out, whole or as SSE frames.

`CompletionsServing` checks and tokenizes the prompts off the event loop, submits one engine request
per prompt (each with `n` samples), and turns the outputs into a `CompletionResponse` (with echo and
legacy logprobs: tokens, text offsets, top logprobs) or into one chunk per delta.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response

from tokenloop.errors import RequestFailedError
from tokenloop.logprobs import TokenLogprobs
from tokenloop.request import FinishReason, SamplingParams
from tokenloop.serving.async_engine import RequestSpec, RequestStream
from tokenloop.serving.base import MIN_LOGPROB, ServingBase, _check_finish, _Prompt, _Submission, engine_failure
from tokenloop.serving.errors import api_error, invalid
from tokenloop.serving.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now_s,
    random_id,
)
from tokenloop.serving.sse import DONE_FRAME, EventStreamResponse, frame
from tokenloop.serving.validation import (
    check_context,
    check_context_lower_bound,
    check_prompt_token_ids,
    check_sampling_fields,
)

# A streamed chunk up to this size is built on the event loop (well under a millisecond); a larger one, off it.
_ON_LOOP_ENTRIES, _ON_LOOP_CHARS = 64, 65_536

# One logprob entry of a completion: a token id and its logprobs (None for a prompt token without any).
_Entry = tuple[int, TokenLogprobs | None]


class CompletionsServing(ServingBase):
    """The /v1/completions endpoint."""

    def _completion_logprobs(self, entries: Sequence[_Entry], num_top: int,
                             offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token_id, lp in entries:
            text = self.token_str(token_id)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
            top = {self.token_str(t): max(v, MIN_LOGPROB) for t, v in lp.top[:num_top]}
            top.setdefault(text, max(lp.logprob, MIN_LOGPROB))  # the sampled token is always listed
            out.top_logprobs.append(top)
        return out

    def _prepare_completion(self, req: CompletionRequest) -> tuple[SamplingParams, list[str | list[int]],
                                                                   list[list[int]]]:
        """Checks, sampling params and tokenized prompts of a completion request (runs off the loop)."""
        prompts = req.prompts()
        check_sampling_fields(req, self.edge, num_prompts=len(prompts))
        params = req.to_sampling_params()
        token_ids: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                check_context_lower_bound(self.tokenizer.min_num_tokens(len(prompt)), self.edge, param)
                ids = self.tokenizer.encode(prompt)
            else:
                ids = list(prompt)
            if not ids:
                raise invalid("the prompt is empty: at least one token is needed", param)
            check_context(len(ids), params.max_tokens, self.edge, param, "max_tokens")
            if not isinstance(prompt, str):  # after the length: a million ids are refused without a scan
                check_prompt_token_ids(ids, param, self.edge.vocab_size)
            token_ids.append(ids)
        return params, prompts, token_ids

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        lora_name = self.check_model(req.model)
        params, prompts, token_ids = await self.off_loop(self._prepare_completion, req)
        response_id = random_id("cmpl")
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        salt = req.cache_salt
        if params.prompt_logprobs is not None:
            # Prompt logprobs need the prompt's logits: a private salt keeps the prefix cache from
            # skipping them.
            salt = f"{salt or ''}\x00prompt-logprobs-{response_id}"
        specs = [RequestSpec(rid, p if isinstance(p, str) else None, params, prompt_token_ids=ids,
                             priority=req.priority, user=req.user, cache_salt=salt, lora_name=lora_name)
                 for rid, p, ids in zip(request_ids, prompts, token_ids)]
        submission = _Submission(response_id, now_s(),
                                 [_Prompt(p if isinstance(p, str) else None) for p in prompts], request_ids,
                                 params.n, lora_name or self.model_name)
        stream = await self._submit(specs)
        if req.stream:
            return EventStreamResponse(self._completion_frames(stream, submission, req, params),
                                       on_close=stream.abort)
        if not await self._collect(stream, submission, raw):
            return Response(status_code=499)  # nobody reads it; the requests are already aborted
        # Megabytes of logprobs take a while to assemble: off the event loop.
        body = await self.off_loop(self._completion_body, submission, req, params)
        return Response(body, media_type="application/json")

    def _completion_body(self, submission: _Submission, req: CompletionRequest,
                         params: SamplingParams) -> bytes:
        choices = []
        for index in sorted(submission.choices):
            choice = submission.choices[index]
            _check_finish(choice)
            prompt = submission.prompts[index // params.n]
            text = "".join(choice.text)
            entries: list[_Entry] = []
            if req.echo:
                text = self._prompt_text(prompt) + text
                if req.logprobs is not None:
                    entries.extend(self._prompt_entries(prompt))
            entries.extend((lp.token_id, lp) for lp in choice.logprobs)
            logprobs = (self._completion_logprobs(entries, req.logprobs, 0)
                        if req.logprobs is not None else None)
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                            finish_reason=choice.finish_reason))
        body = CompletionResponse(id=submission.response_id, created=submission.created,
                                  model=submission.model, choices=choices, usage=submission.usage())
        return body.model_dump_json().encode()

    def _prompt_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    @staticmethod
    def _prompt_entries(prompt: _Prompt) -> list[_Entry]:
        logprobs = prompt.logprobs or []
        return [(t, logprobs[i] if i < len(logprobs) else None) for i, t in enumerate(prompt.token_ids)]

    async def _completion_frames(self, stream: RequestStream, submission: _Submission, req: CompletionRequest,
                                 params: SamplingParams) -> AsyncIterator[str]:
        include_usage = req.include_usage_in_stream
        dump = {} if include_usage else {"exclude": {"usage"}}

        def chunk(index: int, text: str, logprobs: CompletionLogprobs | None, finish: str | None) -> str:
            body = CompletionResponse(id=submission.response_id, created=submission.created,
                                      model=submission.model,
                                      choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                                finish_reason=finish)])
            return frame(body, **dump)

        try:
            async for output in stream:
                prompt = submission.absorb_prompt(output)
                prompt_index = submission.prompt_of(output.request_id)
                for c in output.outputs:
                    choice = submission.choice(prompt_index, c.index)
                    if choice.finish_reason is not None:
                        continue
                    if c.finish_reason == FinishReason.ERROR:
                        yield api_error(engine_failure(c)).frame()
                        yield DONE_FRAME
                        return
                    text = c.text_delta
                    entries: list[_Entry] = []
                    if req.echo and not choice.started:
                        text = self._prompt_text(prompt) + text
                        if req.logprobs is not None:
                            entries.extend(self._prompt_entries(prompt))
                    entries.extend((lp.token_id, lp) for lp in c.logprobs_delta or ())
                    choice.num_tokens += len(c.token_ids_delta)
                    choice.finish_reason = c.finish_reason
                    # A token whose text is held back (half a character, a possible stop string) has
                    # nothing to show yet, unless its logprobs were asked for.
                    if not text and c.finish_reason is None and not (req.logprobs is not None and entries):
                        continue
                    choice.started = True

                    def piece(index: int = choice.index, text: str = text, entries: list[_Entry] = entries,
                              offset: int = choice.num_chars, finish: str | None = c.finish_reason) -> str:
                        logprobs = (self._completion_logprobs(entries, req.logprobs, offset)
                                    if req.logprobs is not None else None)
                        return chunk(index, text, logprobs, finish)

                    choice.num_chars += len(text)
                    # An echoed prompt is thousands of tokens (with their logprobs): built off the event loop.
                    big = len(entries) > _ON_LOOP_ENTRIES or len(text) > _ON_LOOP_CHARS
                    yield await self.off_loop(piece) if big else piece()
        except RequestFailedError as exc:
            yield api_error(exc).frame()
            yield DONE_FRAME
            return
        if include_usage:
            body = CompletionResponse(id=submission.response_id, created=submission.created,
                                      model=submission.model, choices=[], usage=submission.usage())
            yield frame(body)
        yield DONE_FRAME
