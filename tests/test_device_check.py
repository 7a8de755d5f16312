"""scripts/device_check.py runs end to end on the CPU at tiny sizes, so only its CUDA branches await a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenloop.sim.profiles import load_profile

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.triton]


def test_quick_cpu_run_writes_results_table_and_a_loadable_profile(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)  # the script must switch the interpreter on by itself for --device cpu
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "device_check.py"), "--device", "cpu",
                             "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["triton_interpret"] is True and results["cuda_graphs"].startswith("pending")
    parity = {row["scenario"]: row for row in results["parity"]}
    assert set(parity) == {"batched", "chunked", "prefix-hit", "preempted"}
    assert all(row["identical"] and row["exercised"] for row in parity.values())
    assert parity["prefix-hit"]["prefix_hit_tokens"] > 0 and parity["preempted"]["preemptions"] > 0
    if importlib.util.find_spec("triton") is not None:
        assert results["attention"] and all(row["ok"] for row in results["attention"])
        assert any("32/8x128" in row["case"] for row in results["attention"])
    decode = results["decode"]
    assert {row["batch"] for row in decode} == {1, 8} and all(row["graphs_ms"] == "pending" for row in decode)
    assert all(row["eager_ms"] > 0 and row["bandwidth_gb_s"] > 0 for row in decode)
    assert len(results["prefill"]) == 2 and all(row["tok_s"] > 0 for row in results["prefill"])
    engine = results["engine"]
    assert engine["steps"] > 0 and 0 < engine["forward_share"] <= 1
    profile = load_profile(str(tmp_path / "profile.json"))  # the simulator reads what the script wrote
    assert profile.block_size == 16 and profile.kv_bytes_per_token > 0
    table = (tmp_path / "table.txt").read_text()
    assert "parity" in table and "decode" in table and table in result.stdout
