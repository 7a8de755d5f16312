"""The engine core's wire format: every message type survives encode -> decode unchanged."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloop.core import wire
from tokenloop.core.messages import CoreError, CoreFrame, CoreOutput, CoreOutputs
from tokenloop.core.scheduler import SchedulerStats
from tokenloop.errors import CapacityError, InvalidRequestError, RequestFailedError
from tokenloop.logprobs import TokenLogprobs
from tokenloop.observe.records import ScheduledChunk, StepGauges, StepRecord
from tokenloop.request import SamplingParams
from tokenloop.structured.spec import StructuredOutputsParams

_ints = st.integers(-2 ** 53, 2 ** 53)
_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
_text = st.text(max_size=6)

_structured = st.one_of(
    st.builds(StructuredOutputsParams, regex=st.just("[a-z]+")),
    st.builds(StructuredOutputsParams, choice=st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3)),
    st.builds(StructuredOutputsParams, json=st.just({"type": "object", "properties": {"a": {"type": "integer"}}})),
    st.builds(StructuredOutputsParams, json_object=st.just(True)),
)
_sampling = st.builds(
    SamplingParams, n=st.integers(1, 4), temperature=st.floats(0, 2), top_p=st.floats(0.01, 1),
    top_k=st.integers(0, 50), seed=st.none() | st.integers(0, 2 ** 63 - 1), max_tokens=st.none() | st.integers(20, 99),
    min_tokens=st.integers(0, 19), stop=st.lists(st.text(min_size=1, max_size=4), max_size=2),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3), logprobs=st.none() | st.integers(0, 20),
    logit_bias=st.none() | st.dictionaries(st.integers(0, 1000), st.floats(-100, 100), max_size=3),
    structured_outputs=st.none() | _structured)


def _strategy(hint: Any, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of any type the wire types' fields use, derived from the type hints."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is SamplingParams:
        return _sampling
    if hint is StructuredOutputsParams:
        return _structured
    if hint is Any:
        return st.none() | _ints | _text | st.builds(SchedulerStats, *[_ints] * 4, _floats, *[_ints] * 4)
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        fields = [f for f in dataclasses.fields(hint) if f.init]
        return st.builds(hint, *[_strategy(hints[f.name], depth + 1) for f in fields])
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_strategy(a, depth) for a in args])
    if origin is list:
        return st.lists(_strategy(args[0], depth + 1), max_size=3 if depth < 3 else 1)
    if origin is tuple:
        return st.tuples(*[_strategy(a, depth + 1) for a in args])
    if origin is dict:
        return st.dictionaries(_strategy(args[0], depth + 1), _strategy(args[1], depth + 1), max_size=2)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):  # a status, a finish reason
        return st.sampled_from(list(hint))
    return {int: _ints, float: _floats, str: _text, bool: st.booleans(), bytes: st.binary(max_size=16),
            type(None): st.none()}[hint]


@pytest.mark.parametrize("cls", wire.WIRE_TYPES, ids=lambda c: c.__name__)
def test_every_wire_type_round_trips(cls: type) -> None:
    @settings(max_examples=40, deadline=None)
    @given(_strategy(cls))
    def round_trip(message: Any) -> None:
        again = wire.decode(wire.encode(message))
        assert type(again) is cls and again == message

    round_trip()


def test_a_batch_keeps_its_order() -> None:
    messages = [wire.WIRE_TYPES[3](), CoreError("X", "y"), TokenLogprobs(1, -0.5, 1, [(1, -0.5), (7, -2.0)])]
    assert wire.decode_batch(wire.encode_batch(messages)) == messages


def test_tuples_come_back_as_tuples() -> None:
    lp = wire.decode(wire.encode(TokenLogprobs(3, -1.0, 2, [(3, -1.0)])))
    assert isinstance(lp.top[0], tuple)
    spec = wire.decode(wire.encode(StructuredOutputsParams(choice=("a", "b"))))
    assert spec.choice == ("a", "b")


def test_errors_come_back_as_the_same_class() -> None:
    invalid = wire.error_from_wire(wire.error_to_wire(InvalidRequestError("bad n", param="n")))
    assert isinstance(invalid, InvalidRequestError) and invalid.param == "n" and str(invalid) == "bad n"
    full = wire.error_from_wire(wire.error_to_wire(CapacityError("full", retry_after_s=2.5)))
    assert isinstance(full, CapacityError) and full.retry_after_s == 2.5
    other = wire.error_from_wire(wire.error_to_wire(ZeroDivisionError("boom")))
    assert isinstance(other, RequestFailedError) and "ZeroDivisionError" in str(other)


def test_a_step_frame_is_compact() -> None:
    """Arrays, not dicts: field names never travel."""
    gauges = StepGauges(1, 2, 0, 64, 4, 60, 0, 10, 5, 0, 0)
    chunk = ScheduledChunk("req-1", 10, 1, 8, True, [], 0, 0, False, 3)
    record = StepRecord(1, 0, 1, 2, 3, 4, 0, 1, 0, 1, [chunk], [], ["req-1"], [5], [], gauges)
    frame = CoreFrame(CoreOutputs([CoreOutput("req-1", [5])], 3, 1, record), [])
    data = wire.encode(frame)
    assert b"request_id" not in data and b"new_token_ids" not in data
    assert wire.decode(data) == frame


def test_kv_event_batches_keep_each_event_kind() -> None:
    from tokenloop.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    batch = KVEventBatch(3, 5, [BlockStored([1, 2], None, [1, 2, 3, 4], 2), BlockRemoved([9]), AllBlocksCleared(),
                                BlockStored([3], 2, [5, 6], 2)])
    out = CoreOutputs([], 1, 0, kv_events=batch)
    assert wire.decode(wire.encode(out)) == out
