"""``L1Budget``: reservations per component, taken as pages are allocated, checked."""

from __future__ import annotations

from array import array

import pytest

from hicache.memory.allocator import PageAllocator
from hicache.scheduler.budget import BudgetError, L1Budget
from hicache.tree import ComponentType, FullComponent, MambaComponent, UnifiedRadixCache

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA
PS = 4


def _budget(pages: int = 16, slots: int = 8) -> tuple[L1Budget, UnifiedRadixCache]:
    cache = UnifiedRadixCache([FullComponent(PageAllocator(pages, "full")),
                               MambaComponent(PageAllocator(slots, "mamba"), copy_state=lambda s, d: None)], PS)
    return L1Budget(cache), cache


def test_reserve_take_release_keep_the_totals_and_the_room() -> None:
    b, cache = _budget()
    assert b.kinds == (FULL, MAMBA)
    assert b.room(FULL) == 16 and b.room(MAMBA) == 8
    assert b.can_reserve({FULL: 10, MAMBA: 3})
    assert b.reserved(FULL) == 0  # the check changes nothing
    b.reserve("a", {FULL: 10, MAMBA: 3})
    assert b.room(FULL) == 6 and b.room(MAMBA) == 5
    assert not b.can_reserve({FULL: 7})
    with pytest.raises(BudgetError, match="does not fit"):
        b.reserve("b", {FULL: 7})
    assert list(b.holders()) == ["a"]  # the refused reservation left nothing behind
    pages = b.take("a", FULL, 4)
    assert pages is not None and len(pages) == 4
    assert b.held("a", FULL) == 6 and b.reserved(FULL) == 6
    assert b.room(FULL) == 6  # allocated pages are no longer free, and no longer reserved
    more = b.take("a", FULL, 8)  # more than is left of the reservation: takes what is left
    assert more is not None and b.held("a", FULL) == 0 and b.reserved(FULL) == 0
    b.check()
    with pytest.raises(BudgetError, match="nothing runs"):
        b.check_idle()
    b.release("a")
    b.release("a")  # a second release (or one of a request never admitted) does nothing
    b.check_idle()
    cache.full.allocator.free(list(pages) + list(more))
    assert b.room(FULL) == 16 and b.room(MAMBA) == 8


def test_take_evicts_cached_data_when_the_allocator_is_short() -> None:
    b, cache = _budget(pages=4)
    key = array("I", range(16))
    pages = cache.full.allocator.alloc(4)
    assert pages is not None
    cache.insert(key, pages)  # the whole L1, cached and unlocked
    assert cache.full.allocator.free_count == 0 and b.room(FULL) == 4
    b.reserve("a", {FULL: 2})
    got = b.take("a", FULL, 2)  # evicts the cached leaf (all four pages)
    assert got is not None and len(got) == 2 and b.reserved(FULL) == 0
    assert cache.total_size() == 0 and cache.full.allocator.free_count == 2
    b.reserve("b", {FULL: 2})
    assert b.take("b", FULL, 3) is None  # nothing left to evict: the reservation stays
    assert b.held("b", FULL) == 2 and cache.full.allocator.free_count == 2
    b.release("a")
    b.release("b")
    cache.full.allocator.free(got)
    b.check_idle()


def test_errors_name_the_problem() -> None:
    b, _ = _budget()
    assert not b.can_reserve({SWA: 1})  # the cache has no SWA component
    assert b.can_reserve({SWA: 0})
    with pytest.raises(ValueError, match="-1"):
        b.can_reserve({FULL: -1})
    with pytest.raises(BudgetError, match="no reservation"):
        b.take("nobody", FULL, 1)
    b.reserve("a", {FULL: 1})
    with pytest.raises(BudgetError, match="already holds"):
        b.reserve("a", {FULL: 1})
    with pytest.raises(KeyError, match="swa"):
        b.room(SWA)


def test_check_finds_a_total_that_differs_from_the_sum() -> None:
    b, _ = _budget()
    b.reserve("a", {FULL: 3})
    b.reserve("b", {FULL: 2, MAMBA: 1})
    b.check()
    b._kinds[FULL].reserved += 1  # a change made outside ``_change``
    with pytest.raises(BudgetError, match="6 units reserved in total, 5 over the 2 holders"):
        b.check()


