"""Stop strings (OpenAI's `stop`): a reply ends before the first of them, and no part of one is ever
handed on, streamed or not. Pure text work, run on each piece as the engine loop streams it."""

from __future__ import annotations

from collections.abc import Callable

from floe.server.protocol import ServeError

MAX_STOPS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # each; the text held back while streaming is at most this long


def checked_stops(value) -> tuple[str, ...]:
    """`stop` as a request gives it (None, a string, a list of up to MAX_STOPS), as a tuple; a
    ServeError (400, param "stop") for anything else, an empty string among them too."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) for s in stops):
        raise ServeError(400, f"stop: a string or a list of at most {MAX_STOPS} strings", param="stop")
    for s in stops:
        if not 0 < len(s) <= MAX_STOP_CHARS:
            raise ServeError(400, f"stop: each stop string has 1 to {MAX_STOP_CHARS} characters",
                             param="stop")
        try:
            s.encode()
        except UnicodeEncodeError as e:
            raise ServeError(400, f"stop: not valid Unicode text ({e.reason})", param="stop") from None
    return tuple(dict.fromkeys(stops))


class StopText:
    """A reply's text as it arrives, cut before the first stop string. `take(piece)` returns what may
    be handed on now: never a character that could begin a stop string (held back until the text
    shows it does not), nothing once one matched; `rest()` the held text once the reply ends."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.longest = max(map(len, stops), default=0)
        self._text = ""  # the reply so far (up to the stop once one matched)
        self._pieces: list[str] = []  # without stops: the pieces (joined once: += grew it at every one)
        self.sent = 0  # characters of it handed on
        self.matched = False

    @property
    def text(self) -> str:
        """The reply so far (up to the stop once one matched)."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._pieces.clear()
        self._text = value

    def take(self, piece: str) -> str:
        if self.matched:
            return ""
        if not self.stops:
            self._pieces.append(piece)
            self.sent += len(piece)
            return piece
        # No stop lies inside the text before this piece (it was searched): one can only end in it.
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        found = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if found:
            self.text, self.matched = self.text[:min(found)], True
            return self._hand_on(len(self.text))
        return self._hand_on(len(self.text) - self._held())

    def emitter(self, actor, on_text: Callable[[str], None] | None,
                should_stop: Callable[[], bool]) -> Callable[[str], None]:
        """An actor's on_text for a reply cut here: each piece handed on as take() allows, and the
        actor asked to stop at a stop string or once should_stop() (the client left)."""
        def emit(piece: str) -> None:
            piece = self.take(piece)
            if self.matched or should_stop():
                actor.stop_requested = True
            if piece and on_text is not None:
                on_text(piece)

        return emit

    def rest(self) -> str:
        """At the reply's end: the text still held back (no stop string came)."""
        return self._hand_on(len(self.text))

    def _held(self) -> int:
        """How many final characters could begin a stop string."""
        for k in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _hand_on(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out
