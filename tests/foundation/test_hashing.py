"""Page-hash chain: known answers, an independent re-computation, namespace isolation, bad ids."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.hashing import HashNamespace, PageHasher, is_page_hash, tokens_to_bytes

NS = HashNamespace("model-A", "float32", 4)

# Pinned once; a change here means every L3 object written so far becomes unreachable.
FIXED_VECTOR = [
    "d6796f578003e69abdd9bcd2e9d4a61cb0019b0ca60e956e42af19cd90e299a3",
    "5e6edb94d8b0fe9fe5485ceb6ae12c0801125540f08738f49001685cab9b0045",
]


def _spec_seed(*fields: str) -> bytes:
    """The namespace seed recomputed straight from docs/architecture.md §6, independently of the module."""
    h = hashlib.sha256(b"hicache-ns-v1")
    for f in fields:
        raw = f.encode()
        h.update(struct.pack("<I", len(raw)) + raw)
    return h.digest()


def test_chain_matches_the_specification() -> None:
    seed = _spec_seed("model-A", "float32", "4", "full", "")
    assert PageHasher(NS).seed == seed
    h0 = hashlib.sha256(seed + struct.pack("<4I", 1, 2, 3, 4)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert PageHasher(NS).hash_pages([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [h0.hex(), h1.hex()]


def test_fixed_vectors() -> None:
    hasher = PageHasher(HashNamespace("m", "float32", 2, "full", ""))
    assert hasher.hash_pages([0, 1, 2, 3]) == FIXED_VECTOR


def test_partial_tail_gets_no_hash_and_chain_continues_from_a_parent() -> None:
    hasher = PageHasher(NS)
    full = hasher.hash_pages(list(range(12)))
    assert len(full) == 3 and len(hasher.hash_pages(list(range(11)))) == 2
    assert hasher.hash_pages(list(range(4, 12)), parent=full[0]) == full[1:]
    assert hasher.hash_pages([1, 2, 3]) == []
    assert all(is_page_hash(h) for h in full)


@pytest.mark.parametrize("other", [
    HashNamespace("model-B", "float32", 4),
    HashNamespace("model-A", "bfloat16", 4),
    HashNamespace("model-A", "float32", 4, "swa"),
    HashNamespace("model-A", "float32", 4, "full", "tenant-1"),
])
def test_namespaces_never_share_page_hashes(other: HashNamespace) -> None:
    tokens = list(range(64))
    assert not set(PageHasher(NS).hash_pages(tokens)) & set(PageHasher(other).hash_pages(tokens))


def test_page_size_is_part_of_the_namespace() -> None:
    a = PageHasher(HashNamespace("m", "float32", 2)).hash_pages(list(range(64)))
    b = PageHasher(HashNamespace("m", "float32", 4)).hash_pages(list(range(64)))
    assert not set(a) & set(b)


def test_seed_fields_cannot_be_shifted_between_each_other() -> None:
    assert HashNamespace("ab", "c", 1).seed() != HashNamespace("a", "bc", 1).seed()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=8, max_size=8), st.text(max_size=5), st.text(max_size=5))
def test_different_salts_give_disjoint_chains(tokens: list[int], salt_a: str, salt_b: str) -> None:
    a = PageHasher(NS.with_salt(salt_a)).hash_pages(tokens)
    b = PageHasher(NS.with_salt(salt_b)).hash_pages(tokens)
    assert (a == b) == (salt_a == salt_b)
    assert salt_a == salt_b or not set(a) & set(b)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, 1.0, "1", None])
def test_out_of_range_or_non_integer_token_ids_are_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        PageHasher(NS).hash_pages([0, 1, 2, bad])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        tokens_to_bytes([bad])  # type: ignore[list-item]


def test_bad_parent_and_bad_namespace_are_refused() -> None:
    with pytest.raises(ValueError):
        PageHasher(NS).hash_pages([1, 2, 3, 4], parent="not-a-hash")
    with pytest.raises(ValueError):
        HashNamespace("m", "float32", 0)
    with pytest.raises(ValueError):
        HashNamespace("", "float32", 4)


def test_extreme_token_ids_are_little_endian() -> None:
    assert tokens_to_bytes([1, 2**32 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"


def test_array_keys_hash_like_lists() -> None:
    from array import array

    tokens = [0, 1, 2**32 - 1, 7, 70000, 3, 9, 12, 5]
    hasher = PageHasher(NS)
    assert hasher.hash_pages(array("I", tokens)) == hasher.hash_pages(tokens)
    assert tokens_to_bytes(array("I", tokens), 4) == tokens_to_bytes(tokens, 4)
    assert tokens_to_bytes(array("q", tokens)) == tokens_to_bytes(tokens)  # other array kinds take the slow path
