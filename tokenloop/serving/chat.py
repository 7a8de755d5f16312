"""POST /v1/chat/completions: messages in, an assistant message out, whole or as SSE frames.

`ChatServing` checks the messages, hooks up tools and response_format (`structured_fields`), renders
the chat template and tokenizes off the event loop, submits one engine request with `n` samples, and
turns the outputs into a `ChatCompletionResponse` or into chunks: the role first, then content or
tool-call deltas (each choice's text goes through its own tool-call parser when tools were given).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import Response

from tokenloop.errors import InvalidRequestError, RequestFailedError
from tokenloop.logprobs import TokenLogprobs
from tokenloop.request import FinishReason, SamplingParams
from tokenloop.serving.async_engine import RequestSpec, RequestStream
from tokenloop.serving.base import MIN_LOGPROB, ServingBase, _check_finish, _Prompt, _Submission, engine_failure
from tokenloop.serving.errors import api_error, invalid
from tokenloop.serving.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
    now_s,
    random_id,
)
from tokenloop.serving.sse import DONE_FRAME, EventStreamResponse, frame
from tokenloop.serving.structured_fields import final_message, stream_deltas, stream_finish_reason, tool_choice_of
from tokenloop.serving.validation import (
    check_context,
    check_context_lower_bound,
    check_messages,
    check_sampling_fields,
    check_template_kwargs,
    check_tools,
)
from tokenloop.structured.tool_calls import ToolChoice, template_inputs
from tokenloop.structured.tool_stream import ToolCallStream
from tokenloop.tokenizer import strings_in


class ChatServing(ServingBase):
    """The /v1/chat/completions endpoint."""

    def _chat_logprobs(self, entries: Sequence[TokenLogprobs], num_top: int) -> ChatChoiceLogprobs:
        content = []
        for lp in entries:
            text = self.token_str(lp.token_id)
            top = [TopLogprob(token=(s := self.token_str(t)), logprob=max(v, MIN_LOGPROB),
                              bytes=list(s.encode()))
                   for t, v in lp.top[:num_top]]
            content.append(ChatTokenLogprob(token=text, logprob=max(lp.logprob, MIN_LOGPROB),
                                            bytes=list(text.encode()), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    def _prepare_chat(self, req: ChatCompletionRequest,
                      ) -> tuple[SamplingParams, str, list[int], ToolChoice | None]:
        """Checks, sampling params and the templated, tokenized conversation (runs off the loop)."""
        check_messages(req.messages)
        check_template_kwargs(req.chat_template_kwargs)
        check_sampling_fields(req, self.edge)
        check_tools(req.tools, self.edge.limits)
        # Every message renders to at least one token, every string to at least its share of characters.
        num_chars = sum(len(text) for text in strings_in(req.messages))
        check_context_lower_bound(max(len(req.messages), self.tokenizer.min_num_tokens(num_chars)), self.edge,
                                  "messages")
        try:
            tools = tool_choice_of(req)  # None without tools; parsed once, here
            params = req.to_sampling_params(tools)
            messages, tool_kwargs = template_inputs(req.messages, tools, self.tokenizer.chat_template)
            template_kwargs = {**tool_kwargs, **(req.chat_template_kwargs or {})}
            text, token_ids = self.tokenizer.encode_chat(messages,
                                                         add_generation_prompt=req.add_generation_prompt,
                                                         **template_kwargs)
        except InvalidRequestError as exc:
            # The engine speaks of the prompt and max_tokens; the client sent messages and maybe another name.
            param = {"prompt": "messages", "max_tokens": req.max_tokens_param}.get(exc.param or "", exc.param)
            message = re.sub(r"\bmax_tokens\b", req.max_tokens_param, exc.message)
            raise invalid(message, param) from None
        check_context(len(token_ids), params.max_tokens, self.edge, "messages", req.max_tokens_param)
        return params, text, token_ids, tools

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        lora_name = self.check_model(req.model)
        params, text, token_ids, tools = await self.off_loop(self._prepare_chat, req)
        response_id = random_id("chatcmpl")
        spec = RequestSpec(response_id, text, params, prompt_token_ids=token_ids, priority=req.priority,
                           user=req.user, cache_salt=req.cache_salt, lora_name=lora_name)
        stream = await self._submit([spec])
        submission = _Submission(response_id, now_s(), [_Prompt(text)], [response_id], params.n,
                                 lora_name or self.model_name)
        num_top = req.top_logprobs or 0
        if req.stream:
            return EventStreamResponse(self._chat_frames(stream, submission, req, num_top, tools),
                                       on_close=stream.abort)
        if not await self._collect(stream, submission, raw):
            return Response(status_code=499)
        body = await self.off_loop(self._chat_body, submission, req, num_top, tools)
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
        body = ChatCompletionResponse(id=submission.response_id, created=submission.created,
                                      model=submission.model, choices=choices, usage=submission.usage())
        return body.model_dump_json().encode()

    async def _chat_frames(self, stream: RequestStream, submission: _Submission, req: ChatCompletionRequest,
                           num_top: int, tools: ToolChoice | None = None) -> AsyncIterator[str]:
        include_usage = req.include_usage_in_stream
        dump = {} if include_usage else {"exclude": {"usage"}}

        def chunk(index: int, delta: DeltaMessage, logprobs: ChatChoiceLogprobs | None,
                  finish: str | None) -> str:
            body = ChatCompletionChunk(id=submission.response_id, created=submission.created,
                                       model=submission.model,
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
                    if c.finish_reason == FinishReason.ERROR:
                        yield api_error(engine_failure(c)).frame()
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
                        logprobs = (self._chat_logprobs(c.logprobs_delta or [], num_top)
                                    if req.logprobs else None)
                        yield chunk(c.index, DeltaMessage(content=c.text_delta), logprobs, None)
                    if c.finish_reason is not None:
                        yield chunk(c.index, DeltaMessage(), None, c.finish_reason)
        except RequestFailedError as exc:
            yield api_error(exc).frame()
            yield DONE_FRAME
            return
        if include_usage:
            body = ChatCompletionChunk(id=submission.response_id, created=submission.created,
                                       model=submission.model, choices=[], usage=submission.usage())
            yield frame(body)
        yield DONE_FRAME
