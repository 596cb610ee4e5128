"""The scheduler side's view of each request vLLM asked about, and the save range of each step.

A ``Tracked`` follows its request's block tables every step (``follow_step``); the save
range of a step (``Tracked.save_range``) names the blocks that are full once the step ran
and that the daemon does not hold yet (``saved_pages``), never a stale one (``StaleBlocks``),
with the tokens the daemon does not hold for it (``known_tokens``, the range's ``base``)
and, with state layers, the states vLLM offered in this step (``take_state_offers``: an offer
holds for its step only). docs/architecture.md §13.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import protos
from hicache.connectors.kv_copy import NO_BLOCK
from hicache.connectors.stale_blocks import StaleBlocks
from hicache.connectors.token_pack import PackedTokens
from hicache.connectors.vllm.layout import VllmKVLayout
from hicache.connectors.vllm.plans import VLLM_NULL_BLOCK, Hit

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


@dataclass
class StepRange:
    """A request scheduled in this step: the tokens it had computed before the step and will
    have computed after it."""

    tracked: Tracked
    computed_before: int
    computed_after: int


@dataclass
class Tracked:
    """The scheduler side's view of one request (``SchedulerSide._requests``)."""

    request: Request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group, as vLLM gave them
    saved_pages: int = 0  # pages [0, saved_pages) are in the daemon or planned for saving
    known_tokens: int = 0  # tokens the daemon holds for this request (a message's base counts from them)
    packed: PackedTokens = field(default_factory=PackedTokens)  # its prompt and the tokens its saves named,
    # packed once: every message's tokens are a span of these
    saves_closed: bool = False  # began before a cache reset (its KV may be of the old weights)
    retry_at: float = 0.0  # pending on an L3 prefetch: not asked again before this (monotonic)
    pending_wait: float = 0.0  # the current wait between two asks while pending
    pending_since: float = 0.0  # when its lookup was first answered pending (0: it was not)
    lookups_closed: bool = False  # an asynchronous load of it failed: it computes its prompt itself
    hit: Hit | None = None
    state_offers: dict[int, list[int]] = field(default_factory=dict)  # page j -> per group, the block
    # holding the state after it, offered by vLLM in this step (state layers only) ...
    state_blocks: dict[int, list[int]] = field(default_factory=dict)  # ... and those its save range names
    loaded_tokens: int = 0
    loaded_storage_tokens: int = 0

    def save_range(self, layout: VllmKVLayout, stale: StaleBlocks, computed_before_step: int,
                   computed_after_step: int) -> tuple[protos.SaveRange, int] | None:
        """The save range of the blocks that are full once this step ran, beyond
        ``saved_pages``, with the tokens it ends at; None when there are none. With window
        layers, the range names the first page whose window blocks the request holds in this
        step: vLLM freed those wholly more than the window behind ``computed_before_step``."""
        offers, self.state_offers = self.state_offers, {}
        if self.saves_closed or not self.block_ids:
            return None
        bs = layout.block_size
        tokens = self.request.all_token_ids
        if not offers and min(computed_after_step, len(tokens)) // bs <= self.saved_pages:
            return None  # no block becomes full in this step (most decode steps): nothing to ask
        full = min(computed_after_step, len(tokens), min(len(self.block_ids[g]) for g in layout.kv_groups) * bs) // bs
        full = stale.first_stale(self.block_ids[layout.kv_groups[0]], full)  # never a stale block
        start = self.saved_pages
        state_pages = sorted(j for j in offers if j < full)
        if full <= start and not state_pages:
            return None
        self.saved_pages = max(start, full)
        end = full * bs
        base = min(self.known_tokens, end)  # the daemon holds these: send only the tokens after them
        window_from = max(0, computed_before_step - layout.window_tokens + 1) // bs if layout.windowed else 0
        prompt = len(self.request.prompt_token_ids or ())
        repeat_end = (prompt - 1) // bs if layout.windowed and full == prompt // bs else 0
        self.packed.extend(tokens, end)  # computed tokens: vLLM never rewrites them
        item = protos.SaveRange(self.request.request_id, self.packed.span(base, end), start,
                                self.request.cache_salt or "", base, window_from, repeat_end, state_pages)
        self.state_blocks = {j: offers[j] for j in state_pages}
        return item, end


def follow_step(requests: dict[str, Tracked], scheduler_output: SchedulerOutput) -> list[StepRange]:
    """Follow the step's block tables into the tracked requests (new, added to, or replaced
    for a resumed request) and return each scheduled request's range of computed tokens."""
    scheduled = scheduler_output.num_scheduled_tokens
    ranges: list[StepRange] = []
    for new in scheduler_output.scheduled_new_reqs:
        tracked = requests.get(new.req_id)
        if tracked is not None:
            tracked.block_ids = [list(ids) for ids in new.block_ids]
            ranges.append(StepRange(tracked, new.num_computed_tokens,
                                     new.num_computed_tokens + scheduled.get(new.req_id, 0)))
    cached = scheduler_output.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        tracked = requests.get(rid)
        if tracked is None:
            continue
        new_blocks = cached.new_block_ids[i]
        if rid in cached.resumed_req_ids:
            tracked.block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
        elif new_blocks:
            if not tracked.block_ids:
                tracked.block_ids = [[] for _ in new_blocks]
            for held, more in zip(tracked.block_ids, new_blocks, strict=True):
                held.extend(more)
        computed = cached.num_computed_tokens[i]
        ranges.append(StepRange(tracked, computed, computed + scheduled.get(rid, 0)))
    return ranges


def fresh_blocks(scheduler_output: SchedulerOutput) -> frozenset[int]:
    """Every block vLLM gives a scheduled request in this step, of every KV cache group, tracked
    or not (vLLM's null block aside): the blocks a forward pass may write for the first time
    since vLLM freed them."""
    fresh: set[int] = set()
    for new in scheduler_output.scheduled_new_reqs:
        for ids in new.block_ids:
            fresh.update(ids)
    for more in scheduler_output.scheduled_cached_reqs.new_block_ids:
        for ids in more or ():
            fresh.update(ids)
    fresh.discard(VLLM_NULL_BLOCK)
    return frozenset(fresh)


def take_state_offers(requests: dict[str, Tracked], layout: VllmKVLayout, scheduler_output: SchedulerOutput
                      ) -> list[Tracked]:
    """Note the states vLLM offers in this step (``boundary_state_offloads``: in align
    mode, the block holding each state it keeps, at the end of the step that computes
    it, whose bytes stay until the step ends): per request, the pages after which every
    state group offered its block. States inside a block (vLLM's partial tails) are not
    kept: a page is a whole block. Returns the requests noted (their offers are dropped
    at the end of the pass, whether their save range took them or not)."""
    block_state = scheduler_output.kv_connector_block_state
    offers = block_state.boundary_state_offloads if block_state is not None else {}
    bs = layout.block_size
    noted: list[Tracked] = []
    for rid, entries in offers.items():
        tracked = requests.get(rid)
        if tracked is None:
            continue
        noted.append(tracked)
        by_page: dict[int, list[int]] = {}
        for group, block, tokens in entries:
            if tokens <= 0 or tokens % bs or group not in layout.state_groups:
                continue
            by_page.setdefault(tokens // bs - 1, [NO_BLOCK] * layout.num_groups)[group] = block
        tracked.state_offers = {j: blocks for j, blocks in by_page.items()
                                if all(blocks[g] not in (NO_BLOCK, VLLM_NULL_BLOCK) for g in layout.state_groups)}
    return noted
