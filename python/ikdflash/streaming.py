"""From committed tokens to text, as a generation goes: UTF-8 characters split across tokens are
held back until complete, and so is any text that may be the start of a stop string; a stop
string ends the text before it. Engine.speculate(stop=...) and Engine.stream() use it.
"""

from __future__ import annotations

import codecs
import queue
import threading
from typing import Callable, Generic, Iterator, Sequence, TypeVar

Result = TypeVar("Result")  # what the finished generation gives (Engine: a SpeculationResult)


class TextDecoder:
    """Feed it each step's tokens; it returns the text that is now final."""

    def __init__(self, detokenize: Callable[[list[int]], bytes], stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("a stop string cannot be empty")
        self.detokenize = detokenize
        self.stop = list(stop)
        self.tokens: list[int] = []
        self.text = ""             # released so far
        self.stopped: str | None = None  # the stop string found
        self._cut_tokens = 0       # with a stop: the tokens up to the one that completed it

    def feed(self, tokens: Sequence[int], final: bool = False) -> str:
        """The text these tokens complete (maybe ""); after a stop string, always ""."""
        if self.stopped is not None:
            return ""
        self.tokens += tokens
        decoded = self._decode(self.tokens, final)
        hit = self._find_stop(decoded)
        if hit is not None:
            at, self.stopped = hit
            self._cut_tokens = self._tokens_through(at + len(self.stopped))
            return self._release(decoded[:at])
        if not final:
            decoded = decoded[:len(decoded) - self._partial_stop(decoded)]
        return self._release(decoded)

    def finish(self) -> str:
        """The text held back, once the generation has ended."""
        return self.feed([], final=True)

    @property
    def kept_tokens(self) -> list[int]:
        """The tokens the text stands for: with a stop string, up to the token that completed it."""
        return self.tokens[:self._cut_tokens] if self.stopped is not None else self.tokens

    def _decode(self, tokens: list[int], final: bool) -> str:
        # a fresh incremental decoder drops an incomplete character at the end unless final
        return codecs.getincrementaldecoder("utf-8")("replace").decode(self.detokenize(tokens), final=final)

    def _find_stop(self, decoded: str) -> tuple[int, str] | None:
        start = max(0, len(self.text) - max(map(len, self.stop), default=0))
        hits = [(i, s) for s in self.stop if (i := decoded.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _partial_stop(self, decoded: str) -> int:
        """Length of the longest end of decoded that begins a stop string."""
        return max((n for s in self.stop for n in range(1, len(s)) if decoded.endswith(s[:n])), default=0)

    def _tokens_through(self, n_chars: int) -> int:
        for k in range(1, len(self.tokens) + 1):
            if len(self._decode(self.tokens[:k], final=True)) >= n_chars:
                return k
        return len(self.tokens)

    def _release(self, decoded: str) -> str:
        piece = decoded[len(self.text):]
        self.text = decoded
        return piece


class TextStream(Generic[Result]):
    """Iterate for text pieces as the generation commits them; ``result`` holds the whole
    result once the iteration ends. The generation runs in a worker thread; ``close()`` (or
    leaving the iteration early and dropping the stream) ends it after the current step."""

    def __init__(self, run: Callable[[Callable[[list[int]], bool]], object], decoder: TextDecoder,
                 finish: Callable[[object, TextDecoder], Result]) -> None:
        self.result: Result | None = None
        self._decoder, self._finish = decoder, finish
        self._pieces: queue.Queue = queue.Queue()
        self._closed = False  # asked to end early
        self._last: tuple[str, object] | None = None  # the worker's last item, then ("settled", None)

        def on_commit(tokens: list[int]) -> bool:
            piece = decoder.feed(tokens)
            if piece:
                self._pieces.put(("text", piece))
            return decoder.stopped is None and not self._closed

        def work() -> None:
            try:
                self._pieces.put(("done", run(on_commit)))
            except BaseException as e:  # noqa: B036 - handed to the consumer, raised there
                self._pieces.put(("error", e))

        self._thread = threading.Thread(target=work, name="ikdflash-stream", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[str]:
        while self._last is None:
            kind, value = self._pieces.get()
            if kind == "text":
                yield value
            else:
                self._last = (kind, value)  # the worker's last item: nothing more will come
        yield from self._settle()

    def _settle(self) -> Iterator[str]:
        """Once the worker is done: its failure raised (once), or its result made. Interrupted
        before the result is made (Ctrl-C), the next iteration or close() makes it."""
        if self._last is None or self._last[0] == "settled":
            return
        kind, value = self._last
        self._thread.join()
        if kind == "error":
            self._last = ("settled", None)
            assert isinstance(value, BaseException)
            raise value
        released = len(self._decoder.text)
        self.result = self._finish(value, self._decoder)  # releases what was held back
        self._last = ("settled", None)
        if len(self._decoder.text) > released:
            yield self._decoder.text[released:]

    def close(self) -> None:
        """End the generation (after its current step) and wait for it. A failure the iteration
        has not yet raised is raised here; once raised, it is not raised again."""
        self._closed = True
        for _ in self:
            pass

    def __enter__(self) -> TextStream[Result]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
