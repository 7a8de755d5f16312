"""The engine core's wire format: msgpack, one frame per batch of messages.

A dataclass travels as an array of its init fields in declaration order (no field names: the two ends
run the same code), a top-level message as `[tag, fields]`. One `DataclassCodec` per class is derived
from its type hints: fields of plain types (ints, strings, lists of them, dicts) pass through untouched,
so msgpack's C code does the work; only nested dataclasses, tuples and `Any` need Python on the way.

    frame = encode(core_frame)          # bytes
    core_frame = decode(frame)          # a CoreFrame again
    frame = encode_batch(messages)      # the front end's input: one frame per wakeup
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

import tokenloop.errors as errors
from tokenloop.core.handoff import ImportResult, KVBlockData, KVSnapshot, RequestState
from tokenloop.core.messages import (
    AddRequests,
    CallResult,
    CoreError,
    CoreFrame,
    CoreHeartbeat,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    CoreRequest,
    FinishRequests,
    Shutdown,
    UtilityCall,
)
from tokenloop.core.scheduler import SchedulerStats
from tokenloop.logprobs import TokenLogprobs
from tokenloop.observe.records import (
    ArrivalRecord,
    ReleaseInfo,
    ScheduledChunk,
    StepGauges,
    StepRecord,
)
from tokenloop.request import SamplingParams
from tokenloop.structured.spec import StructuredOutputsParams

# The tag of each class is its index here: append only, both ends must agree.
WIRE_TYPES: tuple[type, ...] = (
    AddRequests, FinishRequests, UtilityCall, Shutdown, CallResult, CoreError, CoreReady, CoreFrame,
    CoreRequest, SamplingParams, StructuredOutputsParams, CoreOutputs, CoreOutput, TokenLogprobs,
    StepRecord, ScheduledChunk, ReleaseInfo, StepGauges, ArrivalRecord, SchedulerStats,
    KVBlockData, RequestState, KVSnapshot, ImportResult, CoreHeartbeat,
)
_ANY_EXT = 1  # msgpack ext code of a dataclass inside an `Any` field (a utility's result)

Convert = Callable[[Any], Any]


class DataclassCodec:
    """Packs one dataclass as the array of its init fields, and unpacks it by calling the class."""

    def __init__(self, cls: type, codecs: dict[type, DataclassCodec]) -> None:
        self.cls = cls
        codecs[cls] = self  # before the fields: a class may refer to itself
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        self.names = names
        getter = operator.attrgetter(*names) if names else (lambda obj: ())
        self._get: Callable[[Any], tuple[Any, ...]] = (
            getter if len(names) != 1 else (lambda obj: (getter(obj),)))
        self._encoders: list[tuple[int, Convert]] = []
        self._decoders: list[tuple[int, Convert]] = []
        for index, name in enumerate(names):
            encode, decode = _converters(hints[name], codecs)
            if encode is not None:
                self._encoders.append((index, encode))
            if decode is not None:
                self._decoders.append((index, decode))

    def encode(self, obj: Any) -> Any:
        values = self._get(obj)
        if not self._encoders:
            return values  # msgpack packs a tuple as an array
        row = list(values)
        for index, encode in self._encoders:
            value = row[index]
            if value is not None:  # None travels as it is (inlined: the hot fields are mostly None)
                row[index] = encode(value)
        return row

    def decode(self, values: list[Any]) -> Any:
        for index, decode in self._decoders:
            value = values[index]
            if value is not None:
                values[index] = decode(value)
        return self.cls(*values)


def _converters(hint: Any, codecs: dict[type, DataclassCodec]) -> tuple[Convert | None, Convert | None]:
    """(encode, decode) for values of type `hint`; None where the value travels as it is."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return _encode_any, None  # the ext hook decodes it
    if dataclasses.is_dataclass(hint):
        codec = codecs.get(hint) or DataclassCodec(hint, codecs)  # type: ignore[arg-type]
        return codec.encode, codec.decode
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        converters = [_converters(a, codecs) for a in options]
        if all(e is None and d is None for e, d in converters):
            return None, None
        if len(options) > 1 and all(dataclasses.is_dataclass(a) for a in options):
            return _union_codec(options, codecs)  # e.g. the kinds of KV event: [which, fields]
        if len(options) != 1:
            raise TypeError(f"wire: a union of several converted types is ambiguous: {hint}")
        return converters[0]  # None is never converted (see DataclassCodec)
    if origin is list:
        encode, decode = _converters(args[0], codecs) if args else (None, None)
        optional = bool(args) and type(None) in typing.get_args(args[0])
        return _each(encode, optional), _each(decode, optional)
    if origin is tuple:
        inner = [_converters(a, codecs) for a in args if a is not Ellipsis]
        if any(e is not None or d is not None for e, d in inner):
            raise TypeError(f"wire: tuples of converted types are not supported: {hint}")
        return None, tuple
    if origin is dict:  # plain keys and values only (logit_bias, a JSON schema)
        return None, None
    if hint in (int, float, str, bool, bytes, type(None)):
        return None, None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):  # by value: a status, a finish reason
        # A str enum packs as its string already (and a plain string of a member's value passes too).
        return (None if issubclass(hint, str) else _ENUM_VALUE), hint
    raise TypeError(f"wire: no encoding for {hint!r}")


