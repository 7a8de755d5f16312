"""Moved to `tokenloop.observe` (tracer, traces, exports, dashboard); this name keeps old imports working."""

from tokenloop.observe.exports import (
    MECHANISM_TARGETS,
    STATE_LABELS,
    Segment,
    request_timeline,
    to_chrome_trace,
    to_mechanism,
)
from tokenloop.observe.tracer import Tracer
from tokenloop.observe.traces import (
    STAGES,
    ChunkTrace,
    IterationTrace,
    ReleaseTrace,
    RequestEvent,
    RequestSummary,
    RequestTrace,
)

__all__ = ["MECHANISM_TARGETS", "STAGES", "STATE_LABELS", "ChunkTrace", "IterationTrace", "ReleaseTrace",
           "RequestEvent", "RequestSummary", "RequestTrace", "Segment", "Tracer", "request_timeline",
           "to_chrome_trace", "to_mechanism"]
