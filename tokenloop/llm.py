"""LLM: the offline batch API, shaped like vLLM's so a vLLM user switches by changing the import."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenloop.config import build_engine_config
from tokenloop.engine import LLMEngine
from tokenloop.errors import InvalidRequestError
from tokenloop.model.loader import DEFAULT_MODEL, Checkpoint
from tokenloop.outputs import RequestOutput
from tokenloop.request import Clock, LoRARequest, SamplingParams, default_clock
from tokenloop.tokenizer import Tokenizer

Prompt = str | Sequence[int] | dict[str, Any]
Conversation = list[dict[str, Any]]

class LLM:
    """Offline generation over the engine loop: `generate(prompts, sampling_params)` and `chat(messages)`."""

    def __init__(self, model: str = DEFAULT_MODEL, *, checkpoint: Checkpoint | None = None,
                 clock: Clock = default_clock, **engine_options: Any) -> None:
        self.engine = LLMEngine(build_engine_config(model, **engine_options), checkpoint=checkpoint, clock=clock)
        self._counter = 0

    def get_tokenizer(self) -> Tokenizer:  # as in vLLM
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        A prompt is text, a list of token ids, or `{"prompt": ...}` / `{"prompt_token_ids": [...]}`.
        `lora_request`: one adapter for every prompt, or one (or None: the base model) per prompt.
        """
        batch = self._as_batch(prompts)
        params = self._params_for(batch, sampling_params)
        if priority is not None and len(priority) != len(batch):
            raise InvalidRequestError(f"got {len(priority)} priorities for {len(batch)} prompts", param="priority")
        one = lora_request is None or isinstance(lora_request, LoRARequest)
        adapters = [lora_request] * len(batch) if one else list(lora_request)  # type: ignore[arg-type]
        if len(adapters) != len(batch):
            raise InvalidRequestError(f"got {len(adapters)} LoRA requests for {len(batch)} prompts",
                                      param="lora_request")
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(batch, params)):
                ids.append(self._add(prompt, sp, priority[i] if priority is not None else 0, adapters[i]))
        except Exception:
            self.engine.abort_request(ids)  # nothing half-submitted stays behind
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [tokenizer.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **(chat_template_kwargs or {}))
                   for conv in conversations]
        # The template already wrote any special tokens; encoding must not add a second BOS.
        token_prompts = [{"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
                         for text in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if prompts and all(isinstance(p, int) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return list(prompts)

    @staticmethod
    def _params_for(batch: list[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in batch]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(batch)
        if len(sampling_params) != len(batch):
            raise InvalidRequestError(f"got {len(sampling_params)} sampling params for {len(batch)} prompts",
                                      param="sampling_params")
        return list(sampling_params)

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int,
             lora_request: LoRARequest | None = None) -> str:
        request_id = f"llm-{self._counter}"
        self._counter += 1
        if isinstance(prompt, dict):
            return self.engine.add_request(request_id, prompt.get("prompt"), params,
                                           prompt_token_ids=prompt.get("prompt_token_ids"), priority=priority,
                                           lora_request=lora_request)
        return self.engine.add_request(request_id, prompt, params, priority=priority,
                                       lora_request=lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm,
                   dynamic_ncols=True)
        clock = self.engine.clock
        start = clock()
        generated = 0
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    generated += sum(len(c.token_ids_delta) for c in output.outputs)
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
                elapsed = max(clock() - start, 1) / 1e9
                bar.set_postfix_str(f"output {generated / elapsed:.1f} tok/s", refresh=False)
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids if rid in finished]
