"""A tiny byte-level BPE tokenizer directory in the Hugging Face layout, for fast tests.

`build_tiny_tokenizer_dir(path)` writes tokenizer.json, tokenizer_config.json (ChatML template) and
generation_config.json into `path`. The vocabulary is trained on a fixed corpus, so it is the same on
every run: ids 0-2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (as in SmolLM2), eos is
`<|im_end|>`, and `TINY_VOCAB_SIZE` ids in all. A tiny random model built for tests can size its
embedding with `TINY_VOCAB_SIZE`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
TINY_VOCAB_SIZE = 384  # 3 special + 256 byte symbols + 125 merges

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough repeated words for the merges to fill the vocabulary; a little non-ASCII so that some
# multi-byte characters become single tokens and others stay split across byte tokens.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "The cat sat on the mat, and the dog sat on the log.",
    "A paged key-value cache stores blocks of attention state for each request.",
    "The scheduler picks which requests run in the next step of the serving loop.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "Café, naïve, résumé: accents are bytes too. Ünïcödé ümläüts.",
    "Streaming text must never split a character: 你好, 世界, 🙂.",
    "user: what is the capital of France?\nassistant: The capital of France is Paris.",
    "system: You are a helpful assistant. Answer briefly and clearly.",
]


def build_tiny_tokenizer_dir(path: str | Path) -> None:
    """Write a tiny deterministic HF tokenizer (byte-level BPE, ChatML template) into `path`."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so no text is unencodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    # <|endoftext|> also ends generation, as generation_config.json says for many real models.
    generation = {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID}
    (root / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
