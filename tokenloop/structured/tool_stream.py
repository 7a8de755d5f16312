"""Streaming tool calls: text deltas in, content deltas and OpenAI-style tool-call deltas out.

As OpenAI streams them, a call's first delta carries its index, id, type and name, and later deltas add
pieces of `arguments`. A named function's output is its arguments, so each text delta is forwarded as
an arguments piece at once; `"auto"` holds back text that may be the start of `<tool_call>` and emits a
call when its block closes; `"required"` output is one JSON array, emitted when it is complete.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloop.structured.tool_calls import CLOSE_TAG, OPEN_TAG, ParsedCall, ToolChoice, _call_from_json, parse_output


@dataclass(frozen=True)
class ContentPiece:
    text: str


@dataclass(frozen=True)
class CallPiece:
    """A piece of call `index`: `id` and `name` only on its first piece."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


StreamEvent = ContentPiece | CallPiece


class ToolCallStream:
    """Turns one choice's text deltas into stream events under its tool choice."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.num_calls = 0
        self._buffer = ""  # text not yet emitted
        self._in_call = False
        self._named: ParsedCall | None = None

    def feed(self, delta: str) -> list[StreamEvent]:
        mode = self.choice.mode
        if not delta:
            return []
        if mode == "none":
            return [ContentPiece(delta)]
        if mode == "named":
            if self._named is None:
                self._named = ParsedCall(self.choice.name or "", "")
                self.num_calls = 1
                return [CallPiece(0, delta, self._named.id, self._named.name)]
            return [CallPiece(0, delta)]
        self._buffer += delta
        return [] if mode == "required" else self._scan()

    def finish(self) -> list[StreamEvent]:
        """What is left when the generation ended (a call cut short, held-back text)."""
        mode = self.choice.mode
        if mode == "named":
            if self._named is None:
                self._named = ParsedCall(self.choice.name or "", "")
                self.num_calls = 1
                return [CallPiece(0, "", self._named.id, self._named.name)]
            return []
        if mode == "required":
            content, calls = parse_output(self._buffer, self.choice)
            self._buffer = ""
            return self._calls(calls) + ([ContentPiece(content)] if content else [])
        events: list[StreamEvent] = []
        if self._in_call:
            call = _call_from_json(self._buffer.strip())
            if call is not None:
                events += self._calls([call])
            else:
                events.append(ContentPiece(OPEN_TAG + self._buffer))
        elif self._buffer:
            events.append(ContentPiece(self._buffer))
        self._buffer, self._in_call = "", False
        return events

    def _calls(self, calls: list[ParsedCall]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for call in calls:
            events.append(CallPiece(self.num_calls, call.arguments, call.id, call.name))
            self.num_calls += 1
        return events

    def _scan(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE_TAG)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG):]
                self._in_call = False
                call = _call_from_json(body.strip())
                if call is not None:
                    events += self._calls([call])
                else:  # not a call after all: show it as the text it was
                    events.append(ContentPiece(OPEN_TAG + body + CLOSE_TAG))
                continue
            start = self._buffer.find(OPEN_TAG)
            if start >= 0:
                if start:
                    events.append(ContentPiece(self._buffer[:start]))
                self._buffer = self._buffer[start + len(OPEN_TAG):]
                self._in_call = True
                continue
            # Hold back a tail that could still grow into the opening tag.
            keep = next((k for k in range(min(len(OPEN_TAG) - 1, len(self._buffer)), 0, -1)
                         if OPEN_TAG.startswith(self._buffer[-k:])), 0)
            cut = len(self._buffer) - keep
            if cut:
                events.append(ContentPiece(self._buffer[:cut]))
                self._buffer = self._buffer[cut:]
            return events
