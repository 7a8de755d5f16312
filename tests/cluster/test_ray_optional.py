"""Ray is optional: the cluster's Ray module imports without it and says how to install it when asked."""

from __future__ import annotations

import sys

import pytest

from tokenloop.errors import ConfigError


def test_without_ray_it_imports_and_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError, as if not installed
    for module in ("tokenloop.cluster.ray_replica", "tokenloop.cluster.ray_actor"):  # imported afresh
        monkeypatch.delitem(sys.modules, module, raising=False)
    from tokenloop.cluster.ray_replica import start_ray

    with pytest.raises(ConfigError, match=r"pip install 'tokenloop\[ray\]'"):
        start_ray(None)