def test_the_scheduler_checks_its_budget_whenever_it_is_idle() -> None:
    from hicache.config import config_from_dict
    from tests.support.rigs import Rig, gen

    rig = Rig(config_from_dict({"cache": {"page_size": PS, "l1": {"tokens": 256}, "l2": {"enabled": False},
                                          "l3": {"backend": "none"}}}))
    rig.run([gen("a", list(range(1, 30)), 4)])
    checks = rig.sched.counters.integrity_checks
    rig.sched.budget.reserve("ghost", {FULL: 1})  # a reservation no running request owns
    with pytest.raises(BudgetError, match="ghost"):
        rig.sched.check_idle()
    assert rig.sched.counters.integrity_checks == checks
    rig.sched.budget.release("ghost")
    rig.assert_idle()


def test_mamba_slots_hand_over_only_the_last_full_page_state_and_free_the_rest() -> None:
    from hicache.scheduler.component_hooks.mamba import MambaSlots

    alloc = PageAllocator(8, "mamba")

    def take() -> int | None:
        got = alloc.alloc(1)
        return got[0] if got is not None else None

    slots = MambaSlots.for_admission(alloc, take, PS, prompt_len=10, prefix=0)
    assert MambaSlots.needed(10, 0, PS) == 3 and MambaSlots.needed(10, 8, PS) == 2
    assert slots.branch_positions == [8] and slots.take_own() is not None
    snaps = slots.snapshots(0, 10)  # the prompt boundary and the last page boundary: both at 8
    assert [pos for pos, _ in snaps] == [8, 8] and alloc.used == 3
    slots.computed(snaps)
    (prompt,) = slots.pop_branches(10)
    assert prompt[0] == 8 and slots.pop_branches(10) == []
    alloc.free([prompt[1]])  # what the tree does with it
    keep = slots.hand_over(9)  # 9 tokens computed: the last full page ends at 8
    assert keep == snaps[1][1] and alloc.used == 1
    alloc.free([keep])
    again = MambaSlots.for_admission(alloc, take, PS, prompt_len=10, prefix=8)
    assert again.branch_positions == [] and again.take_own() is not None
    again.computed(again.snapshots(8, 12))
    again.forward_failed()  # the boundary snapshot may be garbage: never handed over
    assert again.hand_over(12) is None and alloc.used == 0
    third = MambaSlots.for_admission(alloc, take, PS, prompt_len=10, prefix=0)
    third.take_own()
    third.snapshots(0, 10)
    third.free_all()
    assert alloc.used == 0 and third.own is None


def test_branch_points_are_the_prompt_end_the_fork_and_every_interval_past_the_prefix() -> None:
    from hicache.scheduler.component_hooks.mamba import MambaSlots

    assert MambaSlots.branch_points(100, 0, PS) == [96]
    assert MambaSlots.branch_points(100, 0, PS, fork=40) == [40, 96]
    assert MambaSlots.branch_points(100, 16, PS, fork=40, interval=32) == [32, 40, 64, 96]
    assert MambaSlots.branch_points(100, 64, PS, fork=40, interval=32) == [96]  # at or below the prefix: cached
    assert MambaSlots.branch_points(100, 0, PS, fork=98) == [96]  # past the prompt boundary: not a branch


def test_branch_snapshots_are_taken_in_the_pass_that_reaches_them_and_handed_over_in_order() -> None:
    from hicache.scheduler.component_hooks.mamba import MambaSlots

    alloc = PageAllocator(16, "mamba")

    def take() -> int | None:
        got = alloc.alloc(1)
        return got[0] if got is not None else None

    slots = MambaSlots.for_admission(alloc, take, PS, prompt_len=50, prefix=0, fork=12, interval=16)
    assert slots.branch_positions == [12, 16, 32, 48]
    slots.take_own()
    first = slots.snapshots(0, 20)  # one chunk of 20 tokens: branches 12 and 16, boundary 20
    assert [p for p, _ in first] == [12, 16, 20]
    slots.computed(first)
    assert [p for p, _ in slots.pop_branches(20)] == [12, 16]
    second = slots.snapshots(20, 50)
    assert [p for p, _ in second] == [32, 48, 48]
    slots.computed(second)
    assert slots.boundary_pos == 48 and [p for p, _ in slots.pop_branches(50)] == [32, 48]
