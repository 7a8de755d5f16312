"""Projections in whichever form their weights run (dense fp32 / bf16, packed int4 / Q8_0), and the LM head."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeAlias

import torch
import torch.nn.functional as F

from tokenloop.model.int8_gemm import LOGITS_PASSES, RescoredLogits, takes_gemm
from tokenloop.model.quantized import PackedLinear, dense_linear, prepack_dense

Weight: TypeAlias = torch.Tensor | PackedLinear  # a projection matrix in whichever form it runs


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias). Weights stored narrower than the activations (bf16 or packed weights, fp32
    activations) are multiplied in the weights' dtype and the result widened back."""
    if isinstance(weight, PackedLinear):
        out = weight(x)
        return out if bias is None else out + bias
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(weight.dtype), weight).to(x.dtype)
    return out if bias is None else out + bias


def project(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x @ weight.T in the weight form's own output dtype (no widening cast): for the fused CPU path,
    whose elementwise kernels read bf16 or fp32 alike."""
    if isinstance(weight, PackedLinear):
        out = weight.native(x)
    else:
        out = F.linear(x.to(weight.dtype), weight)
    return out if out.is_contiguous() else out.contiguous()


def input_dtype(weight: Weight, rows: int) -> torch.dtype:
    """The activations' dtype `project` multiplies in for a call of `rows` rows."""
    return weight.input_dtype_for(rows) if isinstance(weight, PackedLinear) else weight.dtype


class LMHead:
    """The vocabulary projection. On CPU in fp32 it runs on oneDNN-prepacked weights (`prepack_dense`): the
    49k-row head is the single largest GEMM of a decode step."""

    def __init__(self, weight: Weight) -> None:
        self.rescored: RescoredLogits | None = None  # many-row calls: one code set, the top's logits at two
        if isinstance(weight, PackedLinear):  # the same packed matrices, many-row calls at the logits' precision
            weight = replace(weight, gemm_passes=LOGITS_PASSES)
            self.rescored = RescoredLogits.of(weight.packed) if weight.dense is None else None
        self.weight = weight
        self._packed: torch.Tensor | None = None
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
            packed = prepack_dense(weight)
            self._packed = packed if packed.is_mkldnn else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.rescored is not None and takes_gemm([self.rescored.pack], hidden.shape[0]):
            return self.rescored(hidden)
        if self._packed is None:
            return linear(hidden, self.weight)
        return dense_linear(hidden, self._packed)
