"""Text <-> token ids for the serving loop: encoding, chat templates, streaming detokenization.

`Tokenizer` wraps a Rust `tokenizers.Tokenizer`, built either from a GGUF file's metadata (llama.cpp's
`tokenizer.ggml.*` keys) or from a Hugging Face directory (`tokenizer.json` and friends). Building from
GGUF metadata goes straight to the Rust objects, so it takes ~0.15 s for a 49k vocabulary instead of the
seconds transformers spends converting through its slow-tokenizer classes.

`IncrementalDetokenizer` turns a request's output tokens into text deltas as they are sampled: it never
emits half a UTF-8 character and holds back text that may turn out to be the start of a stop string.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from tokenloop.errors import InvalidRequestError, ModelLoadError, ModelNotFoundError, UnsupportedModelError

logger = logging.getLogger(__name__)

# llama.cpp's token types (`tokenizer.ggml.token_type`).
_TYPE_UNDEFINED, _TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_UNUSED, _TYPE_BYTE = range(7)

SPIECE_SPACE = "\u2581"  # SentencePiece writes a space as '▁'
REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for bytes that are not (yet) a whole UTF-8 character
# An unfinished UTF-8 character has at most 3 of its 4 bytes, and every token carries at least one
# byte, so only the last 3 tokens can still change; invalid bytes before them are final (U+FFFD).
_MAX_UNFINISHED_TOKENS = 3

# Split patterns of the byte-level vocabularies we know. GPT-2's own pattern is built into ByteLevel.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = frozenset({"default", "gpt2", "gpt-2"})
_SMOLLM_PRE = frozenset({"smollm"})
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"})
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen"})

# Prompt tokens decoded along with the first output tokens, so a leading space or a character
# completed by the output decodes the way it would inside the whole text.
_PROMPT_CONTEXT_TOKENS = 5
# Texts (characters) and token lists longer than this are encoded / decoded with the GIL released.
_GIL_FREE_FROM = 4096


# ---------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------
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
        self._vocab_size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
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
        self.max_token_chars = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1) or 1

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], source: str) -> Tokenizer:
        """Build the tokenizer a GGUF file describes from its metadata (`GGUFFile(path).metadata`).

        Supports `tokenizer.ggml.model` 'gpt2' (byte-level BPE; pre-tokenizer chosen by
        `tokenizer.ggml.pre`) and 'llama' (SentencePiece BPE with byte fallback). `source` names the
        file in error messages.
        """
        kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise ModelLoadError(f"{source}: GGUF metadata has no tokenizer (tokenizer.ggml.model / .tokens missing)")
        if kind not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"{source}: tokenizer model {kind!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
            )
        tokens = list(tokens)
        num_tokens = len(tokens)
        if num_tokens == 0:
            raise ModelLoadError(f"{source}: tokenizer.ggml.tokens is empty")
        token_types = metadata.get("tokenizer.ggml.token_type")
        token_types = (np.full(num_tokens, _TYPE_NORMAL, dtype=np.int32) if token_types is None
                       else np.asarray(token_types, dtype=np.int32))
        if token_types.shape != (num_tokens,):
            raise ModelLoadError(f"{source}: tokenizer.ggml.token_type has {token_types.size} entries "
                                 f"for {num_tokens} tokens")

        def token_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            if not 0 <= int(value) < num_tokens:
                logger.warning("%s: tokenizer.ggml.%s = %s is outside the vocabulary; ignored", source, key, value)
                return None
            return int(value)

        bos_id, eos_id, unk_id = token_id("bos_token_id"), token_id("eos_token_id"), token_id("unknown_token_id")
        pad_id = token_id("padding_token_id")
        # The first occurrence of a duplicated token string wins, as in llama.cpp's token-to-id map.
        vocab = dict(zip(reversed(tokens), range(num_tokens - 1, -1, -1)))

        try:
            if kind == "gpt2":
                backend = _byte_level_bpe(metadata, vocab, source)
            else:
                backend = _sentencepiece_bpe(metadata, tokens, vocab, token_types,
                                             tokens[unk_id] if unk_id is not None else None, source)
        except ModelLoadError:
            raise
        except Exception as exc:  # the Rust constructors raise plain Exceptions on malformed input
            raise ModelLoadError(f"{source}: cannot build the {kind!r} tokenizer ({exc})") from exc

        # Control/unknown tokens are matched whole in text and skipped on decode; user-defined ones
        # are matched whole but kept, as llama.cpp does.
        special_types = (token_types == _TYPE_CONTROL) | (token_types == _TYPE_UNKNOWN)
        user_types = token_types == _TYPE_USER_DEFINED
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i in np.flatnonzero(special_types) if tokens[i]])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i in np.flatnonzero(user_types) if tokens[i]])

        extra_eos = [i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
        named = {key.removeprefix("tokenizer.chat_template."): value for key, value in metadata.items()
                 if key.startswith("tokenizer.chat_template.") and isinstance(value, str)}
        return cls(
            backend,
            source=source,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            unk_token_id=unk_id,
            extra_eos_token_ids=extra_eos,
            # llama.cpp adds BOS to SentencePiece vocabularies unless told otherwise.
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
            named_chat_templates=named,
            vocab_size=num_tokens,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer of a Hugging Face model directory.

        Reads tokenizer.json, tokenizer_config.json (special tokens, add_bos_token/add_eos_token,
        chat_template), special_tokens_map.json, chat_template.jinja / chat_template.json, and the
        eos ids of generation_config.json and config.json (extra stop tokens).
        """
        root = Path(path)
        if not root.is_dir():
            raise ModelNotFoundError(f"{root}: no such model directory")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            if (root / "tokenizer.model").is_file():
                raise UnsupportedModelError(f"{root}: has only a SentencePiece tokenizer.model; a tokenizer.json "
                                            "is needed (convert it once with transformers and save it)")
            raise ModelLoadError(f"{root}: no tokenizer.json")
        try:
            backend = RustTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust parser raises a plain Exception
            raise ModelLoadError(f"{tokenizer_file}: cannot parse ({exc})") from exc

        config = _read_json_object(root / "tokenizer_config.json")
        special_map = _read_json_object(root / "special_tokens_map.json")

        def special_id(name: str) -> int | None:
            value = config.get(name, special_map.get(name))
            if isinstance(value, dict):  # AddedToken serialised as {"content": ..., ...}
                value = value.get("content")
            if not isinstance(value, str):
                return None
            found = backend.token_to_id(value)
            if found is None:
                logger.warning("%s: %s %r is not in the vocabulary; ignored", root, name, value)
            return found

        bos_id, eos_id = special_id("bos_token"), special_id("eos_token")
        pad_id, unk_id = special_id("pad_token"), special_id("unk_token")
        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            extra_eos.extend(_int_list(_read_json_object(root / name).get("eos_token_id")))
        if eos_id is None and extra_eos:
            eos_id = extra_eos[0]

        template, named = _pretrained_chat_templates(root, config)
        add_bos = config.get("add_bos_token")
        add_eos = config.get("add_eos_token")
        explicit = isinstance(add_bos, bool) or isinstance(add_eos, bool)
        return cls(
            backend,
            source=str(root),
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            unk_token_id=unk_id,
            extra_eos_token_ids=extra_eos,
            # Like transformers: explicit flags replace the post-processor, otherwise tokenizer.json rules.
            add_bos_token=bool(add_bos) if explicit else None,
            add_eos_token=bool(add_eos) if explicit else None,
            chat_template=template,
            named_chat_templates=named,
        )

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
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}", param="prompt")
        ids = _encode(self._backend, text, add_special_tokens)
        return self._add_special(ids) if add_special_tokens else ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for many texts at once (the Rust side runs them in parallel)."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
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
        chat = _normalize_messages(messages)
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
            raise InvalidRequestError(f"chat template rejected the conversation: {exc}", param="messages") from exc
        except (TypeError, ValueError) as exc:  # e.g. a template doing arithmetic on a field it did not expect
            raise InvalidRequestError(f"chat template failed on the conversation: {exc}", param="messages") from exc
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
        nonce = uuid.uuid4().hex
        literals: list[str] = []

        def mask(value: Any) -> Any:
            if isinstance(value, str) and pattern.search(value):
                literals.append(value)
                return f"\ue000{nonce}:{len(literals) - 1}\ue001"
            if isinstance(value, dict):
                return {k: mask(v) for k, v in value.items()}
            if isinstance(value, list):
                return [mask(v) for v in value]
            return value

        rendered = self.apply_chat_template(mask(messages), add_generation_prompt, **template_kwargs)
        pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)  # type: ignore[arg-type]
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
        if tools and "tool_use" in self._named_chat_templates:
            return self._named_chat_templates["tool_use"]
        if self._chat_template is not None:
            return self._chat_template
        raise InvalidRequestError(
            f"{self.source}: the model has no chat template; send a plain prompt (completions) instead of messages",
            param="messages",
        )

    def _compile(self, source: str) -> jinja2.Template:
        template = self._compiled_templates.get(source)
        if template is None:
            try:
                template = _chat_template_env().from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise ModelLoadError(f"{self.source}: chat template does not compile ({exc})") from exc
            self._compiled_templates[source] = template
        return template

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self._vocab_size}, bos={self._bos_token_id}, "
                f"eos={sorted(self._eos_token_ids)})")


