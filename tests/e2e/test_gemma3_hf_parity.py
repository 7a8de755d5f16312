"""The real Gemma 3 270M Q4_K_M GGUF in float32 against HF transformers on the same file dequantized: greedy
tokens equal, on a short prompt, on code, and on a prompt three times the 512-token sliding window (where a
sliding layer's mask decides the tokens). Runs only where scripts/fetch_gemma3_270m.py cached the file.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import gemma3_gguf, requires_gemma3
from tokenloop import LLM, SamplingParams

pytestmark = [pytest.mark.slow, requires_gemma3]

NEW_TOKENS = 16
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ",
         " ".join(f"item {i} is {i * i};" for i in range(150))]


def test_float32_greedy_equals_hf_transformers() -> None:
    from transformers import AutoModelForCausalLM

    path = gemma3_gguf()
    llm = LLM(str(path), dtype="float32", max_model_len=4096)
    prompts = [llm.get_tokenizer().encode(text) for text in TEXTS]
    assert len(prompts[2]) > 3 * 512
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    del llm
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert hf.config.sliding_window == 512
    with torch.inference_mode():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    assert ours == expected
