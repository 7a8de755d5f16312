"""The adapters resident for the forward, and one step's low-rank products over its rows.

`AdapterSlots` keeps `max_loras` slots: per layer and fused projection of n parts, every slot's A stacked into
one [slots * n * r, in] matrix, and every slot's B (transposed) into one [slots * r, out]: a fused projection's B
is block-diagonal, and only its diagonal is kept, folded onto the same r rows (part p's rows in part p's output
columns), so that a slot's B^T is one contiguous block, read in one stream. A step whose rows use
adapters gets a `LoRABatch`: each token's slot. On the CPU one native call per projection (csrc/lora_sgmv.cpp,
Punica's SGMV idea) groups the rows by slot and reads each used slot's A and B once, B's zero blocks skipped.
The PyTorch path, the fallback and the kernel's reference, runs GEMMs over the whole step, whatever mix of
adapters its rows use (the gather done by a mask): x @ A_used.T, masked to each row's own slot's columns, then
per part its rank columns @ B_used's part, added to the base projection's output. Only the range of slots the
step uses is read.
Rows of the base model get no product; a step with no adapter row gets no batch at all and runs as before.
Slots of dtype int8 (for a packed base, core/adapters.py) hold A and the folded B^T as int8, each row over its
own maximum, and per slot row one float32 scale (A's row scale times B^T's in that part) that multiplies the
shrunk value: half the bytes bf16 slots stream a decode step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from types import ModuleType

import numpy as np
import torch

from tokenloop.config import ModelConfig
from tokenloop.errors import AdapterNotFoundError, CapacityError
from tokenloop.model.cpu_kernels import paged_decode_kernels
from tokenloop.model.lora import FUSED_PROJECTIONS, LoRAAdapter, projection_shapes

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what csrc/lora_sgmv.cpp reads and writes
_SLOT_DTYPES = (*_KERNEL_DTYPES, torch.int8)  # int8 A and B^T come with their row scales
_NO_SCALES = torch.empty(0)  # what lora_sgmv takes for float A and B^T


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `values` [R, C] as int8 codes over its own maximum: (codes [R, C] int8, scales [R] float32),
    values ~ codes * scales[:, None]; an all-zero row gets scale 0."""
    values = values.float()
    scales = values.abs().amax(dim=1) / 127.0
    codes = torch.round(values / torch.where(scales > 0, scales, 1.0)[:, None]).clamp_(-127, 127)
    return codes.to(torch.int8), scales


# (layer, module) -> (A's codes [rank, in], B^T's codes [rank, out], A's row scales times B^T's [rank])
QuantizedAdapter = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def quantize_adapter(adapter: LoRAAdapter) -> QuantizedAdapter:
    """Every A and B^T of `adapter` quantized by rows (`quantize_rows`), in one call per row width (a few
    calls, not two per projection: a slot load stays a copy)."""
    keys = [(index, module) for index, modules in enumerate(adapter.layers) for module in modules]
    a_parts = {key: adapter.layers[key[0]][key[1]][0] for key in keys}
    bt_parts = {key: adapter.layers[key[0]][key[1]][1].T for key in keys}
    quantized: dict[str, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]] = {}
    for label, parts in (("a", a_parts), ("bt", bt_parts)):
        quantized[label] = {}
        for width in sorted({t.shape[1] for t in parts.values()}):
            group = [key for key in keys if parts[key].shape[1] == width]
            codes, scales = quantize_rows(torch.cat([parts[key] for key in group]))
            for key, key_codes, key_scales in zip(group, codes.split(adapter.rank), scales.split(adapter.rank)):
                quantized[label][key] = (key_codes, key_scales)
    return {key: (quantized["a"][key][0], quantized["bt"][key][0], quantized["a"][key][1] * quantized["bt"][key][1])
            for key in keys}


