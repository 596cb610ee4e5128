"""Page hash validation, kept local so that ``storage_backends`` imports nothing from ``hicache``.

File paths and Redis keys are derived from page hashes only after they pass
``is_page_hash``: 64 lowercase hex characters, nothing else (no separators, no dots), so a
hash can never name a path outside the store.
"""

from __future__ import annotations

from collections.abc import Iterable

from storage_backends.errors import InvalidPageHash

HASH_HEX_LEN = 64
_HEX = frozenset("0123456789abcdef")
_HEX_BYTES = b"0123456789abcdef"


def is_page_hash(value: object) -> bool:
    """True if ``value`` is a 64-character lowercase hex string."""
    return isinstance(value, str) and len(value) == HASH_HEX_LEN and _HEX.issuperset(value)


def check_hashes(hashes: Iterable[object]) -> list[str]:
    """Return ``hashes`` as a new list; raise ``InvalidPageHash`` naming the first bad one.

    Checked as one batch (every item a 64-character string, and the concatenation only
    lowercase hex), which costs about a tenth of checking each hash on its own; the
    per-hash check runs only to name the culprit.
    """
    out = list(hashes)
    if not out:
        return out  # type: ignore[return-value]
    try:
        joined = "".join(out).encode("ascii")  # type: ignore[arg-type]
    except (TypeError, UnicodeEncodeError):
        joined = None
    if joined is None or joined.translate(None, _HEX_BYTES) or set(map(len, out)) != {HASH_HEX_LEN}:  # type: ignore[arg-type]
        for h in out:
            if not is_page_hash(h):
                raise InvalidPageHash(f"not a page hash (64 lowercase hex characters): {h!r:.80}")
    return out  # type: ignore[return-value]
