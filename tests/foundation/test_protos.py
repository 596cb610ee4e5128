"""The wire codec: golden frames, round trips, and every way a frame can be wrong."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protos
from protos import PROTOCOL_VERSION, ProtocolError, decode, encode
from tests.foundation.foundation_samples import SAMPLES

GOLDEN = json.loads((Path(__file__).parent / "golden_frames.json").read_text())


def test_every_message_type_has_a_sample_and_a_golden_frame() -> None:
    assert {type(m) for m in SAMPLES.values()} == set(protos.MESSAGE_TYPES)
    assert set(GOLDEN) == set(SAMPLES)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_encoding_is_pinned_by_golden_frames(name: str) -> None:
    assert encode(SAMPLES[name]).hex() == GOLDEN[name]
    assert decode(bytes.fromhex(GOLDEN[name])) == SAMPLES[name]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip(name: str) -> None:
    msg = SAMPLES[name]
    out = decode(encode(msg))
    assert type(out) is type(msg) and out == msg


def _frame(**fields: object) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def test_wrong_version_is_refused() -> None:
    with pytest.raises(ProtocolError, match="version"):
        decode(_frame(v=PROTOCOL_VERSION + 1, t="abort", rid="x"))
    with pytest.raises(ProtocolError, match="version"):
        decode(_frame(t="abort", rid="x"))
    with pytest.raises(ProtocolError, match="version"):
        decode(_frame(v=True, t="abort", rid="x"))


def test_unknown_tag_is_refused_and_class_names_are_not_tags() -> None:
    with pytest.raises(ProtocolError, match="unknown message tag"):
        decode(_frame(v=PROTOCOL_VERSION, t="nope", rid="x"))
    with pytest.raises(ProtocolError, match="unknown message tag"):
        decode(_frame(v=PROTOCOL_VERSION, t="AbortRequest", rid="x"))


def test_missing_unknown_and_mistyped_fields_are_named() -> None:
    with pytest.raises(ProtocolError, match="missing field 'rid'"):
        decode(_frame(v=PROTOCOL_VERSION, t="abort"))
    with pytest.raises(ProtocolError, match="unknown field.*'extra'"):
        decode(_frame(v=PROTOCOL_VERSION, t="abort", rid="x", extra=1))
    with pytest.raises(ProtocolError, match="field 'rid' must be a string"):
        decode(_frame(v=PROTOCOL_VERSION, t="abort", rid=5))
    with pytest.raises(ProtocolError, match="field 'input_ids' must be a list of integers"):
        decode(_frame(v=PROTOCOL_VERSION, t="generate", rid="r", input_ids=[1, "2"]))
    with pytest.raises(ProtocolError, match="field 'op_id' must be an integer"):
        decode(_frame(v=PROTOCOL_VERSION, t="cancel", op_id=True))
    with pytest.raises(ProtocolError, match="field 'device_pages'"):
        decode(_frame(v=PROTOCOL_VERSION, t="load_to_device", op_id=1, host_pages={"full": [1]},
                      device_pages={"full": [1.5]}))
    with pytest.raises(ProtocolError, match="max_new_tokens"):
        decode(_frame(v=PROTOCOL_VERSION, t="generate", rid="r", input_ids=[1],
                      sampling={"max_new_tokens": "8"}))
    with pytest.raises(ProtocolError, match="unknown field"):
        decode(_frame(v=PROTOCOL_VERSION, t="generate", rid="r", input_ids=[1], sampling={"bogus": 1}))


def test_int_is_accepted_where_a_float_is_expected() -> None:
    msg = decode(_frame(v=PROTOCOL_VERSION, t="shutdown", reason="x", grace_s=3))
    assert isinstance(msg, protos.Shutdown) and msg.grace_s == 3.0 and isinstance(msg.grace_s, float)


def test_oversized_frames_are_refused_both_ways() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(b"\x00" * (protos.MAX_FRAME_BYTES + 1))
    huge = protos.GenerateRequest("r", [2**20] * (protos.MAX_FRAME_BYTES // 4))
    with pytest.raises(ProtocolError, match="exceeds"):
        encode(huge)


def test_unregistered_message_cannot_be_encoded() -> None:
    class Stray(protos.Message):
        pass

    with pytest.raises(ProtocolError, match="not a registered"):
        encode(Stray())


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\x92\x01\x02", b"\x81\xc0\x01", b"\xa3abc", b"\xd4\x01\x01"])
def test_garbage_frames(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(frame)


# Fuzzing: every input either decodes to a registered message or raises ProtocolError.

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                     st.text(max_size=8), st.binary(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                       max_leaves=12)
_field_names = st.sampled_from(["rid", "input_ids", "sampling", "op_id", "status", "host_pages", "device_pages",
                                "hashes", "n", "token_ids", "finished", "usage", "args", "op", "pid", "process",
                                "error", "stream", "cache_salt", "max_new_tokens"]) | st.text(max_size=6)
_tags = st.sampled_from([m.TAG for m in protos.MESSAGE_TYPES]) | st.text(max_size=8)


def _check(frame: bytes) -> None:
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    assert type(msg) in protos.MESSAGE_TYPES
    assert decode(encode(msg)) == msg


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(data: bytes) -> None:
    _check(data)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION]) | st.integers(-2, 3), _tags,
       st.dictionaries(_field_names, _values, max_size=6))
def test_fuzz_random_maps(version: int, tag: str, fields: dict) -> None:
    _check(msgpack.packb({"v": version, "t": tag, **fields}, use_bin_type=True))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(SAMPLES)), st.data())
def test_fuzz_mutated_valid_frames(name: str, data: st.DataObject) -> None:
    frame = bytearray(encode(SAMPLES[name]))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] = data.draw(st.integers(0, 255))
    _check(bytes(frame))


def test_state_fields_take_only_their_documented_values() -> None:
    """``OpDone.status`` and ``ProcessEvent.event`` are ``Literal`` types: the codec refuses
    any other string (and a non-string), naming the allowed values."""
    for tag, field, good, extra in (("op_done", "status", "rejected", {"op_id": 1}),
                                    ("process_event", "event", "restart", {"process": "controller"})):
        base = {"v": PROTOCOL_VERSION, "t": tag, **extra}
        assert getattr(decode(_frame(**base, **{field: good})), field) == good
        for bad in ("bogus", "OK", 1, None):
            with pytest.raises(ProtocolError, match=f"field '{field}' must be one of"):
                decode(_frame(**base, **{field: bad}))


def test_the_readme_names_the_protocol_version() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert f'`{{"v": {PROTOCOL_VERSION}, "t": tag, ...fields}}`' in readme
