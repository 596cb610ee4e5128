"""The L3 page object format (docs/architecture.md §6).

Every object in L3 is a fixed 96-byte header followed by the raw page bytes::

    offset size  field
    0      4     magic            b"HCPG"
    4      2     format version   uint16 (FORMAT_VERSION)
    6      2     header length    uint16 (HEADER_SIZE)
    8      4     layout id        uint32, chosen by the writer of the layout
    12     16    dtype            ASCII, NUL padded ("bfloat16", "float8_e4m3fn", ...)
    28     1     ndim             uint8, 1..MAX_NDIM
    29     3     reserved         zero
    32     32    shape            MAX_NDIM x uint32, unused dims zero
    64     8     payload length   uint64 == prod(shape) * itemsize(dtype)
    72     8     payload checksum uint64, XXH3-64(payload, seed=0)
    80     16    page name        the first 16 bytes of the object's key (its page hash)
    96     ...   payload

All integers little-endian. For a given ``PageLayout`` the first 72 bytes are a constant
(``PageLayout.header_prefix``), so verifying a header is one bytes comparison, one of the
name and the checksum. A reader never interprets an object whose header differs in any
field from the layout it expects or names another page: such an object, a short or long
object, or a checksum mismatch is a ``PageFormatError`` (the backends turn it into a
counted miss and delete the object). The name makes a whole, valid object under another
key (a file copied or renamed by hand, a backup restored into the wrong place) a mismatch.

Version 1 objects (no name: those bytes were zero) are refused like any other mismatch,
with a reason that says so, rather than read: an object that cannot prove its name is
exactly the hole the name closes, and a refused object costs one hit (the backup that
follows writes the page again in this format).

Buffers: ``encode_header`` returns a fresh 96-byte ``bytes``; the payload itself is never
copied by this module (writers send header and payload as two pieces, readers check the
payload where it lies). Nothing here holds state or locks.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import xxhash

from storage_backends.errors import PageFormatError, StorageConfigError

MAGIC = b"HCPG"
FORMAT_VERSION = 2
HEADER_SIZE = 96
MAX_NDIM = 8
DTYPE_FIELD_LEN = 16
NAME_OFFSET = 80
NAME_SIZE = HEADER_SIZE - NAME_OFFSET  # 16

# magic, version, header length, layout id, dtype, ndim, 3 pad, 8 dims, payload length
_PREFIX = struct.Struct(f"<4sHHI{DTYPE_FIELD_LEN}sB3x{MAX_NDIM}IQ")
_CHECKSUM = struct.Struct("<Q")
PREFIX_SIZE = _PREFIX.size  # 72
_CHECKSUM_OFFSET = PREFIX_SIZE
if PREFIX_SIZE != 72 or PREFIX_SIZE + _CHECKSUM.size != NAME_OFFSET:  # pragma: no cover - guards edits above
    raise ImportError(f"page header prefix is {PREFIX_SIZE} bytes, the format needs 72")

DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Element sizes of the dtypes a page may hold. Names follow torch without the prefix."""