class AdapterSlots:
    """The adapters an engine serves: every registered one on the host, `max_loras` of them resident (least
    recently used swapped out first) in the stacked forms a step reads. `kernel`: the native products
    (csrc/lora_sgmv.cpp), by default the CPU kernels' where they build; None runs the PyTorch path."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", kernel: ModuleType | None | bool = True) -> None:
        if dtype not in _SLOT_DTYPES:
            raise ValueError(f"adapter slots hold float32, bfloat16 or int8, not {dtype}")
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.quantized = dtype == torch.int8
        shapes = projection_shapes(config)
        self.out_features = {module: out for module, (out, _) in shapes.items()}
        self.width = {kind: len(modules) * max_rank for kind, modules in FUSED_PROJECTIONS.items()}
        # Each fused projection's output column bounds per part: B's rank block p writes only part p's columns.
        self.part_columns = {kind: np.cumsum([0] + [self.out_features[m] for m in modules]).tolist()
                             for kind, modules in FUSED_PROJECTIONS.items()}
        if kernel is True:
            kernel = paged_decode_kernels() if torch.device(device).type == "cpu" else None
        self.kernel: ModuleType | None = kernel if isinstance(kernel, ModuleType) and \
            hasattr(kernel, "lora_sgmv") else None
        self.a: list[dict[str, torch.Tensor]] = []
        self.bt: list[dict[str, torch.Tensor]] = []
        self.scales: list[dict[str, torch.Tensor]] = []  # int8 slots: per slot row, A's scale times B^T's
        for _ in range(config.num_layers):
            a, bt, scales = {}, {}, {}
            for kind, modules in FUSED_PROJECTIONS.items():
                a[kind] = torch.zeros(max_loras * self.width[kind], shapes[modules[0]][1], dtype=dtype,
                                      device=device)
                bt[kind] = torch.zeros(max_loras * max_rank, sum(shapes[m][0] for m in modules), dtype=dtype,
                                       device=device)
                scales[kind] = torch.zeros(max_loras * self.width[kind] if self.quantized else 0, device=device)
            self.a.append(a)
            self.bt.append(bt)
            self.scales.append(scales)
        # The same tensors flat, per layer per kind, as `decode_layers` takes them (slot loads write in place).
        self.flat_a = [a[kind] for a in self.a for kind in FUSED_PROJECTIONS]
        self.flat_bt = [bt[kind] for bt in self.bt for kind in FUSED_PROJECTIONS]
        self.flat_scales = [s[kind] for s in self.scales for kind in FUSED_PROJECTIONS] if self.quantized else []
        self.registered: dict[str, LoRAAdapter] = {}
        self._codes: dict[str, QuantizedAdapter] = {}  # int8 slots: each registered adapter quantized once
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # resident adapter -> its slot, oldest use first
        self.num_loads = 0
        self.num_evictions = 0
        self.load_seconds = 0.0  # spent copying adapters into slots (the cost of a swap, for benchmarks)

    @property
    def resident(self) -> list[str]:
        """The resident adapters, least recently used first."""
        return list(self._slot_of)

    def register(self, adapter: LoRAAdapter) -> None:
        """Serve `adapter` under its name (replacing one of that name: its slot is reloaded on next use)."""
        self.unregister(adapter.name)
        if self.quantized:
            self._codes[adapter.name] = quantize_adapter(adapter)
        self.registered[adapter.name] = adapter

    def unregister(self, name: str) -> bool:
        """Stop serving `name`; returns whether it was registered."""
        self._slot_of.pop(name, None)
        self._codes.pop(name, None)
        return self.registered.pop(name, None) is not None

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """Each named adapter's slot, loading those not resident over the least recently used others."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise CapacityError(f"{len(wanted)} adapters in one step, but max_loras is {self.max_loras}")
        for name in wanted:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
        for name in wanted:
            if name not in self._slot_of:
                adapter = self.registered.get(name)
                if adapter is None:
                    raise AdapterNotFoundError(f"the LoRA adapter {name!r} is not loaded", param="model")
                self._load(adapter, self._free_slot(set(wanted)))
        return {name: self._slot_of[name] for name in wanted}

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self._slot_of.values())
        free = next((s for s in range(self.max_loras) if s not in used), None)
        if free is not None:
            return free
        victim = next(name for name in self._slot_of if name not in keep)  # oldest use first
        self.num_evictions += 1
        return self._slot_of.pop(victim)

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        """Copy an adapter into a slot, fused as the base projections are: per fused projection, each
        sub-projection's A in its own `max_rank` rows, its B (transposed) in the slot's `max_rank` rows of B^T
        and its own output columns; everything it does not adapt (and the padding past its rank) zero. Only
        what is not written here is cleared."""
        begin = time.perf_counter()
        rank, max_rank = adapter.rank, self.max_rank
        codes = self._codes.get(adapter.name, {})
        for index, modules in enumerate(adapter.layers):
            for kind, parts in FUSED_PROJECTIONS.items():
                width = self.width[kind]
                a, bt, scales = self.a[index][kind], self.bt[index][kind], self.scales[index][kind]
                column = 0
                for part, module in enumerate(parts):
                    out_features = self.out_features[module]
                    pair = modules.get(module)
                    first, b_first = slot * width + part * max_rank, slot * max_rank
                    filled = 0 if pair is None else rank
                    if pair is not None and self.quantized:
                        a_codes, bt_codes, row_scales = codes[index, module]
                        a[first:first + rank].copy_(a_codes)
                        bt[b_first:b_first + rank, column:column + out_features].copy_(bt_codes)
                        scales[first:first + rank].copy_(row_scales)
                    elif pair is not None:
                        a[first:first + rank].copy_(pair[0])
                        bt[b_first:b_first + rank, column:column + out_features].copy_(pair[1].T)
                    if filled < max_rank:  # what the slot's previous adapter left there
                        a[first + filled:first + max_rank].zero_()
                        bt[b_first + filled:b_first + max_rank, column:column + out_features].zero_()
                        if self.quantized:
                            scales[first + filled:first + max_rank].zero_()
                    column += out_features
        self._slot_of[adapter.name] = slot
        self.num_loads += 1
        self.load_seconds += time.perf_counter() - begin

    def batch(self, token_slots: np.ndarray) -> LoRABatch | None:
        """The step's products for tokens in slots `token_slots` ([T], -1 for the base model), or None when
        no token uses an adapter."""
        adapted = token_slots >= 0
        if not adapted.any():
            return None
        return LoRABatch(self, token_slots.astype(np.int64, copy=False), adapted)


