"""A step reads nothing back from the device but its sampled token ids: the CPU proxy of a sync-free step.

The engine core runs with its model on PyTorch's `meta` device, whose tensors have shapes and no data:
any read of one (`.item()`, `int()`, `bool()`, `.cpu()`, `.numpy()`, `.tolist()`) fails, where on CUDA it
would be a device -> host sync. Only `.tolist()` is let through, counted, answering zeros: the sampler's
one copy of the ids. Host metadata (numpy, host tensors) is free to read: it never was on the device.
"""

from __future__ import annotations

import pytest
import torch

from tokenloop.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenloop.core.engine_core import EngineCore
from tokenloop.core.messages import CoreRequest
from tokenloop.model.models.llama import LlamaModel
from tokenloop.request import SamplingParams
from tokenloop.runner import ModelRunner

BLOCK_SIZE = 16


@pytest.fixture
def meta_core(tiny) -> EngineCore:
    """An engine core over the tiny model, its model and runner swapped for copies on `meta`."""
    config = EngineConfig(model=str(tiny.path), seed=0, cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40))
    core = EngineCore(config, checkpoint=tiny)
    model = LlamaModel.from_weights(tiny.config, tiny.weights, device="meta", max_positions=1024)
    core.model = model
    core.runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    return core


class DeviceReads:
    """Counts `.tolist()` of meta tensors (answering 5s); every other read of one fails by itself."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tolist = 0
        original = torch.Tensor.tolist

        def tolist(tensor: torch.Tensor):
            if tensor.device.type != "meta":
                return original(tensor)
            self.tolist += 1
            # Answers 5: an id that ends no request (the tiny model's generation_config makes 0 and 2 eos).
            return torch.full(tensor.shape, 5, dtype=tensor.dtype).tolist()

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6),
    SamplingParams(temperature=0.8, top_k=5, max_tokens=6),
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, max_tokens=6, seed=3),
    SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5, max_tokens=6),
]


def test_mixed_and_decode_steps_read_only_the_ids(meta_core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = DeviceReads(monkeypatch)
    shapes: list[list[tuple[int, int]]] = []  # per step: (new tokens, prefix-hit tokens) per request
    execute = meta_core.runner.execute

    def recording_execute(schedule):
        shapes.append([(item.num_tokens, item.prefix_hit_tokens) for item in schedule.scheduled])
        return execute(schedule)

    monkeypatch.setattr(meta_core.runner, "execute", recording_execute)
    shared = list(range(1, 2 * BLOCK_SIZE + 1))  # two full blocks: a later request hits the prefix cache
    meta_core.add_requests([CoreRequest("r0", shared + [40, 41, 42], PARAMS[0], 0)])
    meta_core.step()
    prompts = [list(range(50, 53)), shared + [60], list(range(70, 120))]
    meta_core.add_requests([CoreRequest(f"r{i + 1}", prompt, params, 0)
                            for i, (prompt, params) in enumerate(zip(prompts, PARAMS[1:]))])
    steps = 1
    while meta_core.has_unfinished_requests():
        before = reads.tolist
        out = meta_core.step()
        steps += 1
        assert steps < 50, "the requests never finished"
        assert all(o.finish_reason != "error" for o in out.outputs), out.outputs
        if any(o.new_token_ids for o in out.outputs):
            assert reads.tolist - before == 1, f"step {steps}: {reads.tolist - before} device reads, expected 1"
        else:
            assert reads.tolist == before, f"step {steps} sampled nothing but read the device"
    mixed = [s for s in shapes if any(n == 1 for n, _ in s) and any(n > 1 for n, _ in s)]
    decode_only = [s for s in shapes if len(s) > 1 and all(n == 1 for n, _ in s)]
    assert mixed and decode_only, shapes
    assert any(hit for s in shapes for _, hit in s), "no prefix hit happened"


def test_a_device_read_in_the_step_would_be_caught(meta_core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy is not vacuous: a forward that reads a value back fails on meta."""
    DeviceReads(monkeypatch)
    forward = meta_core.model.forward

    def reading_forward(*args, **kwargs):
        logits = forward(*args, **kwargs)
        if float(logits.max()) > 1e9:  # the kind of check that costs a sync per step on CUDA
            raise AssertionError("unreachable")
        return logits

    monkeypatch.setattr(meta_core.model, "forward", reading_forward)
    meta_core.add_requests([CoreRequest("r", [1, 2, 3], PARAMS[0], 0)])
    out = meta_core.step()
    assert [o.finish_reason for o in out.outputs] == ["error"]
