"""Text <-> token ids for the serving loop: tokenizer building, chat templates, streaming detokenization.

`Tokenizer` (tokenizer.py) wraps a Rust `tokenizers.Tokenizer`, built from a GGUF file's metadata (gguf.py)
or from a Hugging Face directory (pretrained.py); chat templates render in chat_template.py's sandbox.
`IncrementalDetokenizer` (detokenizer.py) turns a request's output tokens into UTF-8-safe text deltas and
holds back text that may be the start of a stop string.
"""

from tokenloop.tokenizer.chat_template import strings_in
from tokenloop.tokenizer.detokenizer import REPLACEMENT_CHAR, DetokenizerUpdate, IncrementalDetokenizer
from tokenloop.tokenizer.gguf import SPIECE_SPACE, merges_from_scores
from tokenloop.tokenizer.tokenizer import Tokenizer

__all__ = [
    "REPLACEMENT_CHAR",
    "SPIECE_SPACE",
    "DetokenizerUpdate",
    "IncrementalDetokenizer",
    "Tokenizer",
    "merges_from_scores",
    "strings_in",
]
