"""A short cluster soak on the tiny model: `tokenloop serve --replicas 2 --failover recompute` under mixed
traffic (hostile, structured, long, disconnecting clients) with a replica core hung and another killed."""

from __future__ import annotations

from pathlib import Path

from tokenloop.bench.soak_cluster import ClusterSoakConfig, run_cluster_soak


def test_cluster_soak_with_a_hang_and_a_kill_has_no_collateral_failure(tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    # The faults wait for requests on their replica, and the recovery for the restart: no clock is raced.
    report = run_cluster_soak(ClusterSoakConfig(
        model=str(tiny_model_dir), num_requests=40, concurrency=6, max_tokens=8, seed=3,
        disconnect_fraction=0.15, hostile_fraction=0.15, structured_fraction=0.2, long_fraction=0.05,
        long_prompt_words=60, hang_timeout_s=2.0, recovery_timeout_s=240.0, log=tmp_path / "server.log"))
    assert report.ok, report.summary()
    assert [f.kind for f in report.faults] == ["hang", "kill"]
    assert all(f.alive_after_s is not None and f.dead_after_s is not None for f in report.faults)
    assert "no heartbeat" in (report.faults[0].death or "") or "no progress" in (report.faults[0].death or "")
    assert not report.collateral
    assert report.outcomes["failed_by_own_fault"] > 0 and report.outcomes["structured_valid"] > 0
    assert report.engine["probe_replica_0"] == report.engine["probe_replica_1"] == 200
    assert report.engine["kv_cache_usage_perc"] == {0: 0.0, 1: 0.0}
