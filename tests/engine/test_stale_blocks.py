"""``StaleBlocks``: which of vLLM's blocks a failed synchronous load left without their KV,
and what was computed on top of them (no vLLM needed: block tables and token counts).

Block size 32 throughout. Request A loads pages 0..3 (blocks 10..13) and computes its
blocks 14..16; request B hits A's blocks 10..13 in vLLM's own prefix cache in the same step
and computes its blocks 20..22. A's load fails.
"""

from __future__ import annotations

from hicache.connectors.stale_blocks import StaleBlocks, StepWrite

BS = 32
A = [10, 11, 12, 13, 14, 15, 16]
B = [10, 11, 12, 13, 20, 21, 22]


def _failed() -> StaleBlocks:
    stale = StaleBlocks(BS)
    assert stale.mark_failed({10, 11, 12, 13}, [A, B, [40, 41]]) == [0, 0, 2]
    return stale


def test_nothing_is_stale_and_nothing_is_tracked_until_a_load_fails() -> None:
    stale = StaleBlocks(BS)
    assert not stale
    assert stale.step([StepWrite(A, 0, 228)]) == []
    assert stale.first_stale(A, 7) == 7


def test_the_failed_blocks_and_everything_after_them_are_stale_until_computed_again() -> None:
    stale = _failed()
    assert all(b in stale for b in A + B) and 40 not in stale
    assert stale.first_stale(A, 7) == 0 and stale.first_stale(B, 7) == 0
    # vLLM rewinds A to its first failed block and B to where it was before the step; in
    # the next step A computes its blocks again and B attends to them as A rewrites them
    assert stale.step([StepWrite(B, 128, 228), StepWrite(A, 0, 228)]) == []
    assert not stale
    assert stale.first_stale(B, 7) == 7


def test_a_request_that_hits_stale_blocks_before_they_are_rewritten_computes_stale_kv() -> None:
    stale = _failed()
    c = [10, 11, 12, 13, 30, 31, 32]  # hits A's blocks in vLLM's cache while A does not run
    assert stale.step([StepWrite(c, 128, 200)]) == [0]
    stale.step([StepWrite(A, 0, 228), StepWrite(B, 128, 228)])  # A and B compute them again later
    assert stale.first_stale(A, 7) == 7 and stale.first_stale(B, 7) == 7
    assert stale.first_stale(c, 7) == 4  # c's own blocks were computed on the failed ones: never saved
    assert stale.step([StepWrite(c, 200, 201)]) == [0]  # c goes on attending to its own stale KV ...
    assert stale.first_stale(c, 7) == 4  # ... so its blocks stay stale (a cost in hits, not correctness)


def test_a_stale_block_computed_again_in_chunks_is_good_once_whole() -> None:
    stale = _failed()
    stale.step([StepWrite(A, 0, 48)])  # block 10 and half of 11
    assert stale.first_stale(A, 7) == 1
    stale.step([StepWrite(A, 48, 100)])
    assert stale.first_stale(A, 7) == 3
    stale.step([StepWrite(A, 100, 228)])
    assert stale.first_stale(A, 7) == 7


def test_a_stale_block_given_to_another_request_is_good_once_it_writes_it_whole() -> None:
    stale = StaleBlocks(BS)
    stale.mark_failed({50}, [])
    assert stale.first_stale([7, 50], 2) == 1
    assert stale.step([StepWrite([7, 50], 32, 64)]) == []  # a new request's own block, written from its start
    assert not stale
