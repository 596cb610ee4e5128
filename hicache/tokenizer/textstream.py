"""Output token ids -> text, incrementally, with stop strings.

``OutputText`` turns the token ids of one request into text as they arrive and watches for
the request's stop strings. Contract of ``push(ids) -> (text, stopped)``:

- ``text`` is new text that is final: it will never be retracted. While stop strings are
  set, the longest end of the text that is the start of a stop string is held back (at
  most ``max(len(stop)) - 1`` characters); text that ends in an incomplete UTF-8 sequence
  is held back by ``DecodeStream``.
- ``stopped`` is True once a stop string appeared; ``text`` then ends just before it (the
  stop string is not part of the output) and the request must be ended.
- ``finish()`` returns whatever was held back, at the end of the request.

Without stop strings and with ``incremental=False`` (a non-streaming request), nothing is
decoded until ``finish``, which decodes all ids once.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.text import DecodeStream, Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), incremental: bool = True) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._incremental = incremental or bool(self._stop)
        self._stream = DecodeStream(tokenizer) if self._incremental else None
        self._ids: list[int] = []
        self._text = ""  # everything decoded so far
        self._emitted = 0  # characters of _text already returned
        self.stopped = False

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._emitted]

    def push(self, ids: Sequence[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if self._stream is None:
            self._ids.extend(ids)
            return "", False
        for token_id in ids:
            self._text += self._stream.push(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        """The rest of the text; call once, when the request has ended."""
        if self.stopped:
            return ""
        if self._stream is None:
            self._text = self._tok.decode(self._ids, skip_special_tokens=True)
        else:
            self._text += self._stream.flush()
        text, _ = self._advance(final=True)
        return text

    def _advance(self, final: bool) -> tuple[str, bool]:
        # A stop string not seen yet starts at or after _emitted: anything earlier was either
        # emitted whole (so it ended before the held-back tail) or found by a previous call.
        start = self._emitted
        cut = -1
        for s in self._stop:
            pos = self._text.find(s, start)
            if pos != -1 and (cut == -1 or pos < cut):
                cut = pos
        if cut != -1:
            self.stopped = True
            self._text = self._text[:cut]
            end = cut
        elif final:
            end = len(self._text)
        else:
            end = max(start, len(self._text) - self._partial_stop())
        self._emitted = end
        return self._text[start:end], self.stopped

    def _partial_stop(self) -> int:
        """The length of the longest end of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best
