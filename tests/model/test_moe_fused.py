"""The MoE families on the fused CPU path: OLMoE's QK-norm over the whole Q and K projections in the rotary
kernel, the experts' block in place of the MLP layer by layer, and a pure decode step of packed experts through
the one-call loop (`decode_layers`, the native MoE block inside it), bit for bit the Python layer loop over the
same kernels. (The families' parity rows in test_families.py hold the fused path to HF transformers.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.model.test_families import MOE, write_tiny_family
from tests.model.test_fused_ops import _decode_twice
from tests.model.test_loader import write_tiny_gguf
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.int8_dot import int8_dot_available
from tokenloop.model.layers.norm import rms_norm
from tokenloop.model.layers.rotary import apply_rope
from tokenloop.model.loader import load_checkpoint
from tokenloop.model.models.llama import LlamaModel
from tokenloop.model.quantized import PackThresholds
from tokenloop.model.registry import model_class

kernels = paged_decode_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "decode_layers")
                                or not hasattr(kernels, "moe_experts"), reason="C++ CPU kernels unavailable")


def test_rope_write_kv_normalizes_the_whole_q_and_k_projections() -> None:
    """A Q norm of H * D values (and a K norm of KVH * D) normalizes all of Q (of K) at once, as OLMoE does,
    before rotary; a norm of D values still normalizes each head."""
    tokens, heads, kv_heads, head_dim, eps = 5, 4, 2, 32, 1e-5
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    positions = torch.tensor([0, 4, 9, 1, 30])
    angles = torch.outer(torch.arange(32, dtype=torch.float32), torch.rand(head_dim // 2, generator=gen))
    slots = torch.tensor([3, 0, 7, 5, 1])
    caches = [torch.zeros(2, 4, kv_heads, head_dim) for _ in range(2)]
    q_norm = 1 + torch.randn(heads * head_dim, generator=gen) * 0.2
    k_norm = 1 + torch.randn(kv_heads * head_dim, generator=gen) * 0.2

    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    wide = torch.cat([rms_norm(qkv[:, :q_size], q_norm, eps), rms_norm(qkv[:, q_size:q_size + kv_size], k_norm, eps),
                      qkv[:, q_size + kv_size:]], dim=1)
    qk = apply_rope(wide[:, :q_size + kv_size].view(tokens, heads + kv_heads, head_dim),
                    angles.cos()[positions].unsqueeze(1), angles.sin()[positions].unsqueeze(1))
    q, k, v = torch.empty(tokens, heads, head_dim), torch.empty(tokens, kv_heads, head_dim), torch.empty(
        tokens, kv_heads, head_dim)
    kernels.rope_write_kv(qkv, positions, angles.cos(), angles.sin(), slots, q_norm, k_norm, eps, caches[0],
                          caches[1], q, k, v)
    torch.testing.assert_close(q, qk[:, :heads], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, qk[:, heads:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.flatten(1), qkv[:, q_size + kv_size:])
    torch.testing.assert_close(caches[0].view(-1, kv_size)[slots], k.flatten(1))
    with pytest.raises(RuntimeError, match="q_norm"):  # neither D nor H * D values
        kernels.rope_write_kv(qkv, positions, angles.cos(), angles.sin(), slots, q_norm[:48], k_norm, eps,
                              caches[0], caches[1], q, k, v)


@pytest.fixture(scope="module", params=MOE)
def packed_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    """A tiny MoE family from a Q8_0 GGUF, every matrix packed for the int8-dot kernels (experts included)."""
    family = write_tiny_family(tmp_path_factory.mktemp(request.param), request.param)
    path = write_tiny_gguf(family, Path(tmp_path_factory.mktemp("gguf")) / "q8_0.gguf", QType.Q8_0)
    kept = load_checkpoint(str(path), keep_quantized=True)
    return model_class(kept.config.architecture).from_weights(kept.config, kept.weights, quantized=True,
                                                              thresholds=PackThresholds.always_packed())


@pytest.mark.skipif(not int8_dot_available(), reason="the int8-dot kernels do not run natively here")
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_packed_experts_decode_in_the_one_call_loop_as_in_the_python_one(packed_moe: LlamaModel,
                                                                         batch: int) -> None:
    """A pure decode step of an MoE family runs every layer, experts included, in one `decode_layers` call, and
    gives the logits and KV cache of the Python layer loop over the same kernels, bit for bit."""
    model = packed_moe
    plan = model.decode_plan(batch)
    assert model.fused_ops is not None and model.fused_decode and plan is not None
    top_k = model.config.num_experts_per_tok
    assert plan.expert_layout[::4] == [top_k] * model.config.num_layers  # every layer's experts in the loop
    assert plan.layout.count(0) >= 2 * model.config.num_layers  # and no MLP projection
    (cpp_logits, cpp_kv), (py_logits, py_kv) = _decode_twice(model, batch)
    assert torch.isfinite(cpp_logits).all() and cpp_logits.std() > 0
    assert torch.equal(cpp_logits, py_logits)
    assert torch.equal(cpp_kv, py_kv)


def test_float_experts_run_the_fused_layers_and_leave_the_loop_to_python(tmp_path: Path) -> None:
    """Experts held as float matrices have no native block: the layers still run the fused kernels (the
    family's block in place of the MLP), and a decode step gets no one-call plan."""
    checkpoint = load_checkpoint(str(write_tiny_family(tmp_path / "olmoe", "olmoe")))
    model = model_class("olmoe").from_weights(checkpoint.config, checkpoint.weights)
    assert model.fused_ops is not None
    assert model.decode_plan(1) is None


def test_attention_adapters_on_an_moe_model_decode_in_the_one_call_loop(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA on an MoE family's attention (adapters on experts are refused): decode steps with adapter rows run
    the one-call loop, experts inside it, and give the Python layer loop's tokens and logprobs, bit for bit."""
    from tests.lora_adapters import write_peft_adapter
    from tokenloop import LLM, LoRARequest, SamplingParams
    from tokenloop.model import fused_cpu

    family = write_tiny_family(tmp_path / "olmoe", "olmoe")
    adapter = write_peft_adapter(family, tmp_path / "adapter", 4, 8.0, ["q_proj", "v_proj", "o_proj"], seed=3)
    gguf_path = write_tiny_gguf(family, tmp_path / "q8_0.gguf", QType.Q8_0)
    one_call, adapted = fused_cpu._decode_all_layers, []
    monkeypatch.setattr(fused_cpu, "_decode_all_layers",
                        lambda *args, **kwargs: adapted.append(len(args) > 6 and args[6] is not None)
                        or one_call(*args, **kwargs))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": [5, 9, 17, 3, 12, 40][:n]} for n in (6, 3, 5)]
    results = []
    for one_call_loop in (True, False):
        llm = LLM(str(gguf_path), lora_modules={"a": str(adapter)}, block_size=4, num_blocks=64)
        if one_call_loop and llm.engine.model.decode_plan(len(prompts)) is None:
            pytest.skip("the experts are not packed for the native block here")
        llm.engine.model.fused_decode = one_call_loop
        outputs = llm.generate(prompts, params, lora_request=[LoRARequest("a"), None, LoRARequest("a")],
                               use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    assert adapted and all(adapted)  # every decode step of the first run had adapter rows and ran in one call
    assert results[0] == results[1]
