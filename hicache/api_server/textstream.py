"""Output token ids -> text, incrementally, with stop strings.

``OutputText`` turns the token ids of one request into text as they arrive and watches for
the request's stop strings. Contract of ``push(ids) -> (text, stopped)``:

- ``text`` is new text that is final: it will never be retracted. While stop strings are
  set, the longest end of the text that is the start of a stop string is held back (at
  most ``max(len(stop)) - 1`` characters); text that ends in an incomplete UTF-8 sequence
  is held back by ``DecodeStream``.
- Stop strings are looked for after every token, not once per call: ``stopped`` is True
  once a stop string appeared, and ``used`` then says how many of the ids of this call
  belong to the output (up to and including the token that completed the stop string; the
  rest must be dropped). Without a stop, ``used == len(ids)``.
- After a stop, ``text`` ends just before the stop string (the stop string is not part of
  the output; with ``keep_stop`` it ends just after it, SGLang's ``no_stop_trim``), and the
  request must be ended. The output ids then decode to the text, the stop string and
  whatever else the last token spelled.
- ``finish()`` returns whatever was held back, at the end of the request.

Without stop strings and with ``incremental=False`` (a non-streaming request), nothing is
decoded until ``finish``, which decodes all ids once.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.text import DecodeStream, Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), incremental: bool = True,
                 keep_stop: bool = False) -> None:
        self._tok = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._keep_stop = keep_stop
        self.used = 0
        """How many ids of the last ``push`` belong to the output (see the module docstring)."""
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
            self.used = 0
            return "", True
        self.used = len(ids)
        if self._stream is None:
            self._ids.extend(ids)
            return "", False
        for i, token_id in enumerate(ids):
            piece = self._stream.push(token_id)
            if not piece:
                continue
            # A stop string not seen before ends inside the new piece.
            since = max(self._emitted, len(self._text) - self._max_stop + 1)
            self._text += piece
            if self._stop and self._find_stop(since)[0] != -1:
                self.used = i + 1
                break
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
        cut, length = self._find_stop(start)
        if cut != -1:
            self.stopped = True
            end = cut + length if self._keep_stop else cut
            self._text = self._text[:end]
        elif final:
            end = len(self._text)
        else:
            end = max(start, len(self._text) - self._partial_stop())
        self._emitted = end
        return self._text[start:end], self.stopped

    def _find_stop(self, since: int) -> tuple[int, int]:
        """The earliest stop string in the text at or after ``since``: (position, length);
        (-1, 0) when there is none."""
        cut, length = -1, 0
        for s in self._stop:
            pos = self._text.find(s, since)
            if pos != -1 and (cut == -1 or pos < cut):
                cut, length = pos, len(s)
        return cut, length

    def _partial_stop(self) -> int:
        """The length of the longest end of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best