# -- GGUF builders ------------------------------------------------------------------------------------
def _split_merges(merges: Iterable[str], source: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, ...]] = [tuple(merge.split(" ", 1)) for merge in merges]  # one C-level split each
    for index in [i for i, pair in enumerate(pairs) if len(pair) != 2 or not pair[0]]:
        # llama.cpp searches for the separator from position 1, so a left piece that is a space works.
        merge = " ".join(pairs[index])
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ModelLoadError(f"{source}: malformed merge {merge!r} in tokenizer.ggml.merges")
        pairs[index] = (merge[:cut], merge[cut + 1:])
    return pairs  # type: ignore[return-value]  # every entry is a pair after the fix-ups above


def _byte_level_bpe(metadata: Mapping[str, Any], vocab: dict[str, int], source: str) -> RustTokenizer:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ModelLoadError(f"{source}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    pre = metadata.get("tokenizer.ggml.pre")
    ignore_merges = False
    normalizer = None
    if pre in _SMOLLM_PRE:
        # Every digit its own pre-token, then the GPT-2 pattern: what SmolLM2's tokenizer.json does.
        pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        pattern = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT
        pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        # Llama 3 looks a whole pre-token up before merging; Qwen2's tokenizer.json normalizes to NFC.
        ignore_merges = pre in _LLAMA3_PRE
        normalizer = normalizers.NFC() if pre in _QWEN2_PRE else None
    else:
        if pre is not None and pre not in _GPT2_PRE:
            logger.warning("%s: unknown pre-tokenizer %r; splitting with the GPT-2 pattern", source, pre)
        pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=_split_merges(merges, source),
                                       ignore_merges=ignore_merges))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], vocab: dict[str, int],
                       token_types: np.ndarray, unk_token: str | None, source: str) -> RustTokenizer:
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = _split_merges(merges, source)
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise ModelLoadError(f"{source}: SentencePiece tokenizer has neither merges nor token scores")
        scores = np.asarray(scores, dtype=np.float64)
        if scores.shape != (len(tokens),):
            raise ModelLoadError(f"{source}: tokenizer.ggml.scores has {scores.size} entries for {len(tokens)} tokens")
        pairs = merges_from_scores(tokens, scores, token_types)
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk_token, fuse_unk=True,
                                       byte_fallback=True))
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer (not Metaspace) prefixes each text piece between special tokens with '▁',
    # which is what llama.cpp does (it re-adds the space after every special token).
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", SPIECE_SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    chain: list[decoders.Decoder] = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        chain.append(decoders.Strip(content=" ", left=1, right=0))  # undo the prefix space
    backend.decoder = decoders.Sequence(chain)
    return backend