class LoRABatch:
    """One step's adapter products: `add_(out, x, layer, kind)` adds each row's adapter output to `out`."""

    def __init__(self, slots: AdapterSlots, token_slots: np.ndarray, adapted: np.ndarray) -> None:
        self.slots = slots
        self.kernel = slots.kernel
        self.token_slots = torch.from_numpy(np.ascontiguousarray(token_slots))
        self.lo = int(token_slots[adapted].min())
        self.hi = int(token_slots[adapted].max()) + 1
        self._adapted = adapted
        self._onehot: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}  # by rank columns per slot

    def _mask(self, width: int) -> torch.Tensor:
        """Each row's own slot's rank columns (of the used slots'), as a 0/1 mask."""
        mask = self._masks.get(width)
        if mask is None:
            if self._onehot is None:
                slots = self.token_slots.numpy()
                onehot = np.zeros((len(slots), self.hi - self.lo), dtype=np.float32)
                rows = np.flatnonzero(self._adapted)
                onehot[rows, slots[rows] - self.lo] = 1.0
                device = self.slots.a[0]["qkv"].device if self.slots.a else "cpu"
                self._onehot = torch.from_numpy(onehot).to(device=device, dtype=self.compute_dtype)
            mask = self._masks[width] = self._onehot.repeat_interleave(width, dim=1)
        return mask

    @property
    def compute_dtype(self) -> torch.dtype:
        """The PyTorch path's dtype: the slots', or float32 for int8 slots (their codes times the scales)."""
        return torch.float32 if self.slots.quantized else self.slots.dtype

    @property
    def native(self) -> bool:
        """Whether the native kernel runs this step's products (so `decode_layers` can add them in its loop)."""
        return self.kernel is not None and self.slots.dtype in _SLOT_DTYPES

    def decode_arguments(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor,
                                        list[int], list[list[int]]]:
        """The adapter arguments of `decode_layers` (csrc/decode_layers.cpp's `StepAdapters`): per projection
        the stacked A and B^T (and int8 slots' scales), the token slots, per kind the width and the parts'
        column bounds."""
        slots = self.slots
        kinds = list(FUSED_PROJECTIONS)
        return (slots.flat_a, slots.flat_bt, slots.flat_scales, self.token_slots,
                [slots.width[kind] for kind in kinds], [slots.part_columns[kind] for kind in kinds])

    def add_(self, out: torch.Tensor, x: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """out [T, out] += each row's adapter's x @ A.T @ B.T for projection `kind` of `layer`; returns
        out."""
        if self.native and out.is_contiguous() and out.dtype in _KERNEL_DTYPES and x.dtype in _KERNEL_DTYPES:
            assert self.kernel is not None
            scales = self.slots.scales[layer][kind] if self.slots.quantized else _NO_SCALES
            self.kernel.lora_sgmv(out, x.contiguous(), self.slots.a[layer][kind], self.slots.bt[layer][kind], scales,
                                  self.token_slots, self.slots.width[kind], self.slots.part_columns[kind])
            return out
        return self.add_reference_(out, x, layer, kind)

    def add_reference_(self, out: torch.Tensor, x: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
        """`add_` in PyTorch ops: x @ A.T over the used slots, masked to each row's own slot, then per part
        its rank columns @ its part of the folded B^T."""
        slots, width, rank = self.slots, self.slots.width[kind], self.slots.max_rank
        dtype = self.compute_dtype
        a = slots.a[layer][kind][self.lo * width:self.hi * width].to(dtype)
        bt = slots.bt[layer][kind][self.lo * rank:self.hi * rank].to(dtype)
        shrunk = torch.mm(x.to(dtype), a.T)
        if slots.quantized:
            shrunk.mul_(slots.scales[layer][kind][self.lo * width:self.hi * width])
        shrunk.mul_(self._mask(width))
        columns = slots.part_columns[kind]
        parts = shrunk.view(len(shrunk), self.hi - self.lo, len(columns) - 1, rank)
        for part, (first, end) in enumerate(zip(columns, columns[1:])):
            product = torch.mm(parts[:, :, part].reshape(len(shrunk), -1), bt[:, first:end])
            out[:, first:end] += product
        return out

    def for_layer(self, layer: int) -> LayerLoRA:
        return LayerLoRA(self, layer)


class LayerLoRA:
    """A step's adapter products for one layer: called as `(out, x, kind)` after a projection."""

    __slots__ = ("batch", "layer")

    def __init__(self, batch: LoRABatch, layer: int) -> None:
        self.batch, self.layer = batch, layer

    def __call__(self, out: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
        return self.batch.add_(out, x, self.layer, kind)
