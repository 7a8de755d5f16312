"""What every OpenAI endpoint shares: the submission bookkeeping and `ServingBase`.

A submission is what one API call sent to the engine (its prompts, n, the choices assembled from output
deltas). `ServingBase` holds the engine, the tokenizer and the edge checks' context, submits and
collects requests, checks `model`, and runs CPU work (tokenizing, templating, big bodies) on its own
small executor: never on the event loop, never on the engine thread. The endpoints build on it:
`completions.CompletionsServing`, `chat.ChatServing`; /tokenize, /detokenize and /v1/models are small
enough to live here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from tokenloop.config import ServerLimits
from tokenloop.errors import EngineStoppedError, InvalidRequestError, RequestFailedError, TokenloopError
from tokenloop.logprobs import TokenLogprobs
from tokenloop.outputs import CompletionOutput, RequestOutput
from tokenloop.request import FinishReason
from tokenloop.serving.async_engine import AsyncEngine, RequestSpec, RequestStream
from tokenloop.serving.errors import APIError, clipped, invalid
from tokenloop.serving.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UsageInfo,
    now_s,
)
from tokenloop.serving.validation import EdgeContext, check_messages, check_template_kwargs, validate_body

if TYPE_CHECKING:
    from tokenloop.structured.compile_worker import GrammarChecker

logger = logging.getLogger(__name__)

T = TypeVar("T")

# JSON has no -inf; a logprob of exactly zero probability is reported as this instead.
MIN_LOGPROB = -9999.0


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
    failure: TokenloopError | None = None  # why the engine failed it (finish_reason "error")


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
    model: str  # the name the response gives: the served model's, or the LoRA adapter's the request named
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


def engine_failure(output: CompletionOutput) -> TokenloopError:
    """What a choice that ended with 'error' tells its client: a 4xx naming the field when the request's own
    content caused it (a constraint that hit the compiler's limits mid-way), else a 500."""
    if output.error_param is not None:
        return InvalidRequestError(output.error or "the request failed", param=output.error_param)
    return RequestFailedError("the engine failed while running this request (see the server log)")


def _check_finish(choice: _Choice) -> None:
    """Non-streaming: an 'error' or 'abort' ending is an HTTP error, not a choice."""
    if choice.finish_reason == FinishReason.ERROR:
        raise choice.failure or RequestFailedError("the engine failed while running this request")
    if choice.finish_reason == FinishReason.ABORT:
        raise EngineStoppedError("the server shut down before the request finished")


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------------------------------------
# The endpoints' shared base
# ---------------------------------------------------------------------------------------------------
class ServingBase:
    """Turns API requests into engine submissions; the endpoints turn the outputs into responses."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, model_aliases: Sequence[str] = (),
                 limits: ServerLimits | None = None) -> None:
        self.async_engine = async_engine
        self.model_name = model_name
        self.model_aliases = {model_name, *model_aliases}
        # LoRA adapters by name -> path, as the front end knows them (from the config, then the load routes).
        lora = async_engine.config.lora
        self.lora_enabled = lora is not None
        self.lora_adapters: dict[str, str] = dict(lora.adapters) if lora is not None else {}
        self.tokenizer = async_engine.tokenizer
        self.max_model_len = async_engine.max_model_len
        self.limits = limits or ServerLimits()
        self.edge = EdgeContext(self.limits, async_engine.vocab_size, async_engine.max_model_len,
                                async_engine.config.scheduler.max_waiting)
        self.created = now_s()
        self._token_strs: dict[int, str] = {}  # bounded by the vocabulary
        # Tokenizing and chat templating are CPU work: never on the event loop, never on the engine thread.
        self._workers = concurrent.futures.ThreadPoolExecutor(max_workers=2,
                                                              thread_name_prefix="tokenloop-prep")
        self._checker: GrammarChecker | None = None  # started with the first constrained request
        self._checker_lock = threading.Lock()

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        if self._checker is not None:
            self._checker.close()

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the prep workers; the app parses and validates bodies here too."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, functools.partial(fn, *args))

    # ---- helpers -----------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> str | None:
        """Raise for a model this server does not serve; return the LoRA adapter `model` names (None: the base
        model)."""
        if model is None or model in self.model_aliases:
            return None
        if model in self.lora_adapters:
            return model
        served = f"This server serves `{self.model_name}`"
        if self.lora_enabled:  # an adapter's name, most likely: OpenAI's 404 for a model one may not use
            names = ", ".join(f"`{clipped(name, 100)}`" for name in list(self.lora_adapters)[:20]) or "none"
            raise APIError(404, f"The model `{clipped(model, 100)}` does not exist. {served} and the LoRA "
                           f"adapters {names}.", "invalid_request_error", "model", "model_not_found")
        # 400, as the issue asks for every bad field (OpenAI itself answers 404 here).
        raise APIError(400, f"The model `{clipped(model, 100)}` does not exist. {served}.",
                       "invalid_request_error", "model", "model_not_found")

    def token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    async def _submit(self, specs: list[RequestSpec]) -> RequestStream:
        spec = specs[0].params.structured_outputs if specs else None
        if spec is not None:
            # Compiled once in a worker process within the time budget, off the event loop: a constraint
            # too costly or one that crashes the compiler is a 400 here, and never reaches the engine core.
            await asyncio.to_thread(self._grammar_checker().check, spec)
        return await self.async_engine.add_requests(specs)

    def _grammar_checker(self) -> GrammarChecker:
        with self._checker_lock:
            if self._checker is None:
                from tokenloop.structured.compile_worker import GrammarChecker

                tokenizer = self.tokenizer
                self._checker = GrammarChecker(tokenizer.backend.to_str(), self.async_engine.vocab_size,
                                               tokenizer.eos_token_ids,
                                               timeout_s=self.limits.grammar_compile_timeout_s)
            return self._checker

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
                    if c.finish_reason == FinishReason.ERROR:
                        choice.failure = engine_failure(c)

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

    # ---- /tokenize, /detokenize, /v1/models ---------------------------------------------------------

    def tokenize(self, body: dict[str, Any]) -> TokenizeResponse:
        """POST /tokenize (runs off the loop)."""
        if "messages" in body:
            chat = validate_body(TokenizeChatRequest, body)
            self.check_model(chat.model)
            check_messages(chat.messages)
            check_template_kwargs(chat.chat_template_kwargs)
            _, ids = self.tokenizer.encode_chat(chat.messages,
                                                add_generation_prompt=chat.add_generation_prompt,
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
                raise invalid(f"token {clipped(str(token))} is not a token id in [0, {vocab})",
                              f"tokens[{i}]")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))

    def models(self) -> ModelList:
        """The base model, then each LoRA adapter with the base model as its parent."""
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created),
                               *(ModelCard(id=name, created=self.created, root=path, parent=self.model_name)
                                 for name, path in self.lora_adapters.items())])
