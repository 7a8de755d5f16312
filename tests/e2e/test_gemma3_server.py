"""End to end: the Gemma 3 270M Q4_K_M GGUF served by `python -m tokenloop serve --model FILE` (its packed
K-quant and Q5_0/Q8_0 weights, dtype auto), driven by the official `openai` client: chat streaming and not,
Gemma's turn template with one BOS, <end_of_turn> ending a reply, tool calls and a JSON schema.

Runs only where scripts/fetch_gemma3_270m.py has cached the file. The file holds no chat template, so the
registry's Gemma template renders the turns, as llama.cpp's built-in one does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.conftest import gemma3_gguf, requires_gemma3
from tests.e2e.test_tool_calls_server import SEARCH, WEATHER, streamed_calls
from tokenloop.bench.server_process import served

pytestmark = [pytest.mark.slow, requires_gemma3]

openai = pytest.importorskip("openai")

BOS, EOS, START_OF_TURN, END_OF_TURN = 2, 1, 105, 106
MESSAGES = [{"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": "What colour is the sky on a clear day?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("gemma3") / "serve.log"
    with served(["--model", str(gemma3_gguf()), "--no-trace", "--log-level", "warning"], log,
                health_timeout_s=180) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client: Any) -> str:
    return client.models.list().data[0].id


def test_chat_renders_gemma_turns_with_one_bos(client: Any, model_id: str) -> None:
    from tokenloop.model.loader import load_model_info

    tokenizer = load_model_info(str(gemma3_gguf())).tokenizer
    text, ids = tokenizer.encode_chat(MESSAGES)
    assert text == ("<bos><start_of_turn>user\nAnswer in one short sentence.\n\nWhat colour is the sky on a clear "
                    "day?<end_of_turn>\n<start_of_turn>model\n")
    assert ids[:2] == [BOS, START_OF_TURN] and ids.count(BOS) == 1 and ids.count(END_OF_TURN) == 1
    assert {EOS, END_OF_TURN} <= tokenizer.eos_token_ids
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=24, temperature=0.0)
    assert response.usage.prompt_tokens == len(ids)
    assert response.choices[0].message.content.strip()


def test_streaming_equals_non_streaming(client: Any, model_id: str) -> None:
    options = dict(model=model_id, messages=MESSAGES, max_tokens=24, temperature=0.0)
    whole = client.chat.completions.create(**options).choices[0]
    text, finish = "", None
    for chunk in client.chat.completions.create(**options, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole.message.content and finish == whole.finish_reason


@pytest.mark.parametrize("token", [END_OF_TURN, EOS])
def test_end_of_turn_and_eos_end_a_reply_unseen(client: Any, model_id: str, token: int) -> None:
    # A large bias makes the token the greedy choice at once: the reply must stop there, empty.
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=8, temperature=0.0,
                                              logit_bias={str(token): 100})
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "", choice
    assert response.usage.completion_tokens == 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls(client: Any, model_id: str, tool_choice: Any) -> None:
    options = dict(model=model_id, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                   tools=[WEATHER, SEARCH], tool_choice=tool_choice, max_tokens=60, temperature=0.0,
                   parallel_tool_calls=False)
    choice = client.chat.completions.create(**options).choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_weather"
    _, streamed, finish = streamed_calls(client.chat.completions.create(**options, stream=True))
    assert streamed == [(calls[0].function.name, calls[0].function.arguments)] and finish == "tool_calls"


def test_json_schema_response_format(client: Any, model_id: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    response = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Name a big city and its country, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
        max_tokens=60, temperature=0.0)
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_raw_completion_continues_text(client: Any, model_id: str) -> None:
    response = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=16,
                                         temperature=0.0)
    assert response.usage.prompt_tokens == 6  # <bos> and five words: the file asks for BOS on raw prompts
    assert response.choices[0].text.strip()