_ENUM_VALUE = operator.attrgetter("value")


def _union_codec(options: list[Any], codecs: dict[type, DataclassCodec]) -> tuple[Convert, Convert]:
    """A value of one of several dataclasses, as [its index among them, its fields]."""
    members = [codecs.get(cls) or DataclassCodec(cls, codecs) for cls in options]
    index = {cls: i for i, cls in enumerate(options)}

    def encode(value: Any) -> Any:
        which = index[type(value)]
        return [which, members[which].encode(value)]

    def decode(item: Any) -> Any:
        which, values = item
        return members[which].decode(values)

    return encode, decode


def _each(convert: Convert | None, optional: bool) -> Convert | None:
    if convert is None:
        return None
    if optional:
        return lambda v: [None if x is None else convert(x) for x in v]
    return lambda v: [convert(x) for x in v]


def _tagged(obj: Any) -> list[Any]:
    tag = _TAG.get(type(obj))
    if tag is None:
        raise TypeError(f"wire: {type(obj).__name__} is not a wire type")
    return [tag, _BY_TAG[tag].encode(obj)]


def _untagged(item: list[Any]) -> Any:
    tag, values = item
    return _BY_TAG[tag].decode(values)


def _encode_any(value: Any) -> Any:
    """Plain values as they are; a wire dataclass (say SchedulerStats) as an ext wrapping its tagged form,
    also inside a list (a handoff's blocks)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return msgpack.ExtType(_ANY_EXT, msgpack.packb(_tagged(value), use_bin_type=True))
    if isinstance(value, (list, tuple)) and any(dataclasses.is_dataclass(item) for item in value):
        return [_encode_any(item) for item in value]
    return value


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _ANY_EXT:
        return _untagged(_unpackb(data))
    return msgpack.ExtType(code, data)


def _unpackb(data: bytes) -> Any:
    # strict_map_key=False: logit_bias is a dict with int keys.
    return msgpack.unpackb(data, use_list=True, strict_map_key=False, ext_hook=_ext_hook)


_CODECS: dict[type, DataclassCodec] = {}
for _cls in WIRE_TYPES:
    if _cls not in _CODECS:
        DataclassCodec(_cls, _CODECS)
_TAG = {cls: tag for tag, cls in enumerate(WIRE_TYPES)}
_BY_TAG = [_CODECS[cls] for cls in WIRE_TYPES]


def encode(message: Any) -> bytes:
    """One message (a wire dataclass) as one msgpack frame."""
    return msgpack.packb(_tagged(message), use_bin_type=True)


def decode(frame: bytes) -> Any:
    return _untagged(_unpackb(frame))


def encode_batch(messages: Sequence[Any]) -> bytes:
    """Several messages as one frame, applied in order at the other end."""
    return msgpack.packb([_tagged(m) for m in messages], use_bin_type=True)


class UnsendableMessages(Exception):
    """Messages of a batch that could not be encoded (a value msgpack cannot hold); the rest were sent.
    Each failure is the message and why, for the front end to answer its submitter alone."""

    def __init__(self, failures: list[tuple[Any, BaseException]]) -> None:
        super().__init__(f"{len(failures)} message(s) could not be encoded: {failures[0][1]!r}")
        self.failures = failures


def encode_sendable(messages: Sequence[Any]) -> tuple[bytes | None, list[tuple[Any, BaseException]]]:
    """The frame of every message that encodes (None if none does), and those that do not, with why.
    One message's unencodable value never costs the others their delivery."""
    try:
        return encode_batch(messages), []
    except (TypeError, ValueError, OverflowError) as first:  # the rare path: find the culprits one by one
        good: list[Any] = []
        failures: list[tuple[Any, BaseException]] = []
        for message in messages:
            try:
                encode(message)
                good.append(message)
            except (TypeError, ValueError, OverflowError) as exc:
                failures.append((message, exc))
        if not failures:  # not one message's fault after all
            raise first
        return (encode_batch(good) if good else None), failures


def decode_batch(frame: bytes) -> list[Any]:
    return [_untagged(item) for item in _unpackb(frame)]


def error_to_wire(exc: BaseException) -> CoreError:
    """An exception raised in the core as data (its class name, text and the fields the server maps)."""
    return CoreError(type(exc).__name__, str(exc), getattr(exc, "param", None),
                     getattr(exc, "retry_after_s", None))


def error_from_wire(error: CoreError) -> Exception:
    """The same exception class again where tokenloop defines it; a RequestFailedError otherwise."""
    cls = getattr(errors, error.kind, None)
    if cls is errors.InvalidRequestError:
        return errors.InvalidRequestError(error.message, param=error.param)
    if cls is errors.CapacityError:
        return errors.CapacityError(error.message, retry_after_s=error.retry_after_s or 1.0)
    if isinstance(cls, type) and issubclass(cls, errors.TokenloopError):
        return cls(error.message)
    return errors.RequestFailedError(f"the engine core raised {error.kind}: {error.message}")
