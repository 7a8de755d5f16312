"""`IncrementalDetokenizer`: a request's output tokens as text deltas, as they are sampled.

It never emits half a UTF-8 character and holds back text that may turn out to be the start of a stop
string.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenloop.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for bytes that are not (yet) a whole UTF-8 character
# An unfinished UTF-8 character has at most 3 of its 4 bytes, and every token carries at least one
# byte, so only the last 3 tokens can still change; invalid bytes before them are final (U+FFFD).
_MAX_UNFINISHED_TOKENS = 3

# Prompt tokens decoded along with the first output tokens, so a leading space or a character
# completed by the output decodes the way it would inside the whole text.
_PROMPT_CONTEXT_TOKENS = 5


@dataclass(frozen=True)
class DetokenizerUpdate:
    """What one `IncrementalDetokenizer.update` produced: new text, and the stop string if one matched."""

    text_delta: str
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Streams one request's output tokens as text, UTF-8 safe and stop-string aware.

    Decoding uses a small window of recent tokens: `_prefix_offset` marks where the window starts and
    `_read_offset` where the already-consumed tokens end, so each step decodes a handful of tokens
    rather than the whole output. Decoding from a token before the new ones keeps leading spaces and
    SentencePiece's stripped prefix right. A trailing U+FFFD run (an incomplete character) is held
    until later tokens complete it; text that may be the start of a stop string is held until it
    either becomes one (the output is cut there) or cannot any more.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in (stop or ()) if s]  # an empty stop string would match everywhere
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self._ids else ""
        self._window_emitted = 0  # chars of the current window, past the prefix text, already consumed
        self._pending = ""  # decoded text held back as a possible stop-string start
        self._chunks: list[str] = []
        self._num_taken = 0  # chunks already handed out by take_new_text
        self._text = ""
        self._text_stale = False
        self.stop_string: str | None = None  # the stop string that ended the output, if any
        self._done = False

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta)."""
        if self._text_stale:
            self._text = "".join(self._chunks)
            self._text_stale = False
        return self._text

    @property
    def output_text(self) -> str:
        """Same as `text`."""
        return self.text

    def take_new_text(self) -> str:
        """Text emitted since the last call (O(new text): no join of everything so far)."""
        new = "".join(self._chunks[self._num_taken:])
        self._num_taken = len(self._chunks)
        return new

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; later tokens produce no text."""
        return self.stop_string is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            self._text_stale = True
        return text

    def _decode_new_text(self) -> str:
        """Text the window gained since the last call, minus a trailing incomplete character."""
        text = self._decode(self._ids[self._prefix_offset:])
        base = len(self._prefix_text)
        end = len(text)
        if end > base and text[end - 1] == REPLACEMENT_CHAR:
            end = self._stable_length(base)
        start = base + self._window_emitted
        new_text = text[start:end] if end > start else ""
        if end == len(text) and end > base:
            # Window decoded cleanly: slide it so the next decode starts at the tokens just consumed.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self._window_emitted = 0
        elif end > start:
            self._window_emitted = end - base
        return new_text

    def _stable_length(self, base: int) -> int:
        """Length of the window's text that no later token can change, when it ends in U+FFFD.

        The unfinished character lies in the last few tokens: drop the fewest (at most 3) that leave a
        clean text. If even 3 leave U+FFFD at the end, those bytes can never complete: they are final.
        """
        window = self._ids[self._prefix_offset:]
        head = ""
        for drop in range(1, min(_MAX_UNFINISHED_TOKENS, len(window)) + 1):
            head = self._decode(window[:-drop])
            if not head.endswith(REPLACEMENT_CHAR):
                break
        return max(base, len(head))

    def update(self, new_token_ids: Sequence[int], check_stop: bool = True) -> DetokenizerUpdate:
        """Feed newly sampled tokens; returns the text that is now safe to emit and any stop string hit.

        With `check_stop=False` (e.g. before min_tokens), stop strings are neither matched nor held back.
        """
        if self._done or self.stopped:
            return DetokenizerUpdate("")
        self._ids.extend(new_token_ids)
        self._pending += self._decode_new_text()
        if not self._pending:
            return DetokenizerUpdate("")
        hold = 0
        if check_stop and self._stop:
            match = self._find_stop()
            if match is not None:
                index, stop = match
                cut = index + len(stop) if self._include_stop else index
                delta = self._pending[:cut]
                self._pending = ""  # text after a stop string is never emitted
                self.stop_string = stop
                return DetokenizerUpdate(self._emit(delta), stop)
            hold = self._stop_prefix_length()
        cut = len(self._pending) - hold
        delta, self._pending = self._pending[:cut], self._pending[cut:]
        return DetokenizerUpdate(self._emit(delta))

    def _find_stop(self) -> tuple[int, str] | None:
        """The stop string that completes first in the pending text (ties: the one starting first)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            index = self._pending.find(stop)
            if index >= 0:
                key = (index + len(stop), index, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return (best[1], best[2]) if best is not None else None

    def _stop_prefix_length(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def finish(self) -> str:
        """Flush held-back text (stop-string prefixes, incomplete characters as U+FFFD) at request end.

        Returns the flushed text (also appended to `text`); later updates emit nothing.
        """
        if self._done or self.stopped:
            self._done = True
            return ""
        self._done = True
        text = self._decode(self._ids[self._prefix_offset:])
        tail = text[len(self._prefix_text) + self._window_emitted:]
        flushed, self._pending = self._pending + tail, ""
        return self._emit(flushed)
