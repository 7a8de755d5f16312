"""Benchmark harness: load generation against a server, request traces, policy replays and reports."""
