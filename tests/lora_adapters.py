"""Random LoRA adapters written by PEFT itself for the tiny Llama, and PEFT's own greedy tokens with them."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_base(base_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


def write_peft_adapter(base_dir: Path, out_dir: Path, rank: int, alpha: float, targets: list[str],
                       rslora: bool = False, seed: int = 0) -> Path:
    """A PEFT LoRA directory with random A and B (PEFT's own init leaves B zero: an adapter doing nothing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_base(base_dir), LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                          use_rslora=rslora, init_lora_weights=False))
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "lora_" in key:
                param.copy_(torch.randn_like(param) * 0.3)
    model.save_pretrained(str(out_dir))
    return out_dir


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of HF transformers + PEFT (the whole sequence re-run each token: no cache to differ)."""
    from peft import PeftModel

    model = hf_base(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]
