"""The simulator: the real scheduler, KV cache and sampler on a virtual clock, priced by a cost model."""
