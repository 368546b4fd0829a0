"""``StopMatcher``: finds the first stop string in generated text that arrives in pieces.

A request may name a few stop strings (OpenAI's ``stop``). Generation ends as soon as
its text contains one of them, and the answer holds only the text before it (before
the earliest one, when the same piece completes several). Text
reaches the matcher one token's delta at a time, so a stop string may be split across
deltas; the matcher holds back the end of the text that could still be the start of a
stop string until the next delta decides::

    matcher = StopMatcher(["\\n\\n", "END"])
    matcher.feed("Hello E")   -> ("Hello ", False)    # "E" might begin "END": held back
    matcher.feed("ND more")   -> ("", True)           # "END" found: nothing after it
    matcher.flush()           -> ""                   # held text, at the natural end

A synchronous state machine with no clock and no I/O; one per generated choice.
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops: tuple[str, ...] = tuple(s for s in stops if s)
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        #: True once a stop string was found; every later feed returns ("", True)
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """The text that can be handed on now, and whether a stop string was reached."""
        if self.stopped:
            return "", True
        text = self._held + delta
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            self._held = ""
            return text[:min(found)], True
        keep = self._open_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, when generation ended without reaching a stop string."""
        held, self._held = self._held, ""
        return held

    def _open_tail(self, text: str) -> int:
        """Length of the longest end of ``text`` that some stop string begins with."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
