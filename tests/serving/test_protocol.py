"""The completion prompt's four forms, each read as itself (the union is tried in order, strictly)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenloop.errors import InvalidRequestError
from tokenloop.serving.errors import APIError
from tokenloop.serving.protocol import CompletionRequest
from tokenloop.serving.validation import validate_body


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("5", ["5"]),
    (["5", "6"], ["5", "6"]),  # texts that look like numbers stay texts
    ([5, 6], [[5, 6]]),
    ([[5], [6, 7]], [[5], [6, 7]]),
    ([5] * 100_000, [[5] * 100_000]),
])
def test_each_prompt_form_is_read_as_itself(prompt: Any, prompts: list[Any]) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == prompts


@pytest.mark.parametrize("prompt", [["a", 5], [5, "a"], [1.5], [True], [[5], "a"], [[5, "a"]], 5, None])
def test_a_mixed_or_mistyped_prompt_is_refused_naming_it(prompt: Any) -> None:
    with pytest.raises(APIError) as info:
        validate_body(CompletionRequest, {"prompt": prompt})
    assert info.value.param is not None and info.value.param.startswith("prompt")


def test_an_empty_prompt_list_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        CompletionRequest.model_validate({"prompt": []}).prompts()
