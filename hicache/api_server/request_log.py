"""``server.request_log``: one JSON line per finished request, for ``hicache advise``.

Each line is a Mooncake-format trace record (``hicache.replay_sim.trace``), so ``hicache
advise``, ``hicache replay`` and ``hicache bench serve --workload trace`` read the log as
they read any trace::

    {"timestamp": 1764871200123, "input_length": 70, "output_length": 16,
     "hash_ids": [5190399413120947381, ...], "cached_tokens": 64}

- ``timestamp``: when the request finished, in ms since the Unix epoch.
- ``hash_ids``: one id per page of ``cache.page_size`` prompt tokens (the last page may be
  partial), *chained*: id ``i`` is a 63-bit BLAKE2b digest of id ``i - 1`` and the page's
  token ids, seeded with the request's ``cache_salt`` (its tenant). Two requests share id
  ``i`` exactly when they share the salt and the first ``i + 1`` pages, as in the cache. No
  text and no token id is written, and the ids are not the L3 page hashes.
- ``cached_tokens``: the prompt tokens the daemon served from its tiers, to compare the
  daemon's own hit rate with the advice.

The file is opened for appending when the tokenizer process starts (a path that cannot be
opened fails the start) and every line is flushed as it is written, so a killed daemon
loses at most the requests still running. It is never rotated or truncated by the daemon.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from hicache.hashing import tokens_to_bytes

LOG_TAG = b"hicache-request-log-v1"
ID_MASK = (1 << 63) - 1


def chained_page_ids(tokens: Sequence[int], page_size: int, salt: str = "") -> list[int]:
    """The chained 63-bit ids of ``tokens``' pages (the last one partial when the length is
    not a multiple of ``page_size``)."""
    prev = hashlib.blake2b(LOG_TAG + salt.encode("utf-8"), digest_size=8).digest()
    out = []
    for start in range(0, len(tokens), page_size):
        prev = hashlib.blake2b(prev + tokens_to_bytes(tokens[start:start + page_size]), digest_size=8).digest()
        out.append(int.from_bytes(prev, "little") & ID_MASK)
    return out


class RequestLog:
    """The open log file. ``record`` is called from the tokenizer's event loop only."""

    def __init__(self, path: str | Path, page_size: int) -> None:
        self.path = Path(path)
        self.page_size = page_size
        self._file: TextIO | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - held open

    def record(self, prompt: Sequence[int], salt: str, output_tokens: int, cached_tokens: int) -> None:
        """Append one finished request."""
        if self._file is None:
            return
        line = {"timestamp": int(time.time() * 1000), "input_length": len(prompt), "output_length": output_tokens,
                "hash_ids": chained_page_ids(prompt, self.page_size, salt), "cached_tokens": cached_tokens}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