def normalize_dtype(dtype: str) -> str:
    """``"torch.bfloat16"`` -> ``"bfloat16"``; raise ``StorageConfigError`` for an unknown dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise StorageConfigError(f"unknown page dtype {dtype!r}; known: {', '.join(DTYPE_ITEMSIZE)}")
    return name


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """XXH3-64 of ``payload`` (any contiguous buffer, read in place)."""
    return xxhash.xxh3_64_intdigest(payload)


def page_name(key: str) -> bytes:
    """The name field of the object stored under ``key`` (a page hash, 64 hex characters,
    checked by the caller): its first ``NAME_SIZE`` bytes."""
    return bytes.fromhex(key[: 2 * NAME_SIZE])


@dataclass(frozen=True)
class PageLayout:
    """What every page of one cache component looks like; what a reader expects.

    ``layout_id`` is an opaque uint32 the core derives from everything that shapes a page
    besides dtype and shape (component kind, per-layer order, ...). Two layouts are
    compatible only if all three fields are equal.
    """

    layout_id: int
    dtype: str
    shape: tuple[int, ...]
    header_prefix: bytes = field(init=False, repr=False, compare=False)
    payload_size: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layout_id, int) or not 0 <= self.layout_id < 2**32:
            raise StorageConfigError(f"layout_id must be an int in [0, 2**32), got {self.layout_id!r}")
        dtype = normalize_dtype(self.dtype)
        shape = tuple(self.shape)
        if not 1 <= len(shape) <= MAX_NDIM:
            raise StorageConfigError(f"page shape must have 1..{MAX_NDIM} dims, got {shape}")
        if any(not isinstance(d, int) or not 0 < d < 2**32 for d in shape):
            raise StorageConfigError(f"page shape dims must be ints in [1, 2**32), got {shape}")
        size = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "payload_size", size)
        dims = shape + (0,) * (MAX_NDIM - len(shape))
        prefix = _PREFIX.pack(
            MAGIC,
            FORMAT_VERSION,
            HEADER_SIZE,
            self.layout_id,
            dtype.encode("ascii"),
            len(shape),
            *dims,
            size,
        )
        object.__setattr__(self, "header_prefix", prefix)

    @property
    def object_size(self) -> int:
        """Bytes of one stored object: header plus payload."""
        return HEADER_SIZE + self.payload_size

    @classmethod
    def for_bytes(cls, page_bytes: int, layout_id: int = 0) -> PageLayout:
        """A flat ``uint8`` layout of ``page_bytes`` bytes (benchmarks, tools)."""
        return cls(layout_id, "uint8", (page_bytes,))


def encode_header(layout: PageLayout, payload: bytes | bytearray | memoryview, key: str) -> bytes:
    """The 96-byte header for ``payload`` under ``layout``, stored under ``key`` (a page
    hash, checked by the caller).

    Raises ``ValueError`` if the payload is not exactly ``layout.payload_size`` bytes. The
    payload is only read (for the checksum), never copied or kept.
    """
    mv = memoryview(payload)
    if mv.nbytes != layout.payload_size:
        raise ValueError(f"page is {mv.nbytes} bytes, layout {layout} needs {layout.payload_size}")
    return b"".join((layout.header_prefix, _CHECKSUM.pack(checksum(mv)), page_name(key)))


def check_header(layout: PageLayout, header: bytes | bytearray | memoryview, key: str) -> int:
    """Verify ``header`` (at least ``HEADER_SIZE`` bytes) against ``layout`` and the key it
    was read under.

    Returns the payload checksum the header records; raises ``PageFormatError`` naming the
    first field that differs.
    """
    hv = memoryview(header)
    if hv.nbytes < HEADER_SIZE:
        raise PageFormatError(f"object of {hv.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    if hv[:PREFIX_SIZE] != layout.header_prefix:
        raise PageFormatError(describe_mismatch(layout, hv))
    if hv[NAME_OFFSET:HEADER_SIZE] != page_name(key):
        raise PageFormatError(describe_name_mismatch(hv, key))
    checksum: int = _CHECKSUM.unpack_from(hv, _CHECKSUM_OFFSET)[0]
    return checksum


def check_object(layout: PageLayout, obj: bytes | bytearray | memoryview, key: str) -> memoryview:
    """Verify a whole object stored under ``key``; return a view of its payload (no copy).

    Raises ``PageFormatError`` on any header mismatch (another page's name included), a
    wrong length or a bad checksum.
    """
    ov = memoryview(obj)
    expected = check_header(layout, ov, key)
    if ov.nbytes != layout.object_size:
        raise PageFormatError(f"object is {ov.nbytes} bytes, expected {layout.object_size}")
    payload = ov[HEADER_SIZE:]
    if checksum(payload) != expected:
        raise PageFormatError("payload checksum mismatch")
    return payload


def check_payload(expected_checksum: int, payload: bytes | bytearray | memoryview) -> None:
    """Raise ``PageFormatError`` if ``payload`` does not hash to ``expected_checksum``."""
    if checksum(payload) != expected_checksum:
        raise PageFormatError("payload checksum mismatch")


@dataclass(frozen=True)
class ObjectHeader:
    """A decoded header, for tools that do not know the layout in advance."""

    version: int
    layout_id: int
    dtype: str
    shape: tuple[int, ...]
    payload_size: int
    checksum: int
    name: bytes

    @property
    def object_size(self) -> int:
        """Bytes of the whole object this header describes."""
        return HEADER_SIZE + self.payload_size

    def names(self, key: str) -> bool:
        """Whether this header names ``key`` (the object belongs under that key)."""
        return self.name == page_name(key)

    def layout(self) -> PageLayout:
        return PageLayout(self.layout_id, self.dtype, self.shape)


def parse_header(header: bytes | bytearray | memoryview) -> ObjectHeader:
    """Decode a header without an expected layout; raise ``PageFormatError`` if malformed."""
    hv = memoryview(header)
    if hv.nbytes < HEADER_SIZE:
        raise PageFormatError(f"object of {hv.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, hlen, layout_id, dtype_raw, ndim, *rest = _PREFIX.unpack_from(hv, 0)
    dims, payload_size = rest[:MAX_NDIM], rest[MAX_NDIM]
    if magic != MAGIC:
        raise PageFormatError(f"bad magic {bytes(magic)!r}")
    if version == 1 and hlen == HEADER_SIZE:
        raise PageFormatError(f"format version 1 (written by an older build, it does not record its page's "
                              f"name) is refused; this build reads version {FORMAT_VERSION}")
    if version != FORMAT_VERSION or hlen != HEADER_SIZE:
        raise PageFormatError(f"unsupported format version {version} / header length {hlen}")
    try:
        dtype = normalize_dtype(dtype_raw.rstrip(b"\0").decode("ascii"))
    except (UnicodeDecodeError, StorageConfigError) as exc:
        raise PageFormatError(f"bad dtype field {bytes(dtype_raw)!r}") from exc
    if not 1 <= ndim <= MAX_NDIM or any(d == 0 for d in dims[:ndim]) or any(dims[ndim:]):
        raise PageFormatError(f"bad shape field ndim={ndim} dims={dims}")
    shape = tuple(dims[:ndim])
    if payload_size != math.prod(shape) * DTYPE_ITEMSIZE[dtype]:
        raise PageFormatError(f"payload length {payload_size} does not match shape {shape} x {dtype}")
    (digest,) = _CHECKSUM.unpack_from(hv, _CHECKSUM_OFFSET)
    return ObjectHeader(version, layout_id, dtype, shape, payload_size, digest, bytes(hv[NAME_OFFSET:HEADER_SIZE]))


def verify_object(obj: bytes | bytearray | memoryview, key: str) -> ObjectHeader:
    """Self-consistency check of an object of any layout stored under ``key`` (``hicache
    storage verify``): a header of this format that names ``key``, the length it declares
    and the checksum."""
    ov = memoryview(obj)
    hdr = parse_header(ov)
    if not hdr.names(key):
        raise PageFormatError(describe_name_mismatch(ov, key))
    if ov.nbytes != hdr.object_size:
        raise PageFormatError(f"object is {ov.nbytes} bytes, header says {hdr.object_size}")
    check_payload(hdr.checksum, ov[HEADER_SIZE:])
    return hdr


def complete_object(header: bytes | bytearray | memoryview, size: int, key: str,
                    layout: PageLayout | None = None) -> bool:
    """Whether an object of ``size`` bytes beginning with ``header`` is whole and belongs
    under ``key``: a header of this format naming ``key`` and the size it declares (of
    ``layout`` when its prefix is ``layout``'s, else whatever layout the header declares).
    What "stored" means for existence checks; the payload is not read (readers check it)."""
    hv = memoryview(header)
    if hv.nbytes < HEADER_SIZE or hv[NAME_OFFSET:HEADER_SIZE] != page_name(key):
        return False
    if layout is not None and hv[:PREFIX_SIZE] == layout.header_prefix:
        return size == layout.object_size
    try:
        return size == parse_header(hv).object_size
    except PageFormatError:
        return False


def describe_name_mismatch(header: bytes | bytearray | memoryview, key: str) -> str:
    """Why an object read under ``key`` whose name field differs is refused."""
    got = bytes(memoryview(header)[NAME_OFFSET:HEADER_SIZE]).hex()
    return f"object names page {got}..., not {key[: 2 * NAME_SIZE]}... (copied or moved under another key)"


def describe_mismatch(layout: PageLayout, header: memoryview) -> str:
    """A human-readable reason why ``header`` does not belong to ``layout``."""
    try:
        got = parse_header(header)
    except PageFormatError as exc:
        return str(exc)
    for name in ("layout_id", "dtype", "shape", "payload_size"):
        if getattr(got, name) != getattr(layout, name):
            return f"{name} is {getattr(got, name)!r}, expected {getattr(layout, name)!r}"
    return "header differs from the expected layout"
