"""KV cache events in vLLM's wire format (``vllm.distributed.kv_events``, vLLM 0.32), with
msgpack only: neither msgspec nor vLLM is imported here.

vLLM declares its messages as msgspec structs; this module writes the bytes msgspec writes
for them and reads what vLLM's own encoder writes.

A batch (vLLM's ``EventBatch``: ``array_like=True, omit_defaults=True``) is a msgpack array
``[ts, events, data_parallel_rank]``. msgspec writes every field of an array-like struct, so
``data_parallel_rank`` is always there, ``nil`` when unset; ``encode_batch`` does the same.
Decoding also takes the two-element form and ignores elements after the third, as msgspec
does.

An event (``KVCacheEvent`` subclasses: ``tag=True, omit_defaults=True``) is a msgpack map
whose ``"type"`` key holds the class name, followed by the fields in declaration order.
``omit_defaults`` leaves out a field only when it *has* a default and holds it: fields
declared without a default are always written, ``nil`` included.

| event              | keys written, in order                                                  |
|--------------------|-------------------------------------------------------------------------|
| ``BlockStored``    | type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,  |
|                    | medium, lora_name (all always, nil included), extra_keys (only when set)|
| ``BlockRemoved``   | type, block_hashes, medium                                              |
| ``AllBlocksCleared`` | type                                                                  |

The run: hicache adds one key of its own to the *first* event of every batch it publishes,
``hicache_run`` (``RUN_KEY``), a text naming the daemon run that published it (a new one at
every start). A consumer that follows the stream across restarts compares it with the
previous batch's: a different run began numbering from 0 again, with an
``AllBlocksCleared`` (docs/architecture.md §14). Decoders that do not know the key ignore it
(msgspec and vLLM's structs, and serde or Go decoders of the tagged maps, skip unknown keys),
which is why it rides in an event map rather than as a fourth element of the batch array.

vLLM's decoder requires ``lora_id``, ``medium`` and ``lora_name`` in a ``BlockStored``; the
other fields vLLM 0.32 has on top (``group_idx``, ``kv_cache_spec_*``, ``locality``,
``ownership``, ``session_id``) have defaults and are not written.

Decoding contract (``decode_batch``):

- unknown keys in an event map, and array elements after the third, are ignored;
- a missing ``parent_block_hash`` / ``lora_id`` / ``lora_name`` / ``extra_keys`` is None;
- ``medium`` nil or missing (vLLM allows "unspecified") decodes as ``""``;
- a block hash written as an integer (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, a
  64-bit value) decodes as its 8-byte big-endian form, so hashes are always ``bytes``;
- each ``extra_keys`` entry becomes a tuple; what is inside it is left as msgpack gives it
  (nested arrays stay lists), as msgspec's decoder does;
- ``hicache_run`` is read from the first event (``EventBatchView.run``; None when absent);
- anything else malformed (not msgpack, wrong types, unknown event type, truncated) raises
  ``ValueError``, and only ``ValueError``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatchView",
    "KVEvent",
    "Medium",
    "decode_batch",
    "encode_batch",
    "without_content",
]


NAMESPACE_KEY = "hicache_namespace"
"""The key hicache adds to vLLM's ``BlockStored`` (see ``BlockStored.namespace``)."""

RUN_KEY = "hicache_run"
"""The key hicache adds to the first event of each batch: the publishing run (module doc)."""


class Medium(str, Enum):
    """Where the blocks of an event live, in vLLM's names."""

    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


@dataclass(frozen=True)
class BlockStored:
    """Blocks now held in ``medium``: ``block_hashes`` chain on from ``parent_block_hash``
    (None at the start of a sequence) and cover ``token_ids``, ``block_size`` tokens each.
    ``extra_keys``, when set, has one entry per block. ``namespace`` is hicache's own key
    (``hicache_namespace`` on the wire, which vLLM's decoder ignores): in engine mode, the
    namespace of the engines whose pages these are (docs/architecture.md §13)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str
    extra_keys: list[tuple[object, ...] | None] | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    namespace: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer held in ``medium``."""

    block_hashes: list[bytes]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """Everything the publisher said it held is gone."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def without_content(event: BlockStored) -> BlockStored:
    """``event`` without what it says of the prompt: no tokens, no ``extra_keys`` (the
    salt); the hashes, the parent hash, the sizes and the medium stay."""
    return dataclasses.replace(event, token_ids=[], extra_keys=None)


@dataclass(frozen=True)
class EventBatchView:
    """A decoded batch."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    run: str | None = None
    """The publishing daemon run (``RUN_KEY``), None for a batch without it (vLLM's own)."""


# -- encoding ---------------------------------------------------------------------------


def _text(value: str | None) -> str | None:
    return value.value if isinstance(value, Enum) else value


