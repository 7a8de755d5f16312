"""Structured outputs: grammar compilation cache, per-request matchers, tool-call parsing.

Only the spec is imported here (it travels in SamplingParams); the grammar engine (llguidance) is
loaded when the first constrained request arrives, so unconstrained serving never pays for it.
"""

from tokenloop.structured.spec import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
