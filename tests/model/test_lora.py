"""LoRA adapters against HF transformers + PEFT on the tiny random Llama (fp32): greedy tokens, alone and in
one batch with other adapters and the base model; GGUF adapters; clear errors at load; prefix isolation;
unload."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import write_tiny_llama
from tests.lora_adapters import ALL_TARGETS, peft_greedy, write_peft_adapter
from tokenloop import LLM, LoRARequest, SamplingParams
from tokenloop.errors import AdapterLoadError, AdapterNotFoundError

# name -> (rank, alpha, targets, rsLoRA)
ADAPTERS = {
    "a": (8, 16, ALL_TARGETS, False),
    "b": (4, 8, ["q_proj", "v_proj"], True),
    "c": (16, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "d": (8, 4, ["k_proj", "up_proj"], False),
}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("lora-base"), seed=5)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: write_peft_adapter(tiny_dir, tmp_path_factory.mktemp(f"lora-{name}"), rank, alpha, targets,
                                     rslora, seed=100 + seed)
            for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items())}


def _prompts(count: int, seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (int(n),), generator=gen).tolist() for n in (5, 9, 17, 3, 12)[:count]]


def _peft_greedy(tiny_dir: Path, adapter_dir: Path | None, prompt: list[int]) -> list[int]:
    return peft_greedy(tiny_dir, adapter_dir, prompt, MAX_TOKENS)


def _llm(tiny_dir: Path, adapters: dict[str, Path], **options) -> LLM:
    return LLM(str(tiny_dir), dtype="float32", lora_modules={k: str(v) for k, v in adapters.items()},
               block_size=4, num_blocks=128, **options)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_adapters_alone_and_in_one_batch_equal_peft(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    names: list[str | None] = ["a", "b", "c", "d", None]
    prompts = _prompts(len(names))
    expected = [_peft_greedy(tiny_dir, adapter_dirs[n] if n else None, p) for n, p in zip(names, prompts)]
    assert len({tuple(e) for e in expected}) == len(expected)  # each adapter changes the output
    llm = _llm(tiny_dir, adapter_dirs, max_loras=4)
    requests = [LoRARequest(n) if n else None for n in names]
    alone = [llm.generate([p], _greedy(), lora_request=r, use_tqdm=False)[0].outputs[0].token_ids
             for p, r in zip(prompts, requests)]
    assert alone == expected
    # All five in one batch: every step mixes four adapters and the base model (one prompt per request).
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), lora_request=requests,
                                                               use_tqdm=False)]
    assert together == expected


def test_fused_cpu_path_equals_op_path(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """The fused CPU kernels' per-layer path with adapters gives the op path's tokens (rows of the base model
    in the same step keep their own)."""
    names = ["a", None, "c"]
    prompts = _prompts(3, seed=11)
    requests = [LoRARequest(n) if n else None for n in names]
    results = []
    for fused in (True, False):
        llm = _llm(tiny_dir, adapter_dirs, max_loras=2)
        if not fused:
            llm.engine.model.fused_ops = None
            llm.engine.model.fused_decode = False
        outputs = llm.generate(prompts, _greedy(), lora_request=requests, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outputs])
    assert results[0] == results[1]


@pytest.mark.parametrize(("weight_dtype", "slots"), [("float32", "float32"), ("bfloat16", "bfloat16"),
                                                      ("float32", "int8")])
def test_decode_steps_with_adapters_run_in_the_one_call_loop(tiny_dir: Path, adapter_dirs: dict[str, Path],
                                                              monkeypatch: pytest.MonkeyPatch, weight_dtype: str,
                                                              slots: str) -> None:
    """A pure decode step with adapter rows runs every layer in one C++ call (`decode_layers`, the products
    added inside it) and gives the per-layer path's tokens and logprobs, bit for bit (rows of the base model in
    the same step keep their own): fp32, bf16 weights and adapters (bf16 projection outputs), and int8 slots
    with their row scales (`--lora-dtype int8` on a packed base; set here on the tiny fp32 model)."""
    from tokenloop.core import engine_core
    from tokenloop.model import fused_cpu

    if slots == "int8":
        monkeypatch.setattr(engine_core, "adapter_dtype", lambda choice, requested: torch.int8)

    names = ["a", None, "b", "c", "a"]
    prompts = _prompts(5, seed=19)
    requests = [LoRARequest(n) if n else None for n in names]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    one_call = fused_cpu._decode_all_layers
    adapted_calls = []

    def counted(*args, **kwargs):
        lora = args[6] if len(args) > 6 else kwargs.get("lora")
        adapted_calls.append(lora is not None)
        return one_call(*args, **kwargs)

    monkeypatch.setattr(fused_cpu, "_decode_all_layers", counted)
    results = []
    for one_call_loop in (True, False):
        llm = _llm(tiny_dir, adapter_dirs, max_loras=3, weight_dtype=weight_dtype)
        if not llm.engine.model.fused_decode:
            pytest.skip("the C++ decode loop is not built here")
        assert llm.engine.core.adapters.slots.dtype == getattr(torch, slots)
        llm.engine.model.fused_decode = one_call_loop
        outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs])
    assert adapted_calls and all(adapted_calls)  # every decode step had adapter rows and ran in one call
    assert len(adapted_calls) >= MAX_TOKENS - 1
    assert results[0] == results[1]


def _permute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row interleaving (the inverse of what the loader undoes)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _write_gguf_lora(peft_dir: Path, out: Path, alpha: float) -> Path:
    """A GGUF LoRA as llama.cpp's convert_lora_to_gguf lays it out, written with the gguf package."""
    import gguf
    from safetensors.torch import load_file

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    heads = {"attn_q": 4, "attn_k": 2}
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for key, tensor in load_file(str(peft_dir / "adapter_model.safetensors")).items():
        parts = key.split(".")
        layer, module, half = int(parts[4]), ".".join(parts[5:7]), parts[7][-1].lower()
        array = tensor.numpy().astype(np.float32)
        target = names[module]
        if half == "b" and target in heads:
            array = _permute_rope_rows(array, heads[target])
        writer.add_tensor(f"blk.{layer}.{target}.weight.lora_{half}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_gguf_adapter_equals_peft(tiny_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    rank, alpha, _, _ = ADAPTERS["a"]
    gguf_file = _write_gguf_lora(adapter_dirs["a"], tmp_path / "a.gguf", alpha)
    prompts = _prompts(2, seed=3)
    expected = [_peft_greedy(tiny_dir, adapter_dirs["a"], p) for p in prompts]
    llm = _llm(tiny_dir, {"g": gguf_file, "c": adapter_dirs["c"]}, max_loras=2)
    outputs = llm.generate(prompts + [prompts[0]], _greedy(), use_tqdm=False,
                           lora_request=[LoRARequest("g"), LoRARequest("g"), LoRARequest("c")])
    assert [o.outputs[0].token_ids for o in outputs[:2]] == expected
    assert outputs[2].outputs[0].token_ids != expected[0]


def test_lru_eviction_with_more_adapters_than_slots(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """Four adapters over two slots: each request's tokens are still its own, and slots were swapped."""
    names = ["a", "b", "c", "d"]
    prompts = _prompts(4, seed=13)
    llm = _llm(tiny_dir, adapter_dirs, max_loras=2)
    alone = [llm.generate([p], _greedy(), lora_request=LoRARequest(n), use_tqdm=False)[0].outputs[0].token_ids
             for p, n in zip(prompts, names)]
    together = llm.generate(prompts, _greedy(), lora_request=[LoRARequest(n) for n in names], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert llm.engine.core.adapters.slots.num_evictions >= 2


def test_prefix_cache_never_crosses_adapters(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    prompt = _prompts(3, seed=17)[2]  # 17 tokens: four full blocks of 4
    llm = _llm(tiny_dir, adapter_dirs, max_loras=2)
    first = llm.generate([prompt], _greedy(), lora_request=LoRARequest("a"), use_tqdm=False)[0]
    other = llm.generate([prompt], _greedy(), lora_request=LoRARequest("b"), use_tqdm=False)[0]
    base = llm.generate([prompt], _greedy(), use_tqdm=False)[0]
    again = llm.generate([prompt], _greedy(), lora_request=LoRARequest("a"), use_tqdm=False)[0]
    assert other.metrics.num_cached_tokens == 0 and base.metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens == 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids == _peft_greedy(tiny_dir, adapter_dirs["b"], prompt)


def test_unknown_adapter_and_unload(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    llm = _llm(tiny_dir, {"a": adapter_dirs["a"]})
    with pytest.raises(AdapterNotFoundError, match="'nope'"):
        llm.generate([[5, 6, 7]], _greedy(), lora_request=LoRARequest("nope"), use_tqdm=False)
    engine = llm.engine
    engine.add_request("r1", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       lora_request=LoRARequest("a"))
    engine.add_request("r2", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    finals = engine.unload_lora("a")
    assert [o.request_id for o in finals] == ["r1"]
    assert finals[0].finished and finals[0].outputs[0].finish_reason == "error"
    ended = finals[0].outputs[0]
    assert "'a' was unloaded" in (ended.error or "") and ended.error_param == "model"
    while engine.has_unfinished_requests():  # the base model's request goes on
        outputs = engine.step()
    assert outputs[0].request_id == "r2" and outputs[0].outputs[0].finish_reason == "length"
    with pytest.raises(AdapterNotFoundError):
        llm.generate([[5, 6, 7]], _greedy(), lora_request=LoRARequest("a"), use_tqdm=False)


def test_load_errors_are_clear(tiny_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    from tokenloop.model.loader import load_checkpoint
    from tokenloop.model.lora import load_adapter

    config = load_checkpoint(str(tiny_dir)).config
    with pytest.raises(AdapterLoadError, match="rank 16, above this server's max_lora_rank 8"):
        load_adapter("c", adapter_dirs["c"], config, max_rank=8)
    with pytest.raises(AdapterLoadError, match="neither a PEFT directory nor a GGUF file"):
        load_adapter("x", tmp_path / "missing", config, 16)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapter_dirs["a"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(AdapterLoadError, match="cannot read safetensors"):
        load_adapter("x", broken, config, 16)
    from safetensors.torch import load_file, save_file

    poisoned = tmp_path / "poisoned"
    poisoned.mkdir()
    (poisoned / "adapter_config.json").write_text((adapter_dirs["a"] / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dirs["a"] / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if ".layers.1.mlp.up_proj.lora_B" in k)
    tensors[key][3, 2] = float("nan")
    save_file(tensors, str(poisoned / "adapter_model.safetensors"))
    with pytest.raises(AdapterLoadError, match="layer 1 up_proj: holds NaN or infinite values"):
        load_adapter("x", poisoned, config, 16)
    other = write_tiny_llama(tmp_path / "wider", seed=1)
    wide = json.loads((other / "config.json").read_text()) | {"intermediate_size": 96}
    (other / "config.json").write_text(json.dumps(wide))
    with pytest.raises(AdapterLoadError, match="another base model"):
        load_adapter("a", adapter_dirs["a"], load_checkpoint(str(other)).config, 16)
    with pytest.raises(AdapterLoadError, match="not a GGUF LoRA adapter|GGUF"):
        (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 8)
        load_adapter("x", tmp_path / "junk.gguf", config, 16)


def test_handoff_carries_the_adapter(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """A request handed mid-decode to another engine core goes on with its adapter (tokens = PEFT's); a core
    that does not serve the adapter refuses the snapshot, naming it."""
    from tokenloop.config import build_engine_config
    from tokenloop.core.engine_core import EngineCore
    from tokenloop.core.messages import CoreRequest
    from tokenloop.request import adapter_cache_salt

    def core(adapters: dict[str, Path]) -> EngineCore:
        return EngineCore(build_engine_config(str(tiny_dir), dtype="float32", block_size=4, num_blocks=64,
                                              lora_modules={k: str(v) for k, v in adapters.items()}))

    prompt = _prompts(2, seed=23)[1]
    source, stranger = core(adapter_dirs), core({"a": adapter_dirs["a"]})
    target = core({"c": adapter_dirs["c"], "b": adapter_dirs["b"]})
    source.add_requests([CoreRequest("r", prompt, _greedy(), 0, cache_salt=adapter_cache_salt(None, "b"),
                                     lora_name="b")])
    tokens: list[int] = []
    while len(tokens) < 3:
        tokens += [t for out in source.step().outputs for t in out.new_token_ids]
    snapshot = source.export_request("r")
    refused = stranger.import_request(snapshot)
    assert not refused.accepted and "'b'" in (refused.reason or "")
    assert target.import_request(snapshot).accepted
    assert source.complete_export(snapshot.lease_id)
    while target.has_unfinished_requests():
        tokens += [t for out in target.step().outputs for t in out.new_token_ids]
    assert tokens == _peft_greedy(tiny_dir, adapter_dirs["b"], prompt)


def test_offline_lora_request_loads_its_path(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """vLLM's offline form: LLM(enable_lora=True), and LoRARequest(name, id, path) loads it on first use."""
    prompt = _prompts(1, seed=29)[0]
    llm = LLM(str(tiny_dir), dtype="float32", enable_lora=True, max_lora_rank=16, block_size=4, num_blocks=64)
    request = LoRARequest("d", 1, str(adapter_dirs["d"]))
    output = llm.generate([prompt], _greedy(), lora_request=request, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == _peft_greedy(tiny_dir, adapter_dirs["d"], prompt)
    assert [a["name"] for a in llm.engine.core.list_loras()] == ["d"]


def test_import_beyond_max_loras_waits_for_a_slot(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """A request handed to a core whose running requests already use max_loras adapters is not adopted as
    running (the next step would need one slot more than there are): it waits, and runs to PEFT's tokens
    once the other adapter's request is done."""
    from tokenloop.config import build_engine_config
    from tokenloop.core.engine_core import EngineCore
    from tokenloop.core.messages import CoreRequest
    from tokenloop.request import RequestStatus, adapter_cache_salt

    def core() -> EngineCore:
        return EngineCore(build_engine_config(str(tiny_dir), dtype="float32", block_size=4, num_blocks=64,
                                              max_loras=1, lora_modules={k: str(adapter_dirs[k]) for k in "ab"}))

    def request(rid: str, prompt: list[int], name: str) -> CoreRequest:
        return CoreRequest(rid, prompt, _greedy(), 0, cache_salt=adapter_cache_salt(None, name), lora_name=name)

    first, second = _prompts(2, seed=31)
    source, target = core(), core()
    source.add_requests([request("moved", second, "b")])
    target.add_requests([request("local", first, "a")])
    tokens: dict[str, list[int]] = {"moved": [], "local": []}

    def step(engine: EngineCore) -> None:
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids

    while len(tokens["moved"]) < 3:
        step(source)
    step(target)
    snapshot = source.export_request("moved")
    assert target.import_request(snapshot).accepted
    assert source.complete_export(snapshot.lease_id)
    moved = target.scheduler.get_request("moved")
    assert moved is not None and moved.status == RequestStatus.WAITING
    while target.has_unfinished_requests():
        step(target)
    assert tokens["local"] == _peft_greedy(tiny_dir, adapter_dirs["a"], first)
    assert tokens["moved"] == _peft_greedy(tiny_dir, adapter_dirs["b"], second)


def test_kv_events_name_the_adapter(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """Blocks stored for a request of an adapter are published under its name (the base model's under none),
    and the name survives the wire form the front end and the router receive."""
    from tokenloop.config import build_engine_config
    from tokenloop.core.engine_core import EngineCore
    from tokenloop.core.kv_events import BlockStored, batch_from_wire, batch_to_wire
    from tokenloop.core.messages import CoreRequest
    from tokenloop.request import adapter_cache_salt

    core = EngineCore(build_engine_config(str(tiny_dir), dtype="float32", block_size=4, num_blocks=64,
                                          enable_kv_events=True, lora_modules={"a": str(adapter_dirs["a"])}))
    prompt = _prompts(3, seed=37)[2]  # 17 tokens: 4 full blocks
    core.add_requests([CoreRequest("base", prompt, _greedy(), 0),
                       CoreRequest("lora", prompt, _greedy(), 0, cache_salt=adapter_cache_salt(None, "a"),
                                   lora_name="a")])
    stored: dict[str | None, set[int]] = {}
    while core.has_unfinished_requests():
        batch = core.step().kv_events
        if batch is None:
            continue
        again = batch_from_wire(batch_to_wire(batch))
        assert again == batch
        for event in again.events:
            if isinstance(event, BlockStored):
                stored.setdefault(event.lora_name, set()).update(event.block_hashes)
    assert set(stored) == {None, "a"}
    assert len(stored["a"]) >= 4 and not stored["a"] & stored[None]  # the same tokens, hashed apart by adapter


def test_traces_label_requests_by_adapter(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """The tracer records which adapter each request ran with (the base model's with none), and the Chrome
    trace's request spans carry it."""
    from tokenloop.config import build_engine_config
    from tokenloop.engine import LLMEngine
    from tokenloop.observe.tracer import Tracer

    tracer = Tracer()
    engine = LLMEngine(build_engine_config(str(tiny_dir), dtype="float32", block_size=4, num_blocks=64,
                                           lora_modules={"a": str(adapter_dirs["a"])}), tracer=tracer)
    prompt = _prompts(1, seed=41)[0]
    engine.add_request("with", prompt, _greedy(), lora_request=LoRARequest("a"))
    engine.add_request("without", prompt, _greedy())
    while engine.has_unfinished_requests():
        engine.step()
    traced = {rid: tracer.get(rid) for rid in ("with", "without")}
    assert {rid: trace.lora_name for rid, trace in traced.items() if trace is not None} == \
        {"with": "a", "without": None}
    spans = [event for event in tracer.chrome_trace("with")["traceEvents"] if event.get("cat") == "phase"]
    assert spans and all(span["args"]["lora_adapter"] == "a" for span in spans)
    assert all("lora_adapter" not in span["args"] for span in tracer.chrome_trace("without")["traceEvents"]
               if span.get("cat") == "phase")