def merges_from_scores(tokens: Sequence[str], scores: np.ndarray, token_types: np.ndarray) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging, best merge first.

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the highest-scoring
    vocabulary piece; listing every split of every normal piece by descending score gives BPE the same
    priorities. Control, byte and user-defined pieces never take part in merging.
    """
    mergeable = (token_types == _TYPE_NORMAL) | (token_types == _TYPE_UNDEFINED)
    pieces: dict[str, int] = {}
    for index in np.flatnonzero(mergeable).tolist():
        pieces.setdefault(tokens[index], index)
    found: list[tuple[float, int, int, str, str]] = []
    for piece, index in pieces.items():
        score = -float(scores[index])
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                found.append((score, index, cut, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


# -- HF directory helpers -------------------------------------------------------------------------------
def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _int_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pretrained_chat_templates(root: Path, config: dict[str, Any]) -> tuple[str | None, dict[str, str]]:
    """The default template and any named ones; a standalone template file wins over the config's."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), {}
    value = _read_json_object(root / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(value, str):
        return value, {}
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {item["name"]: item["template"] for item in value
                 if isinstance(item, dict) and isinstance(item.get("name"), str)
                 and isinstance(item.get("template"), str)}
        default = named.pop("default", None)
        return default, named
    return None, {}


# -- chat template environment -----------------------------------------------------------------------------
class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used by some templates to mark assistant text)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes '<' and '>', which would corrupt tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_template_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in: sandboxed, trimmed blocks, helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of chat messages: text-part lists joined, None-valued keys dropped."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    chat = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content', "
                                      f"got {type(message).__name__}", param=where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{where}.role must be a non-empty string", param=f"{where}.role")
        # None-valued keys are dropped, as transformers does, so templates test presence with `is defined`.
        normalized = {key: value for key, value in message.items() if value is not None}
        content = message.get("content")
        if isinstance(content, list):
            normalized["content"] = _join_text_parts(content, f"{where}.content")
        elif content is None and role == "assistant" and message.get("tool_calls"):
            pass  # an assistant turn that only calls tools has no content
        elif not isinstance(content, str):
            raise InvalidRequestError(f"{where}.content must be a string or a list of text parts",
                                      param=f"{where}.content")
        chat.append(normalized)
    return chat


