"""Stop strings over streamed text: text that may be the start of a stop string is held back until
it is known not to be one, and nothing from the stop string on is ever emitted."""


class StopStringMatcher:
    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.held = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was reached)."""
        if self.stopped:
            return "", True
        if not self.stop:
            return text, False
        self.held += text
        first = min((i for i in (self.held.find(s) for s in self.stop) if i >= 0), default=-1)
        if first >= 0:
            emit, self.held, self.stopped = self.held[:first], "", True
            return emit, True
        keep = max((self._partial_suffix(s) for s in self.stop), default=0)
        emit = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return emit, False

    def flush(self) -> str:
        """At the end of the stream: the held text was not a stop string after all."""
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, stop: str) -> int:
        """Length of the longest suffix of the held text that is a proper prefix of stop."""
        for length in range(min(len(stop) - 1, len(self.held)), 0, -1):
            if self.held.endswith(stop[:length]):
                return length
        return 0
