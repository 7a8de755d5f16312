"""The KV pool: per layer, K and V of [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_cpu_pool(num_elements: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of zeros in anonymous memory: the kernel maps in a zeroed page the first time one is
    written, so the pool costs nothing at startup (torch.zeros writes every page: 0.9-2.5 s for 1 GiB on
    this VM, where first-touched memory is slow) and its pages become resident as blocks are first used.
    The tensor keeps the mapping alive."""
    if num_elements == 0:
        return torch.zeros(0, dtype=dtype)
    element_size = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, num_elements * element_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                            dtype=dtype, count=num_elements)


def allocate_kv_cache(num_layers: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) of `shape`, zeroed (a path that gathers whole blocks reads slots not yet written;
    masked, they must still be finite). On the CPU all of them are views of one lazily mapped pool."""
    if device.type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]
    pool = zeroed_cpu_pool(2 * num_layers * math.prod(shape), dtype)
    caches = pool.view(num_layers, 2, *shape)
    return [(caches[i, 0], caches[i, 1]) for i in range(num_layers)]


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """K and V bytes one block holds over every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element
