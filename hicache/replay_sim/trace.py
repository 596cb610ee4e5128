"""Mooncake-format traces and the synthetic token sequences the tree replays.

A Mooncake record is one JSON object per line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}

``hash_ids`` holds one *chained* id per block of ``B`` input tokens: two requests share id
``k`` at position ``i`` exactly when they share their first ``(i+1)*B`` tokens. Only
``hash_ids`` is required; ``timestamp``, ``input_length`` and ``output_length`` are kept
when present (``input_length`` lets ``infer_block_size`` find ``B``).

Token mapping. The tree runs with pages of ``P`` tokens (``P`` divides ``B``), so a block is
``B / P`` pages. Block ``b`` becomes the synthetic tokens ``b*B .. b*B + B - 1``
(``token_keys``): deterministic, distinct per block, so the tree sees real sequences.
Because the tree compares whole pages only, the same replay runs exactly alike on *page
ids* (page ``j`` of block ``b`` is the single token ``b*(B/P) + j``, with a tree page size
of 1); ``page_keys`` builds those, which is what the simulator uses unless asked for real
tokens. All figures are reported in tokens either way. The last block of a record counts
as a whole block, as in the traces' reference hit rates.

Large ids. The daemon's request log (``server.request_log``) writes 63-bit page hashes as
ids; ``load_trace`` renumbers a trace whose ids do not all fit ``DENSE_LIMIT`` to 0, 1, 2,
... in order of first appearance. Only equality of ids carries meaning, so every figure is
the same.
"""

from __future__ import annotations

import gzip
import json
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from hicache.tree.node import KEY_TYPECODE  # the tree's key type: traces replay through the real tree

MAX_TOKEN = 2**32
DENSE_LIMIT = 2**24
CANDIDATE_BLOCK_SIZES = (512, 256, 128, 64, 32, 16, 8, 4, 2, 1, 1024, 2048)


class TraceError(ValueError):
    """A trace line that is not a valid Mooncake record (the message names file and line)."""


@dataclass
class Trace:
    """The requests of one trace, in arrival order.

    ``blocks[r]``: the chained block ids of request ``r``; ``timestamps`` (ms) and
    ``input_lengths`` are None for records without them.
    """

    name: str
    blocks: list[list[int]]
    timestamps: list[float | None] = field(default_factory=list)
    input_lengths: list[int | None] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return len(self.blocks)

    @property
    def total_blocks(self) -> int:
        return sum(len(b) for b in self.blocks)

    def longest(self) -> int:
        return max((len(b) for b in self.blocks), default=0)


def _parse_line(line: str, where: str) -> tuple[list[int], float | None, int | None]:
    try:
        rec = json.loads(line)
    except ValueError as exc:
        raise TraceError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    if "hash_ids" not in rec:
        raise TraceError(f"{where}: missing 'hash_ids'")
    ids = rec["hash_ids"]
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    ts = rec.get("timestamp")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise TraceError(f"{where}: 'timestamp' must be a number, got {ts!r}")
    n = rec.get("input_length")
    if n is not None and (type(n) is not int or n < 0):
        raise TraceError(f"{where}: 'input_length' must be a non-negative integer, got {n!r}")
    return ids, ts, n


def load_trace(path: str | Path) -> Trace:
    """Read a Mooncake-format JSON-lines file (gzipped when its name ends in ``.gz``, as the
    vendored traces are). Blank lines are skipped.

    Raises ``TraceError`` naming ``path:line`` for the first bad record, ``OSError`` if the
    file cannot be read.
    """
    blocks: list[list[int]] = []
    stamps: list[float | None] = []
    lengths: list[int | None] = []
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            ids, ts, n = _parse_line(line, f"{path}:{lineno}")
            blocks.append(ids)
            stamps.append(ts)
            lengths.append(n)
    if any(i >= DENSE_LIMIT for ids in blocks for i in ids):
        blocks = _renumbered(blocks)
    return Trace(Path(path).name, blocks, stamps, lengths)


def _open_text(path: str | Path) -> TextIO:
    """``path`` opened for reading text, through gzip when its name ends in ``.gz``."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _renumbered(blocks: list[list[int]]) -> list[list[int]]:
    """The same ids as 0, 1, 2, ... in order of first appearance."""
    dense: dict[int, int] = {}
    return [[dense.setdefault(i, len(dense)) for i in ids] for ids in blocks]


def infer_block_size(trace: Trace) -> int | None:
    """The block size ``B`` with ``len(hash_ids) == ceil(input_length / B)`` for every
    record that has ``input_length`` (the first consistent candidate, common sizes first),
    or None when no record has one or no candidate fits."""
    pairs = [(n, len(ids)) for ids, n in zip(trace.blocks, trace.input_lengths, strict=True)
             if n is not None]
    if not pairs:
        return None
    for b in CANDIDATE_BLOCK_SIZES:
        if all(-(-n // b) == k for n, k in pairs):
            return b
    return None


def check_geometry(block_size: int, page_size: int) -> int:
    """Pages per block; ``ValueError`` unless both are positive and ``page_size`` divides
    ``block_size``."""
    if block_size < 1 or page_size < 1:
        raise ValueError(f"block size ({block_size}) and page size ({page_size}) must be >= 1")
    if block_size % page_size:
        raise ValueError(f"page size {page_size} must divide the block size {block_size}")
    return block_size // page_size


def page_keys(trace: Trace, pages_per_block: int) -> list[array[int]]:
    """One key per request: page ``j`` of block ``b`` is the token ``b*pages_per_block + j``
    (a tree page size of 1 then replays pages). ``ValueError`` if an id overflows 32 bits."""
    k = pages_per_block
    top = max((max(ids) for ids in trace.blocks if ids), default=0)
    if (top + 1) * k > MAX_TOKEN:
        raise ValueError(f"block id {top} x {k} pages per block does not fit 32-bit token ids")
    if k == 1:
        return [array(KEY_TYPECODE, ids) for ids in trace.blocks]
    out = []
    for ids in trace.blocks:
        key = array(KEY_TYPECODE)
        for b in ids:
            key.extend(range(b * k, b * k + k))
        out.append(key)
    return out