def _encode(backend: RustTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`; long texts go through encode_batch, which releases the GIL while it works
    (encode holds it: a 2 MB prompt would stall every other thread of the server for seconds)."""
    if len(text) > _GIL_FREE_FROM:
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def strings_in(value: Any) -> Iterable[str]:
    """Every string inside nested lists and dicts (message contents, names, tool-call arguments)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _join_text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for index, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}[{index}] must be {{'type': 'text', 'text': <string>}} "
                                      "(only text content is supported)", param=f"{where}[{index}]")
        texts.append(part["text"])
    return "\n".join(texts)  # newline-joined, as vLLM does for multi-part text content


# ---------------------------------------------------------------------------------------------------
# Incremental detokenizer
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DetokenizerUpdate:
    """What one `IncrementalDetokenizer.update` produced: new text, and the stop string if one matched."""

    text_delta: str
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Streams one request's output tokens as text, UTF-8 safe and stop-string aware.

    Decoding uses a small window of recent tokens: `_prefix_offset` marks where the window starts and
    `_read_offset` where the already-consumed tokens end, so each step decodes a handful of tokens
    rather than the whole output. Decoding from a token before the new ones keeps leading spaces and
    SentencePiece's stripped prefix right. A trailing U+FFFD run (an incomplete character) is held
    until later tokens complete it; text that may be the start of a stop string is held until it
    either becomes one (the output is cut there) or cannot any more.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in (stop or ()) if s]  # an empty stop string would match everywhere
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self._ids else ""
        self._window_emitted = 0  # chars of the current window, past the prefix text, already consumed
        self._pending = ""  # decoded text held back as a possible stop-string start
        self._chunks: list[str] = []
        self._num_taken = 0  # chunks already handed out by take_new_text
        self._text = ""
        self._text_stale = False
        self.stop_string: str | None = None  # the stop string that ended the output, if any
        self._done = False

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta)."""
        if self._text_stale:
            self._text = "".join(self._chunks)
            self._text_stale = False
        return self._text

    @property
    def output_text(self) -> str:
        """Same as `text`."""
        return self.text

    def take_new_text(self) -> str:
        """Text emitted since the last call (O(new text): no join of everything so far)."""
        new = "".join(self._chunks[self._num_taken:])
        self._num_taken = len(self._chunks)
        return new

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later tokens produce no text."""
        return self.stop_string is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            self._text_stale = True
        return text

    def _decode_new_text(self) -> str:
        """Text the window gained since the last call, minus a trailing incomplete character."""
        text = self._decode(self._ids[self._prefix_offset:])
        base = len(self._prefix_text)
        end = len(text)
        if end > base and text[end - 1] == REPLACEMENT_CHAR:
            end = self._stable_length(base)
        start = base + self._window_emitted
        new_text = text[start:end] if end > start else ""
        if end == len(text) and end > base:
            # Window decoded cleanly: slide it so the next decode starts at the tokens just consumed.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self._window_emitted = 0
        elif end > start:
            self._window_emitted = end - base
        return new_text

    def _stable_length(self, base: int) -> int:
        """Length of the window's text that no later token can change, when it ends in U+FFFD.

        The unfinished character lies in the last few tokens: drop the fewest (at most 3) that leave a
        clean text. If even 3 leave U+FFFD at the end, those bytes can never complete: they are final.
        """
        window = self._ids[self._prefix_offset:]
        head = ""
        for drop in range(1, min(_MAX_UNFINISHED_TOKENS, len(window)) + 1):
            head = self._decode(window[:-drop])
            if not head.endswith(REPLACEMENT_CHAR):
                break
        return max(base, len(head))

    def update(self, new_token_ids: Sequence[int], check_stop: bool = True) -> DetokenizerUpdate:
        """Feed newly sampled tokens; returns the text that is now safe to emit and any stop string hit.

        With `check_stop=False` (e.g. before min_tokens), stop strings are neither matched nor held back.
        """
        if self._done or self.stopped:
            return DetokenizerUpdate("")
        self._ids.extend(new_token_ids)
        self._pending += self._decode_new_text()
        if not self._pending:
            return DetokenizerUpdate("")
        hold = 0
        if check_stop and self._stop:
            match = self._find_stop()
            if match is not None:
                index, stop = match
                cut = index + len(stop) if self._include_stop else index
                delta = self._pending[:cut]
                self._pending = ""  # text after a stop string is never emitted
                self.stop_string = stop
                return DetokenizerUpdate(self._emit(delta), stop)
            hold = self._stop_prefix_length()
        cut = len(self._pending) - hold
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        return DetokenizerUpdate(self._emit(delta))

    def _find_stop(self) -> tuple[int, str] | None:
        """The stop string that completes first in the pending text (ties: the one starting first)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            index = self._pending.find(stop)
            if index >= 0:
                key = (index + len(stop), index, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return (best[1], best[2]) if best is not None else None

    def _stop_prefix_length(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def finish(self) -> str:
        """Flush held-back text (stop-string prefixes, incomplete characters as U+FFFD) at request end.

        Returns the flushed text (also appended to `text`); later updates emit nothing.
        """
        if self._done or self.stopped:
            self._done = True
            return ""
        self._done = True
        text = self._decode(self._ids[self._prefix_offset:])
        tail = text[len(self._prefix_text) + self._window_emitted:]
        flushed, self._pending = self._pending + tail, ""
        return self._emit(flushed)
