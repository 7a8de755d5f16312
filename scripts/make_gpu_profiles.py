"""Write the datasheet-derived GPU profiles (tokenloop/sim/profiles/{a100,h100,h200}-llama3-*.json).

Every number below carries its source; each profile file repeats them, with the arithmetic, so a file
read alone says where each coefficient came from. Nothing here is measured by tokenloop.

    python scripts/make_gpu_profiles.py            # rewrite the six files
    python scripts/make_gpu_profiles.py --check    # exit 1 if a file differs from what this derives
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parents[1] / "tokenloop" / "sim" / "profiles"

# ---- what the derivation assumes beyond the datasheets (one place, each with its reason) ----------------

BANDWIDTH_EFFICIENCY = 0.85
BANDWIDTH_EFFICIENCY_SOURCE = (
    "0.85 of datasheet HBM bandwidth: with the 1 ms per-step overhead below, this reproduces the one public "
    "batch-1 decode measurement of an 8B Llama used here (vLLM, Llama-3.1-8B-Instruct bf16 on an A100 40GB: "
    "~75 tok/s, 'about 77% of the memory-bandwidth ceiling', johnmusgrave.com/p/vllm-throughput-latency-"
    "sweep-on): 16.06e9 B / (1.555e12 x 0.85) + 1 ms = 13.2 ms, against 13.3 ms measured")
COMPUTE_EFFICIENCY = 0.7
COMPUTE_EFFICIENCY_SOURCE = (
    "0.7 of datasheet dense bf16 FLOP/s: an assumption, not a measurement. cuBLAS approaches the peak only "
    "on large square GEMMs; operand movement, launches and non-GEMM kernels take the rest "
    "(factryze.ai/scale-atlas/compute/tensor-core-throughput lists the deductions)")
STEP_OVERHEAD_S = 1.0e-3
STEP_OVERHEAD_SOURCE = (
    "1 ms per step: the framework's own loop (scheduling, input preparation, sampling, one CUDA-graph "
    "launch), the amount that, with 0.85 bandwidth efficiency, matches the A100 40GB batch-1 measurement "
    "cited for bandwidth_efficiency (13.3 ms per token measured, 12.2 ms of weight reads)")
ALLREDUCE_LATENCY_S = 10e-6
ALLREDUCE_LATENCY_SOURCE = (
    "10 us per all-reduce of a decode-sized message over NVLink within one node: an assumption of the order "
    "of NCCL's small-message latency; tensor parallelism does 2 all-reduces per layer (after attention "
    "and after the MLP), so a step pays 2 x layers of them")
KV_MEMORY_FRACTION = 0.9
KV_MEMORY_SOURCE = ("0.9 x device memory (vLLM's default gpu_memory_utilization) minus the weights each device "
                    "holds, times the devices; activations and CUDA graphs are not subtracted, so the pool is "
                    "an upper bound")


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    memory_bytes: float
    power_watts: float
    link_bytes_per_s: float  # NVLink, one direction
    sources: dict[str, str]


@dataclass(frozen=True)
class Model:
    key: str
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_position_embeddings: int
    source: str

    @property
    def layer_params(self) -> int:
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # q, o, k, v; MLP; 2 norms

    @property
    def dense_params(self) -> int:
        """Every per-token matmul's weights except the LM head."""
        return self.layers * self.layer_params

    @property
    def params(self) -> int:
        return self.dense_params + 2 * self.vocab * self.hidden + self.hidden  # + embedding, LM head, final norm

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


