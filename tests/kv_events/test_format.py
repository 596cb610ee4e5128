"""``hicache.kv_events.format`` against vLLM's own msgspec structs, both ways: our bytes decode
with vLLM's decoder to the objects we meant, vLLM's bytes decode with ours to the same values,
and for the same batch the bytes are identical. Malformed payloads raise ValueError only."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from hicache.kv_events.format import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatchView,
    KVEvent,
    Medium,
    decode_batch,
    encode_batch,
)

msgspec = pytest.importorskip("msgspec")
vkv = pytest.importorskip("vllm.distributed.kv_events")

H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, b"\xab" * 32


def _ours_and_vllm() -> list[tuple[KVEvent, Any]]:
    """Pairs (our event, the vLLM struct it stands for)."""
    return [
        (BlockStored(block_hashes=[H1, H2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                     medium=Medium.GPU.value),
         vkv.BlockStored(block_hashes=[H1, H2], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                         lora_id=None, medium="GPU", lora_name=None)),
        (BlockStored(block_hashes=[H3], parent_block_hash=H2, token_ids=[5, 6], block_size=2, medium="CPU",
                     extra_keys=[("salt",)]),
         vkv.BlockStored(block_hashes=[H3], parent_block_hash=H2, token_ids=[5, 6], block_size=2,
                         lora_id=None, medium="CPU", lora_name=None, extra_keys=[("salt",)])),
        (BlockStored(block_hashes=[H1, H3], parent_block_hash=H2, token_ids=[7, 8, 9, 10], block_size=2,
                     medium="STORAGE", extra_keys=[("lora-a", "salt"), None], lora_id=3, lora_name="lora-a"),
         vkv.BlockStored(block_hashes=[H1, H3], parent_block_hash=H2, token_ids=[7, 8, 9, 10], block_size=2,
                         lora_id=3, medium="STORAGE", lora_name="lora-a",
                         extra_keys=[("lora-a", "salt"), None])),
        (BlockRemoved(block_hashes=[H1], medium="STORAGE"),
         vkv.BlockRemoved(block_hashes=[H1], medium="STORAGE")),
        (BlockRemoved(block_hashes=[], medium="GPU"), vkv.BlockRemoved(block_hashes=[], medium="GPU")),
        (AllBlocksCleared(), vkv.AllBlocksCleared()),
    ]


@pytest.mark.parametrize("rank", [None, 0, 3])
def test_our_bytes_decode_with_vllm(rank: int | None) -> None:
    pairs = _ours_and_vllm()
    payload = encode_batch(1712345678.25, [ours for ours, _ in pairs], data_parallel_rank=rank)
    batch = msgspec.msgpack.Decoder(vkv.KVEventBatch).decode(payload)
    assert batch == vkv.KVEventBatch(ts=1712345678.25, events=[v for _, v in pairs], data_parallel_rank=rank)


@pytest.mark.parametrize("rank", [None, 0, 3])
def test_vllm_bytes_decode_with_ours(rank: int | None) -> None:
    pairs = _ours_and_vllm()
    payload = msgspec.msgpack.Encoder().encode(
        vkv.KVEventBatch(ts=99.5, events=[v for _, v in pairs], data_parallel_rank=rank))
    assert decode_batch(payload) == EventBatchView(ts=99.5, events=[ours for ours, _ in pairs],
                                                   data_parallel_rank=rank)


@pytest.mark.parametrize("rank", [None, 7])
def test_same_bytes_as_vllm(rank: int | None) -> None:
    pairs = _ours_and_vllm()
    theirs = msgspec.msgpack.Encoder().encode(
        vkv.KVEventBatch(ts=3.0, events=[v for _, v in pairs], data_parallel_rank=rank))
    assert encode_batch(3.0, [ours for ours, _ in pairs], rank) == theirs


def test_rank_is_written_even_when_unset() -> None:
    """msgspec writes every field of an array_like struct, omit_defaults or not."""
    assert msgpack.unpackb(encode_batch(1.0, [])) == [1.0, [], None]
    theirs = msgspec.msgpack.Encoder().encode(vkv.EventBatch(ts=1.0, events=[]))
    assert msgpack.unpackb(theirs) == [1.0, [], None]


def test_required_nullable_fields_are_written() -> None:
    """lora_id / medium / lora_name have no default in vLLM: written as nil; extra_keys has one."""
    stored = BlockStored(block_hashes=[H1], parent_block_hash=None, token_ids=[1], block_size=1, medium="GPU")
    event = msgpack.unpackb(encode_batch(0.0, [stored]))[1][0]
    assert list(event) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                           "medium", "lora_name"]
    assert event["lora_id"] is None and event["lora_name"] is None


def test_medium_enum_encodes_as_its_value() -> None:
    payload = encode_batch(0.0, [BlockRemoved(block_hashes=[H1], medium=Medium.CPU)])
    assert msgpack.unpackb(payload)[1][0]["medium"] == "CPU"


def test_lenient_decoding() -> None:
    """Unknown keys and trailing elements are ignored, the two-element batch is accepted,
    nullable fields may be missing, integer hashes become 8 bytes, nil medium is ''."""
    doc = [5, [
        {"type": "BlockStored", "block_hashes": [1, b"x"], "token_ids": [1], "block_size": 1,
         "medium": None, "group_idx": 2, "future": {"a": 1}},
        {"type": "BlockRemoved", "block_hashes": [b"y"], "medium": "GPU", "locality": "LOCAL"},
    ]]
    batch = decode_batch(msgpack.packb(doc, use_bin_type=True))
    assert batch == EventBatchView(ts=5.0, events=[
        BlockStored(block_hashes=[(1).to_bytes(8, "big"), b"x"], parent_block_hash=None, token_ids=[1],
                    block_size=1, medium=""),
        BlockRemoved(block_hashes=[b"y"], medium="GPU"),
    ], data_parallel_rank=None)
    assert decode_batch(msgpack.packb([1.0, [], 2, "extra"])).data_parallel_rank == 2


def test_vllm_int_hashes() -> None:
    event = vkv.BlockStored(block_hashes=[2**64 - 1], parent_block_hash=5, token_ids=[1], block_size=1,
                            lora_id=None, medium="GPU", lora_name=None)
    payload = msgspec.msgpack.Encoder().encode(vkv.KVEventBatch(ts=1.0, events=[event]))
    (ours,) = decode_batch(payload).events
    assert isinstance(ours, BlockStored)
    assert ours.block_hashes == [b"\xff" * 8] and ours.parent_block_hash == (5).to_bytes(8, "big")


def test_nested_extra_keys_stay_as_msgpack_gives_them() -> None:
    pairs = [(BlockStored(block_hashes=[H1], parent_block_hash=None, token_ids=[1], block_size=1, medium="GPU",
                          extra_keys=[("lora", ["mm-1", 0], "salt")]),
              vkv.BlockStored(block_hashes=[H1], parent_block_hash=None, token_ids=[1], block_size=1,
                              lora_id=None, medium="GPU", lora_name=None, extra_keys=[("lora", ["mm-1", 0], "salt")]))]
    payload = encode_batch(1.0, [pairs[0][0]])
    assert msgspec.msgpack.Decoder(vkv.KVEventBatch).decode(payload).events == [pairs[0][1]]
    assert decode_batch(payload).events == [pairs[0][0]]


def _valid() -> bytes:
    return encode_batch(1.0, [ours for ours, _ in _ours_and_vllm()], 1)


MALFORMED: list[Any] = [
    b"",
    b"\xc1",  # never used in msgpack
    b"garbage that is not msgpack at all",
    _valid()[:-1],
    _valid()[: len(_valid()) // 2],
    _valid() + b"\x00",  # trailing bytes
    msgpack.packb({"ts": 1.0}),
    msgpack.packb([1.0]),
    msgpack.packb(["1.0", []]),
    msgpack.packb([True, []]),
    msgpack.packb([1.0, {}]),
    msgpack.packb([1.0, [], "rank"]),
    msgpack.packb([1.0, [], 1.5]),
    msgpack.packb([1.0, [[1, 2]]]),
    msgpack.packb([1.0, [{"type": "BlockTouched"}]]),
    msgpack.packb([1.0, [{"block_hashes": []}]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved"}]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": b"xx", "medium": "GPU"}]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["text"], "medium": "GPU"}]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU"}]]),
    msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [], "medium": 3}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [], "token_ids": [1]}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [], "token_ids": ["a"], "block_size": 1}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [], "token_ids": [], "block_size": 1.0}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [], "token_ids": [], "block_size": 1,
                          "extra_keys": ["salt"]}]]),
    msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [], "token_ids": [], "block_size": 1,
                          "lora_id": "x"}]]),
    msgpack.packb([1.0, [{1: 2}]]),  # non-string map key
    msgpack.packb([1.0, [msgpack.ExtType(5, b"x")]]),
    b"\xa2\xff\xfe",  # a str that is not UTF-8
    "not bytes",
    None,
]


@pytest.mark.parametrize("payload", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_raises_value_error(payload: Any) -> None:
    with pytest.raises(ValueError):
        decode_batch(payload)


def test_encode_refuses_what_is_not_an_event() -> None:
    with pytest.raises(TypeError):
        encode_batch(0.0, ["BlockStored"])  # type: ignore[list-item]


def test_the_run_rides_in_the_first_event_and_decoders_that_do_not_know_it_ignore_it() -> None:
    """``hicache_run`` in the first event's map: ours reads it back; vLLM's decoder, and the
    two-field ``EventBatch`` of vLLM's example subscriber, decode the same events as without."""
    events = [ours for ours, _ in _ours_and_vllm()]
    payload = encode_batch(5.0, events, run="0123abcd")
    assert decode_batch(payload) == EventBatchView(5.0, events, None, "0123abcd")
    assert decode_batch(encode_batch(5.0, events)).run is None
    assert decode_batch(encode_batch(5.0, [], run="x")) == EventBatchView(5.0, [], None, None)
    vllm = msgspec.msgpack.Decoder(vkv.KVEventBatch)
    assert vllm.decode(payload) == vllm.decode(encode_batch(5.0, events))

    class ExampleBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
        ts: float
        events: list[vkv.BlockStored | vkv.BlockRemoved | vkv.AllBlocksCleared]

    assert msgspec.msgpack.Decoder(ExampleBatch).decode(payload).events == vllm.decode(payload).events
    with pytest.raises(ValueError, match="hicache_run"):
        decode_batch(msgpack.packb([1.0, [{"type": "AllBlocksCleared", "hicache_run": 7}], None]))
