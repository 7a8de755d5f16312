"""Qwen3-MoE: Qwen3's layer (per-head QK-norm) with a mixture of experts in place of the MLP
(layers/moe.py): a softmax router, each token's top k experts, their weights renormalized to sum 1 where the
config says `norm_topk_prob` (Qwen3-30B-A3B does; llama.cpp always does for this family)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloop.config import ModelConfig
from tokenloop.model.layers.layer_weights import DecodeExperts, LayerWeights
from tokenloop.model.layers.linear import Weight
from tokenloop.model.layers.mlp import Adapt
from tokenloop.model.layers.moe import MoEWeights, moe_block
from tokenloop.model.models.qwen3 import Qwen3Model
from tokenloop.model.quantized import PackedLinear
from tokenloop.model.weights import WeightSource

_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class MoELayerWeights(LayerWeights):
    """A decoder layer whose MLP is a mixture of experts (`gate_up` and `down` are None)."""

    moe: MoEWeights | None = None

    def decode_experts(self) -> DecodeExperts | None:
        return None if self.moe is None else self.moe.decode_experts()


class Qwen3MoeModel(Qwen3Model):
    """Qwen3-MoE. The fused CPU forward runs its layer with the experts' block in place of the MLP, and a pure
    decode step's layers in one C++ call where the experts are packed for the native block (model/fused_cpu.py);
    the experts run packed where the GGUF is quantized."""

    @classmethod
    def tensor_names(cls, config: ModelConfig) -> list[str]:
        names = [n for n in super().tensor_names(config) if ".mlp." not in n]
        for i in range(config.num_layers):
            p = f"model.layers.{i}.mlp."
            # The experts as GGUF stacks them (HF directories hold one tensor per expert: `stack_experts`).
            names += [p + "gate.weight"] + [p + f"experts.{x}.weight" for x in _EXPERT_PROJECTIONS]
        return names

    @classmethod
    def mlp_weights(cls, source: WeightSource, config: ModelConfig, index: int) -> tuple[Weight | None,
                                                                                         Weight | None]:
        return None, None

    @classmethod
    def layer_weights(cls, source: WeightSource, config: ModelConfig, index: int) -> LayerWeights:
        p = f"model.layers.{index}.mlp."
        experts = [p + "experts.{}." + x + ".weight" for x in _EXPERT_PROJECTIONS]
        moe = MoEWeights(router=source.take(p + "gate.weight"),
                         gate_up=source.stack_experts(experts[:2], config.num_experts),
                         down=source.stack_experts(experts[2:], config.num_experts),
                         top_k=config.num_experts_per_tok, normalize=config.norm_topk_prob)
        return MoELayerWeights(**vars(super().layer_weights(source, config, index)), moe=moe)

    def feed_forward(self, layer: LayerWeights, normed: torch.Tensor, adapt: Adapt | None = None) -> torch.Tensor:
        # LoRA adapters on experts are refused when they load (model/lora.py): `adapt` adapts attention only.
        assert isinstance(layer, MoELayerWeights) and layer.moe is not None
        return moe_block(normed, layer.moe)

    def weight_form(self, rows: int) -> str:
        """The form the experts run in (the bulk of the weights)."""
        moe = getattr(self.layers[0], "moe", None) if self.layers else None
        expert = moe.gate_up[0] if moe is not None else None
        if isinstance(expert, PackedLinear):
            return expert.form_for(rows)
        return str(expert.dtype).removeprefix("torch.") if expert is not None else str(self.dtype)
