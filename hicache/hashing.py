"""Page hashes: the chained keys under which pages live in L3 (docs/architecture.md §6).

    h_{-1} = SHA-256(b"hicache-ns-v1" || field || field || ...)      (the namespace seed)
    h_i    = SHA-256(h_{i-1} || tokens of page i as little-endian uint32)

Each seed field is length-prefixed (4-byte little-endian length, then UTF-8 bytes), so no
two different field tuples can produce the same seed input. A page hash therefore names
the model, the KV dtype, the page size, the cache component, the tenant salt *and* every
token before and inside the page: two prefixes share a page hash only if they share all
of that.

Hashes travel as 64-character lowercase hex strings (``PageHash``); the chain itself is
computed over the raw 32-byte digests.

Auxiliary components (SWA KV pages, Mamba states) live in L3 as their own objects, under
keys of their own namespace derived from the Full chain (``component_key``)::

    k_i(component) = SHA-256(b"hicache-aux-v1" || field(component) || h_i)

``h_i`` already names the model, dtype, page size, tenant and every token up to the end of
page ``i``, so ``k_i`` names exactly that prefix *and* the component: an SWA page object
is the SWA KV of page ``i`` of that prefix, a Mamba state object is the state after the
last token of page ``i`` of that prefix, and neither is ever found for another prefix or
mistaken for a Full page. Deriving from ``h_i`` (one hash per page instead of a second
chain from the root) lets a node's keys come from its cached Full hashes.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

NAMESPACE_TAG = b"hicache-ns-v1"
AUX_TAG = b"hicache-aux-v1"
HASH_HEX_LEN = 64
HASH_BYTES = 32
"""A page hash as raw bytes (a SHA-256 digest); its hex form is ``HASH_HEX_LEN`` characters."""
MAX_TOKEN_ID = 2**32 - 1

PageHash = str
"""A page hash: 64 lowercase hex characters."""

_HEX_DIGITS = frozenset("0123456789abcdef")
_LITTLE = sys.byteorder == "little"


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    return len(raw).to_bytes(4, "little") + raw


@dataclass(frozen=True)
class HashNamespace:
    """Everything a page hash must depend on besides the tokens themselves.

    ``model_identity`` is the model fingerprint (config + weights digest), so two models,
    or two versions of one, never share pages. ``cache_salt`` is the per-request tenant
    salt; the empty string is the shared default namespace.
    """

    model_identity: str
    kv_dtype: str
    page_size: int
    component: str = "full"
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if not self.model_identity:
            raise ValueError("model_identity must not be empty")

    def seed(self) -> bytes:
        """The 32-byte digest h_{-1} that starts every chain in this namespace."""
        h = hashlib.sha256(NAMESPACE_TAG)
        for value in (
            self.model_identity,
            self.kv_dtype,
            str(self.page_size),
            self.component,
            self.cache_salt,
        ):
            h.update(_field(value))
        return h.digest()

    def with_salt(self, cache_salt: str) -> HashNamespace:
        return HashNamespace(
            self.model_identity, self.kv_dtype, self.page_size, self.component, cache_salt
        )


def component_key(component: str, page_hash: PageHash) -> PageHash:
    """The L3 key of ``component``'s object for the prefix ending with the page whose Full
    hash is ``page_hash`` (see the module docstring). ``full`` keys are the page hashes."""
    if component == "full":
        return page_hash
    if not is_page_hash(page_hash):
        raise ValueError(f"not a page hash: {page_hash!r}")
    return hashlib.sha256(AUX_TAG + _field(component) + bytes.fromhex(page_hash)).hexdigest()


def component_keys(component: str, page_hashes: Sequence[PageHash]) -> list[PageHash]:
    """``component_key`` of every hash."""
    return [component_key(component, h) for h in page_hashes]


def tokens_to_bytes(tokens: Sequence[int], count: int | None = None) -> bytes:
    """The first ``count`` tokens (default all) as little-endian uint32.

    Raises ValueError for an id outside [0, 2**32) or a non-integer id.
    """
    n = len(tokens) if count is None else count
    if type(tokens) is array and tokens.typecode == "I" and tokens.itemsize == 4 and _LITTLE:
        # The tree's keys: already uint32 (so in range), copied out in C.
        return tokens[:n].tobytes() if n != len(tokens) else tokens.tobytes()
    try:
        return struct.pack(f"<{n}I", *(tokens if n == len(tokens) else islice(tokens, n)))
    except struct.error as exc:
        bad = next((t for t in islice(tokens, n) if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID), None)
        raise ValueError(f"token id {bad!r} is not an integer in [0, 2**32)") from exc


def is_page_hash(value: object) -> bool:
    """True if ``value`` is a well-formed page hash (64 lowercase hex characters)."""
    return isinstance(value, str) and len(value) == HASH_HEX_LEN and _HEX_DIGITS.issuperset(value)


class PageHasher:
    """Computes page hashes within one namespace.

    ``hash_pages(tokens, parent)`` continues the chain after the page whose hash is
    ``parent`` (or from the namespace seed when ``parent`` is None) and returns one hex
    hash per full page of ``tokens``.
    """

    def __init__(self, namespace: HashNamespace) -> None:
        self.namespace = namespace
        self.page_size = namespace.page_size
        self._seed = namespace.seed()

    @property
    def seed(self) -> bytes:
        return self._seed

    def hash_pages(self, tokens: Sequence[int], parent: PageHash | None = None) -> list[PageHash]:
        if parent is None:
            start = self._seed
        else:
            if not is_page_hash(parent):
                raise ValueError(f"parent is not a page hash: {parent!r}")
            start = bytes.fromhex(parent)
        if not 0 < self.page_size <= len(tokens):
            return []
        full = len(tokens) - len(tokens) % self.page_size
        data = tokens_to_bytes(tokens, full)
        step = 4 * self.page_size
        sha256 = hashlib.sha256
        prev = start
        # One C-level comprehension: hash, chain and hex each page in a single pass.
        return [
            (prev := sha256(prev + data[off : off + step]).digest()).hex()
            for off in range(0, len(data), step)
        ]

    def digest_pages(self, tokens: Sequence[int], parent: bytes | None = None) -> bytes:
        """``hash_pages`` as raw digests (``HASH_BYTES`` a page) in one buffer: the compact
        form a tree node keeps. ``parent``: the digest of the page before (None: the seed)."""
        if not 0 < self.page_size <= len(tokens):
            return b""
        full = len(tokens) - len(tokens) % self.page_size
        data = tokens_to_bytes(tokens, full)
        step = 4 * self.page_size
        sha256 = hashlib.sha256
        prev = self._seed if parent is None else parent
        return b"".join([(prev := sha256(prev + data[off : off + step]).digest())
                         for off in range(0, len(data), step)])
