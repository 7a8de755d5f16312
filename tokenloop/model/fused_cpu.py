"""The fused CPU forward, a capability a model declares: the decoder layer with the C++ elementwise kernels
(csrc/fused_layer_ops.cpp: each residual add folded into the next RMSNorm, QK-norm + rotary + KV write in one),
and for a pure decode step all layers in one C++ call (csrc/decode_layers.cpp), planned per row count.

The kernels know a layer by data, not by family: its norms by place (`LayerWeights.norms`: Llama's two, Qwen3's
QK-norm per head, OLMoE's over the whole Q and K, Gemma 3's norms on the attention's and the MLP's outputs), the
MLP's gate (`mlp_activation`), per layer its KV group (`attention_places`), whose layout, rotary table
(`group_rotary`) and window it attends with, and routed experts in place of the MLP (`LayerWeights.decode_experts`:
the family's `feed_forward` per layer, one native call a layer inside the decode loop).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch

from tokenloop.config import KVGroup, ModelConfig
from tokenloop.model.attention import AttentionMetadata, paged_attention
from tokenloop.model.layers.layer_weights import DecodeExperts, LayerWeights
from tokenloop.model.layers.linear import Weight, input_dtype, project
from tokenloop.model.layers.rotary import RotaryTables
from tokenloop.model.quantized import Int4Weight, Pack, PackedLinear, Q8Weight, RowStack, int8_dot_form

if TYPE_CHECKING:
    from tokenloop.model.lora_slots import LoRABatch


class ProjectionForm(IntEnum):
    """How `decode_layers` runs one part of a projection (csrc/decode_layers.cpp's `Form`: the same numbers)."""

    DENSE = 0  # a bf16 or float32 matrix, plain or oneDNN-prepacked
    TORCH_INT4 = 1  # torch's int4 pack (`Int4Weight`)
    Q8_FLOAT = 2  # Q8_0 tiles for the float32 kernel (`Q8Weight`)
    INT4_DOT = 3  # the int8-dot packs (`Int4DotWeight`, `Q8DotWeight`)
    Q8_DOT = 4
    Q5_K = 5  # `KQuantDotWeight` (its `kind`)
    Q6_K = 6
    Q4_K = 7


@dataclass(frozen=True)
class ProjectionPart:
    """One kernel call of a projection in `decode_layers`: the pack's codes (or a dense matrix), its scales (an
    empty tensor for a dense matrix), its form and its output columns (a pack's rows may be padded)."""

    matrix: torch.Tensor
    scales: torch.Tensor
    form: ProjectionForm
    width: int


@dataclass(frozen=True)
class DecodePlan:
    """The flat argument lists the C++ `decode_layers` takes, for the weight forms of one row count: per layer
    its six norm weights (`LayerNorms.in_order`, an empty tensor where it has none); per projection (qkv,
    o_proj, gate_up, down) its parts' matrices and scales, and in `layout` its part count followed by each
    part's form and width (0 parts for an MoE layer's gate_up and down). `experts` / `expert_layout`: per layer
    its `DecodeExperts` (empty tensors and zeros for a gated MLP), or empty lists where no layer has experts."""

    norms: list[torch.Tensor]
    matrices: list[torch.Tensor]
    scales: list[torch.Tensor]
    layout: list[int]
    experts: list[torch.Tensor]
    expert_layout: list[int]


_NO_SCALES = torch.empty(0)  # marks a dense matrix in DecodePlan.scales
_NO_NORM = torch.empty(0)  # marks a place without a norm for the kernels
_NO_EXPERTS = DecodeExperts([_NO_NORM] * 5, [0] * 4)  # a layer with its gated MLP, in `decode_layers`' experts
# `decode_layers`' adapter arguments for a step without adapter rows (A, B^T, scales, token slots, widths, parts).
_NO_ADAPTERS: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor, list[int],
                    list[list[int]]] = ([], [], [], torch.empty(0, dtype=torch.long), [], [])


