"""Moved to `tokenloop.observe.metrics`; this name keeps old imports working."""

from tokenloop.observe.metrics import CONTENT_TYPE, PREFIX, EngineMetrics

__all__ = ["CONTENT_TYPE", "PREFIX", "EngineMetrics"]