def _encode_event(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        doc: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": _text(event.medium),
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            doc["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        if event.namespace is not None:
            doc[NAMESPACE_KEY] = event.namespace
        return doc
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes),
                "medium": _text(event.medium)}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int | None = None,
                 run: str | None = None) -> bytes:
    """The bytes vLLM's ``ZmqEventPublisher`` sends for ``EventBatch(ts, events, rank)``,
    with ``run`` under ``RUN_KEY`` in the first event when given (and ``events`` not empty).

    Raises ``TypeError`` for anything in ``events`` that is not a KV event."""
    encoded = [_encode_event(e) for e in events]
    if run is not None and encoded:
        encoded[0][RUN_KEY] = run
    doc = [float(ts), encoded, data_parallel_rank]
    packed: bytes = msgpack.packb(doc, use_bin_type=True)
    return packed


# -- decoding ---------------------------------------------------------------------------


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what}: expected an integer, got {type(value).__name__}")
    return value


def _opt_int(value: object, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _opt_str(value: object, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{what}: expected a string or nil, got {type(value).__name__}")


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what}: expected an array, got {type(value).__name__}")
    return value


def _hash(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < 1 << 64:
            raise ValueError(f"{what}: integer block hash out of the 64-bit range: {value}")
        return value.to_bytes(8, "big")
    raise ValueError(f"{what}: expected bytes or an integer, got {type(value).__name__}")


def _hashes(value: object, what: str) -> list[bytes]:
    return [_hash(h, f"{what}[{i}]") for i, h in enumerate(_list(value, what))]


def _extra_keys(value: object, what: str) -> list[tuple[object, ...] | None] | None:
    if value is None:
        return None
    out: list[tuple[object, ...] | None] = []
    for i, entry in enumerate(_list(value, what)):
        out.append(None if entry is None else tuple(_list(entry, f"{what}[{i}]")))
    return out


def _decode_block_stored(doc: dict[str, Any], where: str) -> BlockStored:
    for key in ("block_hashes", "token_ids", "block_size"):
        if key not in doc:
            raise ValueError(f"{where}: BlockStored without {key!r}")
    parent = doc.get("parent_block_hash")
    return BlockStored(
        block_hashes=_hashes(doc["block_hashes"], f"{where}.block_hashes"),
        parent_block_hash=None if parent is None else _hash(parent, f"{where}.parent_block_hash"),
        token_ids=[_int(t, f"{where}.token_ids[{i}]")
                   for i, t in enumerate(_list(doc["token_ids"], f"{where}.token_ids"))],
        block_size=_int(doc["block_size"], f"{where}.block_size"),
        medium=_opt_str(doc.get("medium"), f"{where}.medium") or "",
        extra_keys=_extra_keys(doc.get("extra_keys"), f"{where}.extra_keys"),
        lora_id=_opt_int(doc.get("lora_id"), f"{where}.lora_id"),
        lora_name=_opt_str(doc.get("lora_name"), f"{where}.lora_name"),
        namespace=_opt_str(doc.get(NAMESPACE_KEY), f"{where}.{NAMESPACE_KEY}"),
    )


def _decode_block_removed(doc: dict[str, Any], where: str) -> BlockRemoved:
    if "block_hashes" not in doc:
        raise ValueError(f"{where}: BlockRemoved without 'block_hashes'")
    return BlockRemoved(block_hashes=_hashes(doc["block_hashes"], f"{where}.block_hashes"),
                        medium=_opt_str(doc.get("medium"), f"{where}.medium") or "")


def _decode_event(doc: object, where: str) -> KVEvent:
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a map, got {type(doc).__name__}")
    kind = doc.get("type")
    if kind == "BlockStored":
        return _decode_block_stored(doc, where)
    if kind == "BlockRemoved":
        return _decode_block_removed(doc, where)
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"{where}: unknown event type {kind!r}")


def decode_batch(payload: bytes) -> EventBatchView:
    """A batch from the bytes of a vLLM (or ``encode_batch``) payload; see the module
    docstring for what is accepted. Raises ``ValueError`` on malformed input."""
    try:
        doc = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, TypeError...)
        raise ValueError(f"not a msgpack document: {exc}") from exc
    if not isinstance(doc, list) or len(doc) < 2:
        raise ValueError("a batch must be an array [ts, events, data_parallel_rank]")
    ts = doc[0]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise ValueError(f"batch ts: expected a number, got {type(ts).__name__}")
    raw = _list(doc[1], "batch events")
    events = [_decode_event(e, f"events[{i}]") for i, e in enumerate(raw)]
    rank = _opt_int(doc[2], "batch data_parallel_rank") if len(doc) > 2 else None
    run = _opt_str(raw[0].get(RUN_KEY), f"events[0].{RUN_KEY}") if raw else None
    return EventBatchView(ts=float(ts), events=events, data_parallel_rank=rank, run=run)