def _no_adapter(out: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    """A step without adapter rows: the projection's output as it is."""
    return out


def decode_projection(weight: Weight, rows: int) -> list[ProjectionPart] | None:
    """The parts of the form `weight` runs for `rows` rows (several for a `RowStack`, whose outputs are
    concatenated), when `decode_layers` can run it the way `project` does; None otherwise (an fp16 matrix, or a
    many-row call `project` sends to the GEMM's one code set).
    Dense matrices may be oneDNN-prepacked (`prepack_dense`)."""
    if isinstance(weight, PackedLinear):
        if weight.gemm_below_decode_precision(rows):  # the GEMM's one code set: `project` runs it, not this loop
            return None
        if weight.dense is None or rows <= weight.packed_max_rows:
            packs = weight.packed.parts if isinstance(weight.packed, RowStack) else [weight.packed]
            return [_pack_part(pack) for pack in packs]
        weight = weight.dense
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return [ProjectionPart(weight, _NO_SCALES, ProjectionForm.DENSE, weight.shape[0])]


def _pack_part(pack: Pack) -> ProjectionPart:
    """A pack as `decode_layers` calls its kernel: the same codes and scales its `matmul` passes."""
    if isinstance(pack, Int4Weight):
        return ProjectionPart(pack.packed, pack.scales_zeros, ProjectionForm.TORCH_INT4, pack.out_features)
    if isinstance(pack, Q8Weight):
        return ProjectionPart(pack.codes, pack.scales, ProjectionForm.Q8_FLOAT, pack.out_features)
    return ProjectionPart(pack.codes, pack.scales, ProjectionForm(int8_dot_form(pack)), pack.out_features)


def layers_fusable(layers: list[LayerWeights]) -> bool:
    """Whether the elementwise kernels can read every layer's GEMM outputs: fp32 or bf16 (so no fp16 matrix)
    and no QKV bias. An MoE layer's experts (no gate_up and down) run in the family's own block."""
    forms = (torch.float32, torch.bfloat16)
    return all(layer.qkv_bias is None and all(w is not None and (isinstance(w, PackedLinear) or w.dtype in forms)
                                              for w in _projections(layer))
               for layer in layers)


def _projections(layer: LayerWeights) -> list[Weight | None]:
    """The layer's projections: qkv, o_proj, gate_up and down, or only the first two where routed experts
    replace the MLP (`LayerWeights.decode_experts`)."""
    if layer.gate_up is None and layer.down is None:
        return [layer.qkv, layer.o_proj]
    return [layer.qkv, layer.o_proj, layer.gate_up, layer.down]


def plan_decode(layers: list[LayerWeights], rows: int) -> DecodePlan | None:
    """The `decode_layers` arguments for a pure decode step of `rows` sequences, or None where some
    projection's form for that many rows is one the C++ loop does not run."""
    norms: list[torch.Tensor] = []
    matrices: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    layout: list[int] = []
    experts = DecodeExperts([], [])
    for layer in layers:
        norms += layer.norms().in_order(_NO_NORM)
        projections = _projections(layer)
        routed = _NO_EXPERTS if len(projections) == 4 else layer.decode_experts()
        if routed is None:
            return None
        experts.tensors.extend(routed.tensors)
        experts.numbers.extend(routed.numbers)
        for weight in projections:
            parts = None if weight is None else decode_projection(weight, rows)
            if parts is None:
                return None
            layout.append(len(parts))
            for part in parts:
                matrices.append(part.matrix)
                scales.append(part.scales)
                layout += [int(part.form), part.width]
        layout += [0] * (4 - len(projections))  # an MoE layer's gate_up and down: no parts
    if not any(experts.numbers):  # no layer has experts: the loop takes empty lists
        experts = DecodeExperts([], [])
    return DecodePlan(norms, matrices, scales, layout, experts.tensors, experts.numbers)


class _Ticker(Protocol):
    @property
    def layer_ticks(self) -> torch.Tensor | None: ...

    def tick(self) -> None: ...


class FusedModel(Protocol):
    """What the fused forward reads of a model (models/llama.py's `LlamaModel` and the families built on it),
    named here so that this room below the families does not import them."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def fused_ops(self) -> ModuleType | None: ...
    @property
    def fused_decode(self) -> bool: ...
    @property
    def layers(self) -> Sequence[LayerWeights]: ...
    @property
    def scale(self) -> float: ...
    @property
    def final_norm(self) -> torch.Tensor: ...
    @property
    def mlp_activation(self) -> str: ...
    @property
    def progress(self) -> _Ticker: ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def feed_forward(self, layer: LayerWeights, normed: torch.Tensor) -> torch.Tensor: ...
    def kv_groups(self) -> tuple[KVGroup, ...]: ...
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def attention_places(self) -> list[tuple[int, int]]: ...
    def group_rotary(self, group: int) -> RotaryTables: ...
    def decode_plan(self, rows: int) -> DecodePlan | None: ...


def forward_fused(
    model: FusedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionMetadata | list[AttentionMetadata],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    logits_indices: torch.Tensor | None,
    lora: LoRABatch | None = None,
) -> torch.Tensor:
    """`model.forward` on the CPU with the fused kernels: the same layer, with each residual add folded into
    the next RMSNorm, the norms written in the next GEMM's input dtype, and QK-norm + rotary + KV write in one.
    `attn`: the step's layout, or one per KV group. A step with adapter rows (`lora`) adds the adapters'
    products after each projection, in `decode_layers` too where their native kernel runs."""
    cfg, ops = model.config, model.fused_ops
    assert ops is not None
    layouts = attn if isinstance(attn, list) else [attn]
    assert len(layouts) == len(model.kv_groups()), "one AttentionMetadata per KV group"
    num_tokens, positions = input_ids.shape[0], positions.contiguous()
    hidden = model.embed_tokens(input_ids).contiguous()  # the fp32 residual stream, updated in place
    places, eps = model.attention_places(), cfg.rms_norm_eps
    if (lora is None or lora.native) and model.fused_decode and \
            all(_pure_decode(layout, num_tokens) for layout in layouts):
        plan = model.decode_plan(num_tokens)
        if plan is not None:  # a pure decode step: the same sequence of kernels, with no Python between layers
            final = _decode_all_layers(model, plan, hidden, positions, layouts, kv_caches, lora)
            if logits_indices is not None:
                final = final.index_select(0, logits_indices)
            return model.lm_head(final)
    activate = ops.gelu_tanh_mul if model.mlp_activation == "gelu_tanh" else ops.silu_mul
    delta, delta_norm = torch.empty(0), _NO_NORM  # the previous layer's MLP output (and its norm), added in the next
    q = torch.empty(num_tokens, cfg.num_heads, cfg.head_dim)
    k = torch.empty(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    v = torch.empty_like(k)
    tick = model.progress.tick
    for index, layer in enumerate(model.layers):
        group, pair = places[index]
        layout, (key_cache, value_cache), rope = layouts[group], kv_caches[pair], model.group_rotary(group)
        norm_input, attention_output, feed_forward_input, feed_forward_output, q_heads, k_heads = \
            layer.norms().in_order(_NO_NORM)
        adapt = _no_adapter if lora is None else lora.for_layer(index)
        normed = torch.empty(num_tokens, cfg.hidden_size, dtype=input_dtype(layer.qkv, num_tokens))
        ops.add_rms_norm(hidden, delta, delta_norm, norm_input, eps, normed)
        qkv = adapt(project(normed, layer.qkv), normed, "qkv")
        ops.rope_write_kv(qkv, positions, rope.cos, rope.sin, layout.slot_mapping, q_heads, k_heads, eps, key_cache,
                          value_cache, q, k, v)
        attended = paged_attention(q, k, v, key_cache, value_cache, layout, model.scale, kv_written=True)
        routed = layer.gate_up is None  # experts in place of the MLP: the family's block takes float32
        normed = torch.empty(num_tokens, cfg.hidden_size,
                             dtype=torch.float32 if routed else input_dtype(layer.gate_up, num_tokens))
        attended = attended.view(num_tokens, -1)
        ops.add_rms_norm(hidden, adapt(project(attended, layer.o_proj), attended, "o_proj"), attention_output,
                         feed_forward_input, eps, normed)
        delta = model.feed_forward(layer, normed) if routed else _gated_mlp(layer, normed, adapt, activate)
        delta_norm = feed_forward_output
        tick()
    final = torch.empty(num_tokens, cfg.hidden_size)
    ops.add_rms_norm(hidden, delta, delta_norm, model.final_norm, eps, final)
    if logits_indices is not None:
        final = final.index_select(0, logits_indices)
    return model.lm_head(final)


def _gated_mlp(layer: LayerWeights, normed: torch.Tensor, adapt: Callable[[torch.Tensor, torch.Tensor, str],
                                                                          torch.Tensor],
               activate: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor:
    """The layer's gated MLP over its normalized input on the fused kernels, with the step's adapter products."""
    assert layer.gate_up is not None and layer.down is not None
    rows = normed.shape[0]
    gate_up = adapt(project(normed, layer.gate_up), normed, "gate_up")
    activated = torch.empty(rows, gate_up.shape[1] // 2, dtype=input_dtype(layer.down, rows))
    activate(gate_up, activated)
    return adapt(project(activated, layer.down), activated, "down")


def _decode_all_layers(model: FusedModel, plan: DecodePlan, hidden: torch.Tensor, positions: torch.Tensor,
                       layouts: list[AttentionMetadata], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                       lora: LoRABatch | None = None) -> torch.Tensor:
    """Every layer of a pure decode step in one C++ call (`decode_layers`), with the step's adapter products
    (`lora`, natively) added after each projection: the final norm's output [T, hidden]."""
    cfg, ops, places = model.config, model.fused_ops, model.attention_places()
    assert ops is not None
    final = torch.empty(hidden.shape[0], cfg.hidden_size)
    decodes = [layout.decode for layout in layouts if layout.decode is not None]
    rotaries = [model.group_rotary(group) for group in range(len(layouts))]
    ticks = model.progress.layer_ticks
    ops.decode_layers(hidden, plan.norms, plan.matrices, plan.scales, plan.layout, plan.experts, plan.expert_layout,
                      [cache for _, pair in places for cache in kv_caches[pair]], [g for g, _ in places],
                      positions, [r.cos for r in rotaries], [r.sin for r in rotaries],
                      [layout.slot_mapping for layout in layouts], [d.block_table for d in decodes],
                      [layout.window for layout in layouts], decodes[0].seq_lens, cfg.num_heads,
                      cfg.num_kv_heads, cfg.head_dim, model.scale, cfg.rms_norm_eps,
                      model.mlp_activation == "gelu_tanh", model.final_norm, final,
                      *(_NO_ADAPTERS if lora is None else lora.decode_arguments()),
                      torch.zeros(1, dtype=torch.long) if ticks is None else ticks)  # None: no core counts
    return final


def _pure_decode(layout: AttentionMetadata, num_tokens: int) -> bool:
    """Whether every row of the step decodes one token through the C++ decode attention, in this layout."""
    decode = layout.decode
    return decode is not None and decode.kernel is not None and decode.token_index.shape[0] == num_tokens
