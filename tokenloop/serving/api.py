"""The OpenAI-compatible HTTP API over an `AsyncEngine`, built by `create_app(engine, ...)`.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming or not),
POST /tokenize and /detokenize (vLLM's shapes), GET /health, /version, /metrics. Every error is an
OpenAI error body `{"error": {"message", "type", "param", "code"}}`: 400 for bad input (including
FastAPI's own validation errors), 401 for a missing or wrong API key, 400 for an unknown model,
429 with Retry-After when the waiting queue is full, 500 when the engine failed the request,
503 while shutting down.

A client that goes away, streaming or not, has its requests aborted before the engine's next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenloop import __version__
from tokenloop.engine import LLMEngine, RequestOutput
from tokenloop.errors import EngineStoppedError, InvalidRequestError, RequestFailedError, TokenloopError
from tokenloop.observe.metrics import CONTENT_TYPE, EngineMetrics
from tokenloop.request import SamplingParams
from tokenloop.sampler import TokenLogprobs
from tokenloop.serving.async_engine import AsyncEngine, RequestSpec, RequestStream
from tokenloop.serving.protocol import (ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatMessage, ChatStreamChoice, ChatTokenLogprob,
                                        CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                        DeltaMessage, DetokenizeRequest, DetokenizeResponse,
                                        ModelCard, ModelList, PromptTokensDetails, TokenizeChatRequest,
                                        TokenizeCompletionRequest, TokenizeResponse, TopLogprob, UsageInfo,
                                        VersionResponse, now_s, random_id)
from tokenloop.serving.errors import APIError, api_error, internal_error, invalid, new_incident_id, validation_error
from tokenloop.serving.limits import EdgeGuard, ServerLimits
from tokenloop.serving.sse import DONE_FRAME, EventStreamResponse, frame
from tokenloop.serving.structured_fields import (final_message, stream_deltas, stream_finish_reason,
                                                 tool_choice_of)
from tokenloop.structured.tool_calls import ToolChoice, template_inputs
from tokenloop.structured.tool_stream import ToolCallStream
from tokenloop.serving.trace_routes import make_trace_router
from tokenloop.serving.validation import (EdgeContext, check_context, check_context_lower_bound, check_messages,
                                          check_prompt_token_ids, check_sampling_fields, check_template_kwargs,
                                          parse_json_object, validate_body)
from tokenloop.tokenizer import strings_in

logger = logging.getLogger(__name__)

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)

# JSON has no -inf; a logprob of exactly zero probability is reported as this instead.
_MIN_LOGPROB = -9999.0


# ---------------------------------------------------------------------------------------------------
# Collecting outputs
# ---------------------------------------------------------------------------------------------------
@dataclass
class _Choice:
    """One choice (prompt x sample) being assembled from output deltas."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_chars: int = 0  # characters of text sent so far (for completion text_offset)
    started: bool = False


@dataclass
class _Prompt:
    """A prompt of the submission: filled in from its outputs."""

    text: str | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0


