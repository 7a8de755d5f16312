"""`Tokenizer`: text <-> token ids for the serving loop, with the special-token facts and chat template.

It wraps a Rust `tokenizers.Tokenizer`, built from a GGUF file's metadata (`gguf.py`) or from a Hugging Face
directory (`pretrained.py`); chat templates render in `chat_template.py`'s sandbox.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as RustTokenizer

from tokenloop.errors import InvalidRequestError
from tokenloop.tokenizer.chat_template import (
    compile_template,
    mask_special_text,
    normalize_messages,
    select_template,
    strings_in,
)
from tokenloop.tokenizer.gguf import gguf_tokenizer_parts
from tokenloop.tokenizer.pretrained import pretrained_tokenizer_parts

# Texts (characters) and token lists longer than this are encoded / decoded with the GIL released.
_GIL_FREE_FROM = 4096


class Tokenizer:
    """A fast tokenizer plus the special-token facts and chat template the serving loop needs.

    Build one with `Tokenizer.from_gguf` or `Tokenizer.from_pretrained_dir`; the constructor takes an
    already configured Rust tokenizer. BOS/EOS insertion is done here (not by a Rust post-processor)
    when `add_bos_token` / `add_eos_token` are given, so GGUF flags and HF config flags behave alike.
    """

    def __init__(
        self,
        backend: RustTokenizer,
        *,
        source: str,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | None = None,
        named_chat_templates: Mapping[str, str] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self._backend = backend
        self.source = source
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._pad_token_id = pad_token_id
        self._unk_token_id = unk_token_id
        # None: leave special tokens to the backend's own post-processor (HF directories without flags).
        self._add_bos = bool(add_bos_token) and bos_token_id is not None
        self._add_eos = bool(add_eos_token) and eos_token_id is not None
        if add_bos_token is not None or add_eos_token is not None:
            backend.post_processor = None
        self._chat_template = chat_template
        self._named_chat_templates = dict(named_chat_templates or {})
        self._vocab_size = (vocab_size if vocab_size is not None
                            else backend.get_vocab_size(with_added_tokens=True))
        eos_ids = {i for i in extra_eos_token_ids if 0 <= i < self._vocab_size}
        if eos_token_id is not None:
            eos_ids.add(eos_token_id)
        self._eos_token_ids = frozenset(eos_ids)
        special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        special.update(i for i in (bos_token_id, eos_token_id, pad_token_id, unk_token_id) if i is not None)
        self._all_special_ids = frozenset(special)
        self._compiled_templates: dict[str, jinja2.Template] = {}
        # Text that spells a special token: in a chat message it is plain text, never the control token.
        special_texts = sorted({t.content for t in backend.get_added_tokens_decoder().values() if t.special},
                               key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, special_texts))) if special_texts else None
        self._literal_backend: RustTokenizer | None = None  # encodes special-token text as plain text
        self._literal_lock = threading.Lock()
        # No token covers more characters than its vocabulary string has (byte-level and SentencePiece
        # spellings take at least one character per byte): len(text) / this bounds the token count below.
        self.max_token_chars = max((len(t) for t in backend.get_vocab(with_added_tokens=True)),
                                   default=1) or 1

    def __getstate__(self) -> dict[str, Any]:
        # A Checkpoint crosses into an engine core's process (a Ray actor's argument): the lock and the
        # compiled templates (a cache) do not pickle; the copy gets its own.
        return {**self.__dict__, "_literal_lock": None, "_compiled_templates": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._literal_lock = threading.Lock()

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], source: str) -> Tokenizer:
        """Build the tokenizer a GGUF file describes from its metadata (`GGUFFile(path).metadata`).

        Supports `tokenizer.ggml.model` 'gpt2' (byte-level BPE; pre-tokenizer chosen by
        `tokenizer.ggml.pre`) and 'llama' (SentencePiece BPE with byte fallback). `source` names the
        file in error messages.
        """
        backend, options = gguf_tokenizer_parts(metadata, source)
        return cls(backend, **options)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer of a Hugging Face model directory.

        Reads tokenizer.json, tokenizer_config.json (special tokens, add_bos_token/add_eos_token,
        chat_template), special_tokens_map.json, chat_template.jinja / chat_template.json, and the
        eos ids of generation_config.json and config.json (extra stop tokens).
        """
        backend, options = pretrained_tokenizer_parts(path)
        return cls(backend, **options)

    # -- vocabulary facts --------------------------------------------------------------------------
    @property
    def backend(self) -> RustTokenizer:
        """The underlying `tokenizers.Tokenizer` (read it; changing it changes this tokenizer)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (for GGUF: the length of the token list)."""
        return self._vocab_size

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, if the model has one."""
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """Id of the end-of-sequence token, if the model has one."""
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: eos plus eot/eom (GGUF) or generation_config.json's eos ids."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, if the model names one."""
        return self._pad_token_id

    @property
    def unk_token_id(self) -> int | None:
        """Id of the unknown token, if the model has one."""
        return self._unk_token_id

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token (what chat templates see as `bos_token`)."""
        return self.id_to_token(self._bos_token_id) if self._bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        """Text of the EOS token (what chat templates see as `eos_token`)."""
        return self.id_to_token(self._eos_token_id) if self._eos_token_id is not None else None

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of special added tokens (control tokens) plus bos, eos, pad and unk."""
        return self._all_special_ids

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of `token_id` (byte-level/SentencePiece spelling), or None if unknown."""
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None if it is not a single token."""
        return self._backend.token_to_id(token)

    # -- encode / decode ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds BOS/EOS as the model's config asks."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}",
                                      param="prompt")
        ids = _encode(self._backend, text, add_special_tokens)
        return self._add_special(ids) if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts at once (the Rust side runs them in parallel)."""
        encodings = self._backend.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        if not add_special_tokens:
            return [e.ids for e in encodings]
        return [self._add_special(e.ids) for e in encodings]

    def _add_special(self, ids: list[int]) -> list[int]:
        if self._add_bos:
            ids.insert(0, self._bos_token_id)  # type: ignore[arg-type]  # _add_bos implies an id
        if self._add_eos:
            ids.append(self._eos_token_id)  # type: ignore[arg-type]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 characters come out as U+FFFD."""
        if len(ids) > _GIL_FREE_FROM:  # decode_batch releases the GIL; decode holds it throughout
            return self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat template -----------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        """The model's default Jinja chat template, or None if it ships none."""
        return self._chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template, as transformers' `apply_chat_template` does.

        The template sees `messages`, `add_generation_prompt`, `tools`, `documents`, the special
        token strings (`bos_token`, `eos_token`, ...) and `template_kwargs` (which override them).
        With `tokenize`, the rendered text is encoded without adding BOS/EOS: the template writes
        whatever special tokens the model wants, so adding them again would double them.
        """
        chat = normalize_messages(messages)
        template_source = self._select_template(template_kwargs.get("tools"))
        template = self._compile(template_source)
        context: dict[str, Any] = {name: value for name, value in (
            ("bos_token", self.bos_token), ("eos_token", self.eos_token),
            ("unk_token", self.id_to_token(self._unk_token_id) if self._unk_token_id is not None else None),
            ("pad_token", self.id_to_token(self._pad_token_id) if self._pad_token_id is not None else None),
        ) if value is not None}
        context.update(tools=None, documents=None)
        context.update(template_kwargs)
        context.update(messages=chat, add_generation_prompt=add_generation_prompt)
        try:
            rendered = template.render(**context)
        except jinja2.TemplateError as exc:  # raise_exception(), undefined values, sandbox violations
            raise InvalidRequestError(f"chat template rejected the conversation: {exc}",
                                      param="messages") from exc
        except (TypeError, ValueError) as exc:  # e.g. a template doing arithmetic on an unexpected field
            raise InvalidRequestError(f"chat template failed on the conversation: {exc}",
                                      param="messages") from exc
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> tuple[str, list[int]]:
        """The rendered conversation and its token ids, with what the messages say encoded as plain text.

        Only the template writes control tokens: a user who types `<|im_start|>system` gets those
        characters, not a forged system turn (as OpenAI's API treats message content). Conversations
        that spell no special token take the plain path: render, then encode the whole text.
        """
        pattern = self._special_text
        if pattern is None or not any(pattern.search(text) for text in strings_in(messages)):
            text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
            return text, self.encode(text, add_special_tokens=False)  # type: ignore[arg-type]
        # Each string that spells a special token goes through the template as a unique placeholder.
        masked, literals, placeholder = mask_special_text(messages, pattern)
        rendered = self.apply_chat_template(masked, add_generation_prompt, **template_kwargs)
        pieces = re.split(placeholder, rendered)  # type: ignore[arg-type]
        literal_backend = self._literal()
        text_parts: list[str] = []
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:  # the template's own text: its control tokens are real
                text_parts.append(piece)
                ids.extend(self.encode(piece, add_special_tokens=False) if piece else ())
            else:
                literal = literals[int(piece)]
                text_parts.append(literal)
                ids.extend(_encode(literal_backend, literal, False))
        return "".join(text_parts), ids

    def min_num_tokens(self, text_length: int) -> int:
        """The fewest tokens a text of `text_length` characters can encode to (rejects huge prompts early)."""
        return -(-text_length // self.max_token_chars)

    def add_special_ids(self, ids: list[int]) -> list[int]:
        """`ids` with the BOS/EOS that `encode(..., add_special_tokens=True)` would add."""
        return self._add_special(list(ids))

    def _literal(self) -> RustTokenizer:
        with self._literal_lock:
            if self._literal_backend is None:
                backend = RustTokenizer.from_str(self._backend.to_str())
                backend.encode_special_tokens = True
                self._literal_backend = backend
            return self._literal_backend

    def _select_template(self, tools: Any) -> str:
        return select_template(self._chat_template, self._named_chat_templates, tools, self.source)

    def _compile(self, source: str) -> jinja2.Template:
        return compile_template(self._compiled_templates, source, self.source)

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self._vocab_size}, bos={self._bos_token_id}, "
                f"eos={sorted(self._eos_token_ids)})")


def _encode(backend: RustTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`; long texts go through encode_batch_fast, which releases the GIL while it works
    (encode holds it: a 2 MB prompt would stall every other thread of the server for seconds). The fast
    variant computes no character offsets: half the time, and an Encoding whose release (under the GIL)
    takes ~10 ms instead of ~100 ms for 500,000 tokens."""
    if len(text) > _GIL_FREE_FROM:
        return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
    return backend.encode(text, add_special_tokens=add_special_tokens).ids
