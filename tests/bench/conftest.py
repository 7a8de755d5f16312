"""Fixtures for the benchmark harness: the tiny model's checkpoint and crafted traces."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenloop.bench.trace import TraceRequest
from tokenloop.model.loader import Checkpoint, load_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_model_dir: Path) -> Checkpoint:
    return load_checkpoint(str(tiny_model_dir))


def crafted(index: int, arrival_s: float, *, user: str = "a", priority: int = 0, max_tokens: int = 4,
            prompt_len: int = 8) -> TraceRequest:
    """A request with its own prompt (no prefix sharing), ids valid for the tiny vocabulary."""
    return TraceRequest(id=f"r{index}", arrival_s=arrival_s, max_tokens=max_tokens,
                        prompt_tokens=tuple(range(10 + index, 10 + index + prompt_len)), priority=priority,
                        user=user)