@dataclass
class _Submission:
    """What one API call submitted: its prompts, n, and the choices assembled so far."""

    response_id: str
    created: int
    prompts: list[_Prompt]
    request_ids: list[str]
    n: int
    choices: dict[int, _Choice] = field(default_factory=dict)
    _prompt_index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._prompt_index = {rid: i for i, rid in enumerate(self.request_ids)}

    def prompt_of(self, request_id: str) -> int:
        return self._prompt_index[request_id]

    def choice(self, prompt_index: int, sample_index: int) -> _Choice:
        index = prompt_index * self.n + sample_index
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = _Choice(index)
        return choice

    def absorb_prompt(self, output: RequestOutput) -> _Prompt:
        prompt = self.prompts[self.prompt_of(output.request_id)]
        if output.prompt_token_ids:
            prompt.token_ids = output.prompt_token_ids
        if output.prompt_logprobs is not None:
            prompt.logprobs = output.prompt_logprobs
        if output.metrics is not None:
            prompt.num_cached_tokens = output.metrics.num_cached_tokens
        return prompt

    def usage(self) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(c.num_tokens for c in self.choices.values())
        cached = sum(p.num_cached_tokens for p in self.prompts)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _check_finish(choice: _Choice) -> None:
    """Non-streaming: an 'error' or 'abort' ending is an HTTP error, not a choice."""
    if choice.finish_reason == "error":
        raise RequestFailedError("the engine failed while running this request (see the server log)")
    if choice.finish_reason == "abort":
        raise EngineStoppedError("the server shut down before the request finished")


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------------------------------------
# The endpoints' logic
# ---------------------------------------------------------------------------------------------------
class OpenAIServing:
    """Turns API requests into engine submissions and engine outputs into OpenAI responses."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, model_aliases: Sequence[str] = (),
                 limits: ServerLimits | None = None) -> None:
        self.async_engine = async_engine
        self.model_name = model_name
        self.model_aliases = {model_name, *model_aliases}
        self.tokenizer = async_engine.tokenizer
        self.max_model_len = async_engine.max_model_len
        self.limits = limits or ServerLimits()
        self.edge = EdgeContext(self.limits, async_engine.vocab_size, async_engine.max_model_len,
                                async_engine.config.scheduler.max_waiting)
        self.created = now_s()
        self._token_strs: dict[int, str] = {}  # bounded by the vocabulary
        # Tokenizing and chat templating are CPU work: never on the event loop, never on the engine thread.
        self._workers = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenloop-prep")

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._workers, functools.partial(fn, *args))

    # ---- helpers -----------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_aliases:
            # 400, as the issue asks for every bad field (OpenAI itself answers 404 here).
            shown = model if len(model) <= 100 else model[:100] + "..."
            raise APIError(400, f"The model `{shown}` does not exist. This server serves `{self.model_name}`.",
                           "invalid_request_error", "model", "model_not_found")

    def token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _completion_logprobs(self, entries: Sequence[tuple[int, TokenLogprobs | None]], num_top: int,
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
            out.token_logprobs.append(max(lp.logprob, _MIN_LOGPROB))
            top = {self.token_str(t): max(v, _MIN_LOGPROB) for t, v in lp.top[:num_top]}
            top.setdefault(text, max(lp.logprob, _MIN_LOGPROB))  # the sampled token is always listed
            out.top_logprobs.append(top)
        return out

    def _chat_logprobs(self, entries: Sequence[TokenLogprobs], num_top: int) -> ChatChoiceLogprobs:
        content = []
        for lp in entries:
            text = self.token_str(lp.token_id)
            top = [TopLogprob(token=(s := self.token_str(t)), logprob=max(v, _MIN_LOGPROB), bytes=list(s.encode()))
                   for t, v in lp.top[:num_top]]
            content.append(ChatTokenLogprob(token=text, logprob=max(lp.logprob, _MIN_LOGPROB),
                                            bytes=list(text.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    async def _submit(self, specs: list[RequestSpec]) -> RequestStream:
        spec = specs[0].params.structured_outputs if specs else None
        engine = self.async_engine.engine
        if spec is not None and engine is not None:
            # Compiled (or found in the cache) off the event loop; a bad one is a 400 here. With the core
            # in its own process it compiles there, and a bad one comes back as the submission's error.
            await asyncio.to_thread(engine.structured.compile, spec)
        return await self.async_engine.add_requests(specs)

    async def _collect(self, stream: RequestStream, submission: _Submission, raw: Request) -> bool:
        """Gather every output of a non-streaming call; False if the client went away first."""

        async def gather() -> None:
            async for output in stream:
                submission.absorb_prompt(output)
                prompt_index = submission.prompt_of(output.request_id)
                for c in output.outputs:
                    choice = submission.choice(prompt_index, c.index)
                    if choice.finish_reason is not None:
                        continue
                    choice.text.append(c.text_delta)
                    choice.num_tokens += len(c.token_ids_delta)
                    if c.logprobs_delta:
                        choice.logprobs.extend(c.logprobs_delta)
                    choice.finish_reason = c.finish_reason

        work = asyncio.ensure_future(gather())
        watch = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                logger.info("client went away: aborting %s", ", ".join(stream.request_ids))
                return False
            work.result()  # re-raise a failure of the requests
            return True
        finally:
            for task in (work, watch):
                task.cancel()
            stream.abort()  # no-op when everything finished

    # ---- /v1/completions ---------------------------------------------------------------------------

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
                check_prompt_token_ids(ids, param, self.edge.vocab_size)
            if not ids:
                raise invalid("the prompt is empty: at least one token is needed", param)
            check_context(len(ids), params.max_tokens, self.edge, param, "max_tokens")
            token_ids.append(ids)
        return params, prompts, token_ids

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        params, prompts, token_ids = await self._off_loop(self._prepare_completion, req)
        response_id = random_id("cmpl")
        request_ids = [f"{response_id}-{i}" for i in range(len(prompts))]
        salt = req.cache_salt
        if params.prompt_logprobs is not None:
            # Prompt logprobs need the prompt's logits: a private salt keeps the prefix cache from skipping them.
            salt = f"{salt or ''}\x00prompt-logprobs-{response_id}"
        specs = [RequestSpec(rid, p if isinstance(p, str) else None, params, prompt_token_ids=ids,
                             priority=req.priority, user=req.user, cache_salt=salt)
                 for rid, p, ids in zip(request_ids, prompts, token_ids)]
        submission = _Submission(response_id, now_s(),
                                 [_Prompt(p if isinstance(p, str) else None) for p in prompts], request_ids, params.n)
        stream = await self._submit(specs)
        if req.stream:
            return EventStreamResponse(self._completion_frames(stream, submission, req, params),
                                       on_close=stream.abort)
        if not await self._collect(stream, submission, raw):
            return Response(status_code=499)  # nobody reads it; the requests are already aborted
        # Megabytes of logprobs take a while to assemble: off the event loop.
        body = await self._off_loop(self._completion_body, submission, req, params)
        return Response(body, media_type="application/json")

    def _completion_body(self, submission: _Submission, req: CompletionRequest, params: SamplingParams) -> bytes:
        choices = []
        for index in sorted(submission.choices):
            choice = submission.choices[index]
            _check_finish(choice)
            prompt = submission.prompts[index // params.n]
            text = "".join(choice.text)
            entries: list[tuple[int, TokenLogprobs | None]] = []
            if req.echo:
                text = self._prompt_text(prompt) + text
                if req.logprobs is not None:
                    entries.extend(self._prompt_entries(prompt))
            entries.extend((lp.token_id, lp) for lp in choice.logprobs)
            logprobs = self._completion_logprobs(entries, req.logprobs, 0) if req.logprobs is not None else None
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                            finish_reason=choice.finish_reason))
        body = CompletionResponse(id=submission.response_id, created=submission.created, model=self.model_name,
                                  choices=choices, usage=submission.usage())
        return body.model_dump_json().encode()

    def _prompt_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    @staticmethod
    def _prompt_entries(prompt: _Prompt) -> list[tuple[int, TokenLogprobs | None]]:
        logprobs = prompt.logprobs or []
        return [(t, logprobs[i] if i < len(logprobs) else None) for i, t in enumerate(prompt.token_ids)]

    async def _completion_frames(self, stream: RequestStream, submission: _Submission, req: CompletionRequest,
                                 params: SamplingParams) -> AsyncIterator[str]:
        include_usage = req.include_usage_in_stream
        dump = {} if include_usage else {"exclude": {"usage"}}

        def chunk(index: int, text: str, logprobs: CompletionLogprobs | None, finish: str | None) -> str:
            body = CompletionResponse(id=submission.response_id, created=submission.created, model=self.model_name,
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
                    if c.finish_reason == "error":
                        yield api_error(RequestFailedError("the engine failed while running this request")).frame()
                        yield DONE_FRAME
                        return
                    text = c.text_delta
                    entries: list[tuple[int, TokenLogprobs | None]] = []
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
                    logprobs = (self._completion_logprobs(entries, req.logprobs, choice.num_chars)
                                if req.logprobs is not None else None)
                    choice.num_chars += len(text)
                    yield chunk(choice.index, text, logprobs, c.finish_reason)
        except RequestFailedError as exc:
            yield api_error(exc).frame()
            yield DONE_FRAME
            return
        if include_usage:
            body = CompletionResponse(id=submission.response_id, created=submission.created, model=self.model_name,
                                      choices=[], usage=submission.usage())
            yield frame(body)
        yield DONE_FRAME

    # ---- /v1/chat/completions ----------------------------------------------------------------------

    def _prepare_chat(self, req: ChatCompletionRequest,
                      ) -> tuple[SamplingParams, str, list[int], ToolChoice | None]:
        """Checks, sampling params and the templated, tokenized conversation (runs off the loop)."""
        check_messages(req.messages)
        check_template_kwargs(req.chat_template_kwargs)
        check_sampling_fields(req, self.edge)
        # Every message renders to at least one token, every string to at least its share of characters.
        num_chars = sum(len(text) for text in strings_in(req.messages))
        check_context_lower_bound(max(len(req.messages), self.tokenizer.min_num_tokens(num_chars)), self.edge,
                                  "messages")
        try:
            params = req.to_sampling_params()
            tools = tool_choice_of(req)  # None without tools
            messages, tool_kwargs = template_inputs(req.messages, tools, self.tokenizer.chat_template)
            template_kwargs = {**tool_kwargs, **(req.chat_template_kwargs or {})}
            text, token_ids = self.tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                                         **template_kwargs)
        except InvalidRequestError as exc:
            # The engine speaks of the prompt and max_tokens; the client sent messages and maybe another name.
            param = {"prompt": "messages", "max_tokens": req.max_tokens_param}.get(exc.param or "", exc.param)
            message = re.sub(r"\bmax_tokens\b", req.max_tokens_param, exc.message)
            raise invalid(message, param) from None
        check_context(len(token_ids), params.max_tokens, self.edge, "messages", req.max_tokens_param)
        return params, text, token_ids, tools

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        params, text, token_ids, tools = await self._off_loop(self._prepare_chat, req)
        response_id = random_id("chatcmpl")
        spec = RequestSpec(response_id, text, params, prompt_token_ids=token_ids, priority=req.priority,
                           user=req.user, cache_salt=req.cache_salt)
        stream = await self._submit([spec])
        submission = _Submission(response_id, now_s(), [_Prompt(text)], [response_id], params.n)
        num_top = req.top_logprobs or 0
        if req.stream:
            return EventStreamResponse(self._chat_frames(stream, submission, req, num_top, tools),
                                       on_close=stream.abort)
        if not await self._collect(stream, submission, raw):
            return Response(status_code=499)
        body = await self._off_loop(self._chat_body, submission, req, num_top, tools)
        return Response(body, media_type="application/json")

    def _chat_body(self, submission: _Submission, req: ChatCompletionRequest, num_top: int,
                   tools: ToolChoice | None) -> bytes:
        choices = []
        for index in sorted(submission.choices):
            choice = submission.choices[index]
            _check_finish(choice)
            logprobs = self._chat_logprobs(choice.logprobs, num_top) if req.logprobs else None
            content, tool_calls, finish = final_message("".join(choice.text), choice.finish_reason, tools)
            message = ChatMessage(content=content, tool_calls=tool_calls)
            choices.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish))
        body = ChatCompletionResponse(id=submission.response_id, created=submission.created, model=self.model_name,
                                      choices=choices, usage=submission.usage())
        return body.model_dump_json().encode()

    async def _chat_frames(self, stream: RequestStream, submission: _Submission, req: ChatCompletionRequest,
                           num_top: int, tools: ToolChoice | None = None) -> AsyncIterator[str]:
        include_usage = req.include_usage_in_stream
        dump = {} if include_usage else {"exclude": {"usage"}}

        def chunk(index: int, delta: DeltaMessage, logprobs: ChatChoiceLogprobs | None, finish: str | None) -> str:
            body = ChatCompletionChunk(id=submission.response_id, created=submission.created, model=self.model_name,
                                       choices=[ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                                 finish_reason=finish)])
            return frame(body, **dump)

        # With tools, each choice's text goes through its tool-call parser (content and tool-call deltas).
        tool_streams = {i: ToolCallStream(tools) for i in range(submission.n)} if tools is not None else {}
        # The role comes first, for every choice, before any token is ready.
        for index in range(submission.n):
            submission.choice(0, index).started = True
            yield chunk(index, DeltaMessage(role="assistant", content=""), None, None)
        try:
            async for output in stream:
                submission.absorb_prompt(output)
                for c in output.outputs:
                    choice = submission.choice(0, c.index)
                    if choice.finish_reason is not None:
                        continue
                    if c.finish_reason == "error":
                        yield api_error(RequestFailedError("the engine failed while running this request")).frame()
                        yield DONE_FRAME
                        return
                    choice.num_tokens += len(c.token_ids_delta)
                    choice.finish_reason = c.finish_reason
                    tool_stream = tool_streams.get(c.index)
                    if tool_stream is not None:
                        events = tool_stream.feed(c.text_delta)
                        events += tool_stream.finish() if c.finish_reason is not None else []
                        for delta in stream_deltas(events):
                            yield chunk(c.index, DeltaMessage(**delta), None, None)
                        if c.finish_reason is not None:
                            finish = stream_finish_reason(tool_stream, c.finish_reason)
                            yield chunk(c.index, DeltaMessage(), None, finish)
                        continue
                    if c.text_delta or (req.logprobs and c.logprobs_delta):
                        logprobs = self._chat_logprobs(c.logprobs_delta or [], num_top) if req.logprobs else None
                        yield chunk(c.index, DeltaMessage(content=c.text_delta), logprobs, None)
                    if c.finish_reason is not None:
                        yield chunk(c.index, DeltaMessage(), None, c.finish_reason)
        except RequestFailedError as exc:
            yield api_error(exc).frame()
            yield DONE_FRAME
            return
        if include_usage:
            body = ChatCompletionChunk(id=submission.response_id, created=submission.created, model=self.model_name,
                                       choices=[], usage=submission.usage())
            yield frame(body)
        yield DONE_FRAME

    # ---- /tokenize, /detokenize, /v1/models ---------------------------------------------------------

    def tokenize(self, body: dict[str, Any]) -> TokenizeResponse:
        """POST /tokenize (runs off the loop)."""
        if "messages" in body:
            chat = validate_body(TokenizeChatRequest, body)
            self.check_model(chat.model)
            check_messages(chat.messages)
            check_template_kwargs(chat.chat_template_kwargs)
            _, ids = self.tokenizer.encode_chat(chat.messages, add_generation_prompt=chat.add_generation_prompt,
                                                **(chat.chat_template_kwargs or {}))
            if chat.add_special_tokens:
                ids = self.tokenizer.add_special_ids(ids)
            want_strs = chat.return_token_strs
        else:
            plain = validate_body(TokenizeCompletionRequest, body)
            self.check_model(plain.model)
            ids = self.tokenizer.encode(plain.prompt, add_special_tokens=plain.add_special_tokens)
            want_strs = plain.return_token_strs
        strs = [self.tokenizer.id_to_token(i) or "" for i in ids] if want_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """POST /detokenize (runs off the loop)."""
        self.check_model(req.model)
        vocab = self.tokenizer.vocab_size
        for i, token in enumerate(req.tokens):
            if not 0 <= token < vocab:
                raise invalid(f"token {token} is not a token id in [0, {vocab})", f"tokens[{i}]")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created)])


# ---------------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------------
def _json(model: BaseModel, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def create_app(
    engine: LLMEngine | None,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    shutdown_timeout_s: float = 5.0,
    async_engine: AsyncEngine | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """A FastAPI app serving `engine` (which it runs on its own thread from startup to shutdown), or
    `async_engine` (say, `AsyncEngine.with_core_process`: the core in its own process; `engine` is None).

    `served_model_name` is what clients put in `model` (default: the engine's model name or path).
    With `api_key`, every route that accepts work or reveals request data wants
    `Authorization: Bearer <api_key>` (see `limits.EdgeGuard`). Shutdown lets in-flight requests finish
    for `shutdown_timeout_s`, then aborts the rest.
    """
    limits = limits or ServerLimits()
    if async_engine is None:
        if engine is None:
            raise ValueError("create_app needs an engine or an async_engine")
        model_name = served_model_name or engine.config.model
        async_engine = AsyncEngine(engine, EngineMetrics(model_name),
                                   max_stream_backlog=limits.max_stream_backlog)
    model_name = served_model_name or async_engine.config.model
    metrics = async_engine.metrics
    serving = OpenAIServing(async_engine, model_name, model_aliases=[async_engine.config.model],
                            limits=limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await async_engine.shutdown(shutdown_timeout_s)
            serving.close()

    app = FastAPI(title="tokenloop", version=__version__, lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.limits = limits
    app.add_middleware(EdgeGuard, api_key=api_key, limits=limits)

    @app.exception_handler(APIError)
    async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(TokenloopError)
    async def _on_tokenloop_error(_: Request, exc: TokenloopError) -> JSONResponse:
        error = api_error(exc)
        if error.status >= 500:
            logger.error("%s (%s)", error.message, type(exc).__name__, exc_info=exc)
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind, None, None, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _on_unexpected(raw: Request, exc: Exception) -> JSONResponse:
        incident = new_incident_id()
        logger.error("unexpected error while serving %s %s (%s)", raw.method, raw.url.path, incident,
                     exc_info=exc)
        return internal_error(incident).response()

    async def json_body(raw: Request, model: type[ModelT] | None = None) -> Any:
        """The checked body (validated as `model` when given). EdgeGuard has read and bounded it already;
        parsing and validating a body of megabytes is CPU work, so it runs off the event loop."""
        body, content_type = await raw.body(), raw.headers.get("content-type")

        def parse() -> Any:
            value = parse_json_object(body, content_type, limits.max_json_depth)
            return value if model is None else validate_body(model, value)

        return await serving._off_loop(parse)  # noqa: SLF001 - same module

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> Response:
        return _json(serving.models())

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        serving.check_model(model_id)
        return _json(serving.models().data[0])

    @v1.post("/completions")
    async def create_completion(raw: Request) -> Response:
        return await serving.completions(await json_body(raw, CompletionRequest), raw)

    @v1.post("/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        return await serving.chat(await json_body(raw, ChatCompletionRequest), raw)


    app.include_router(v1)
    # /v1/trace* and /v1/dashboard/state are behind the key (EdgeGuard); the /dashboard page asks for it.
    app.include_router(make_trace_router(lambda: async_engine.tracer))

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        body = await json_body(raw)
        return _json(await serving._off_loop(serving.tokenize, body))  # noqa: SLF001 - same module

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        req = await json_body(raw, DetokenizeRequest)
        return _json(await serving._off_loop(serving.detokenize, req))  # noqa: SLF001 - same module

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running or not async_engine.accepting:
            raise APIError(503, "the engine is not running", "server_error", None, "service_unavailable")
        return Response(status_code=200)

    app.add_api_route("/health", health, methods=["HEAD"], operation_id="health_head",
                      include_in_schema=False)  # load balancers probe with HEAD

    @app.get("/version")
    async def version() -> Response:
        return _json(VersionResponse(version=__version__))

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
