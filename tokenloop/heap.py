"""The garbage collector's settings for a long-running process (the engine core, the API server).

What exists once a process is ready to serve (the model, the tokenizer, the web framework, the pool) lives
as long as the process: frozen out of the collector's sight, a full collection no longer walks it. And
collections come rarer: a full collection walks every tracked object (each running request's token lists
in the core; each message of a large request body in the API server), so at CPython's default thresholds a
request of 100,000 chat messages set off full collections of 90-150 ms in the API server, each one a stall
of every stream and of /health (vLLM freezes its startup heap the same way).
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (20_000, 20, 100)  # CPython's defaults: (700, 10, 10)


def settle_startup_heap() -> None:
    """Collect once, freeze what survives, and raise the collection thresholds (call when ready)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
