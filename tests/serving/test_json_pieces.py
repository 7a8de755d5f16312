"""A long /tokenize answer is serialized in pieces (no long GIL hold) into exactly the model's own JSON."""

from __future__ import annotations

import json

import pytest

from tokenloop.serving.app import dump_json_in_pieces
from tokenloop.serving.protocol import TokenizeResponse


@pytest.mark.parametrize("num_tokens", [0, 3, 16_384, 16_385, 100_000])
@pytest.mark.parametrize("with_strs", [False, True])
def test_pieces_equal_the_models_json(num_tokens: int, with_strs: bool) -> None:
    strs = [["a", "é", '"q"', "\\", "\u2028"][i % 5] for i in range(num_tokens)] if with_strs else None
    model = TokenizeResponse(count=num_tokens, max_model_len=2048, tokens=list(range(num_tokens)), token_strs=strs)
    assert json.loads(dump_json_in_pieces(model)) == json.loads(model.model_dump_json())