GPUS = {
    "a100": Gpu("a100", "NVIDIA A100 SXM4 80GB", 2.039e12, 312e12, 80e9, 400.0, 300e9, {
        "hbm_bandwidth_bytes_per_s": "2.039e12: NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column "
                                     "(GPU memory bandwidth 2,039 GB/s)",
        "bf16_flops": "312e12: the same datasheet, BF16 Tensor Core 312 TFLOPS (624 with sparsity)",
        "memory_bytes": "80e9: the same datasheet, GPU memory 80 GB HBM2e",
        "power_watts": "400 per device: the same datasheet, SXM max thermal design power 400 W",
        "nvlink_bytes_per_s": "300e9 per direction: the same datasheet, NVLink 600 GB/s (both directions)",
    }),
    "h100": Gpu("h100", "NVIDIA H100 SXM5 80GB", 3.35e12, 989e12, 80e9, 700.0, 450e9, {
        "hbm_bandwidth_bytes_per_s": "3.35e12: NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (GPU "
                                     "memory bandwidth 3.35 TB/s)",
        "bf16_flops": "989e12: the same datasheet, BF16 Tensor Core 1,979 TFLOPS with sparsity = 989 dense",
        "memory_bytes": "80e9: the same datasheet, GPU memory 80 GB",
        "power_watts": "700 per device: the same datasheet, SXM max thermal design power up to 700 W",
        "nvlink_bytes_per_s": "450e9 per direction: the same datasheet, NVLink 900 GB/s (both directions)",
    }),
    "h200": Gpu("h200", "NVIDIA H200 SXM 141GB", 4.8e12, 989e12, 141e9, 700.0, 450e9, {
        "hbm_bandwidth_bytes_per_s": "4.8e12: NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (GPU "
                                     "memory bandwidth 4.8 TB/s)",
        "bf16_flops": "989e12: the same datasheet, BF16 Tensor Core 1,979 TFLOPS with sparsity = 989 dense",
        "memory_bytes": "141e9: the same datasheet, GPU memory 141 GB HBM3e",
        "power_watts": "700 per device: the same datasheet, SXM max thermal design power up to 700 W "
                       "(configurable)",
        "nvlink_bytes_per_s": "450e9 per direction: the same datasheet, NVLink 900 GB/s (both directions)",
    }),
}

MODELS = {
    "llama3-8b": Model("llama3-8b", "meta-llama/Meta-Llama-3-8B", 4096, 32, 32, 8, 128, 14336, 128256, 8192,
                       "Meta-Llama-3-8B config.json: hidden_size 4096, num_hidden_layers 32, "
                       "num_attention_heads 32, num_key_value_heads 8 (head_dim 128), intermediate_size 14336, "
                       "vocab_size 128256, max_position_embeddings 8192, untied embeddings"),
    "llama3-70b": Model("llama3-70b", "meta-llama/Meta-Llama-3-70B", 8192, 80, 64, 8, 128, 28672, 128256, 8192,
                        "Meta-Llama-3-70B config.json: hidden_size 8192, num_hidden_layers 80, "
                        "num_attention_heads 64, num_key_value_heads 8 (head_dim 128), intermediate_size 28672, "
                        "vocab_size 128256, max_position_embeddings 8192, untied embeddings"),
}

TP4_80GB = ("TP=4: 141.1 GB of bf16 weights do not fit one or two 80 GB devices with room for KV (two would "
            "leave 1.4 GB each); four hold 35.3 GB each")
# (gpu, model, tensor-parallel degree, why that degree)
DEPLOYMENTS = (
    ("a100", "llama3-8b", 1, "one device: 16.1 GB of weights in 80 GB"),
    ("h100", "llama3-8b", 1, "one device: 16.1 GB of weights in 80 GB"),
    ("h200", "llama3-8b", 1, "one device: 16.1 GB of weights in 141 GB"),
    ("a100", "llama3-70b", 4, TP4_80GB),
    ("h100", "llama3-70b", 4, TP4_80GB),
    ("h200", "llama3-70b", 2, ("TP=2: 70.6 GB of weights per 141 GB device leaves 56 GB each for KV; one "
                               "device cannot hold the 141.1 GB")),
)


def profile_name(gpu: str, model: str, tp: int) -> str:
    return f"{gpu}-{model}" + (f"-tp{tp}" if tp > 1 else "")


