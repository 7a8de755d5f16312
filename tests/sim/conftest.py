"""Every simulator test caches calibrated profiles in its own temporary directory, never ~/.cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenloop.sim.profiles import CACHE_ENV


@pytest.fixture(autouse=True)
def profile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "tokenloop-cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    return cache / "profiles"