def derive(gpu: Gpu, model: Model, tp: int, why_tp: str) -> dict:
    bw = gpu.hbm_bytes_per_s * BANDWIDTH_EFFICIENCY * tp  # all devices read their shard at once
    flops = gpu.bf16_flops * COMPUTE_EFFICIENCY * tp
    weight_bytes = 2 * model.params
    coefficients = {
        "step": weight_bytes / bw,
        "tokens": 2 * model.dense_params / flops,
        "kv_read_tokens": model.kv_bytes_per_token / bw,
        "prefill_attn": 4 * model.heads * model.head_dim * model.layers / flops,
        "sampled_rows": 2 * model.vocab * model.hidden / flops,
        "seqs": 0.0,
    }
    allreduces = 2 * model.layers if tp > 1 else 0
    # A ring all-reduce moves 2 (tp - 1) / tp of the message per device; one token's message is hidden x bf16.
    ring_bytes = 2 * (tp - 1) / tp * model.hidden * 2 * allreduces
    overheads = {"step": STEP_OVERHEAD_S + allreduces * ALLREDUCE_LATENCY_S,
                 "tokens": ring_bytes / gpu.link_bytes_per_s}
    per_device_weights = weight_bytes / tp
    kv_memory = int(tp * (KV_MEMORY_FRACTION * gpu.memory_bytes - per_device_weights))
    sources = {
        **gpu.sources,
        "shape": model.source,
        "params": f"{model.params / 1e9:.2f}e9 counted from the config "
                  f"(dense matmuls {model.dense_params / 1e9:.2f}e9, "
                  f"embedding and LM head {model.vocab * model.hidden / 1e9:.3f}e9 each)",
        "weight_bytes": f"{weight_bytes / 1e9:.1f}e9: params x 2 bytes (bf16)",
        "tensor_parallel": why_tp,
        "kv_bytes_per_token": f"2 (K, V) x {model.layers} layers x {model.kv_heads} KV heads x {model.head_dim} x 2 "
                              f"bytes = {model.kv_bytes_per_token}",
        "kv_cache_memory_bytes": KV_MEMORY_SOURCE,
        "bandwidth_efficiency": BANDWIDTH_EFFICIENCY_SOURCE,
        "compute_efficiency": COMPUTE_EFFICIENCY_SOURCE,
        "overhead_step": STEP_OVERHEAD_SOURCE + (f"; plus {allreduces} all-reduces x 10 us: "
                                                 + ALLREDUCE_LATENCY_SOURCE if tp > 1 else ""),
        "overhead_tokens": ("0: one device, no all-reduce" if tp == 1 else
                            f"ring all-reduce bytes per token, 2 (tp-1)/tp x hidden {model.hidden} x 2 bytes x "
                            f"{allreduces} all-reduces, over NVLink at one direction's bandwidth"),
        "power_watts": f"{gpu.power_watts:.0f} W x {tp} device(s): busy time priced at the max thermal design "
                       "power, so energy is an upper bound",
    }
    return {
        "name": profile_name(gpu.key, model.key, tp),
        "model": model.name,
        "hardware": f"{gpu.name}" + (f" x{tp}, tensor parallel {tp}" if tp > 1 else ", one device")
                    + ", bf16 weights and KV (datasheet roofline with overhead terms)",
        "tensor_parallel": tp,
        "max_model_len": model.max_position_embeddings,
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "block_size": 16,
        "kv_cache_memory_bytes": kv_memory,
        "power_watts": gpu.power_watts * tp,
        "cost": {"combine": "max", "coefficients": coefficients, "overheads": overheads},
        "source": ("derived from the datasheet and model-config numbers in `sources` by "
                   "scripts/make_gpu_profiles.py (no measurement); bandwidth terms: step = weight bytes / "
                   "(devices x HBM bandwidth x bandwidth_efficiency), kv_read_tokens = KV bytes per token / the "
                   "same; compute terms over devices x bf16 FLOP/s x compute_efficiency: tokens = 2 x dense "
                   "params, prefill_attn = 4 x heads x head_dim x layers (QK^T and PV per query-key pair), "
                   "sampled_rows = 2 x vocab x hidden (the LM head); combine max: the step lasts as long as the "
                   "slower side, plus the overheads (outside the roofline)"),
        "sources": sources,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = parser.parse_args(argv)
    stale = []
    for gpu, model, tp, why in DEPLOYMENTS:
        document = derive(GPUS[gpu], MODELS[model], tp, why)
        path = PROFILE_DIR / f"{document['name']}.json"
        text = json.dumps(document, indent=1) + "\n"
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)} (run scripts/make_gpu_profiles.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
