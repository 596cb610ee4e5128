"""One generation request as the scheduler tracks it.

States and who moves a request between them:

==========  ===========================================  ===================================
state       meaning                                      leaves it when
==========  ===========================================  ===================================
waiting     queued; re-matched on every scheduling pass  admitted, or an L2/L3 tier op starts
prefetch    L3 pages are being fetched into L2           the ticket is ready (per policy)
loading     its L2-only prefix is being loaded into L1    the load is acknowledged
running     admitted: holds a tree lock and L1 pages     finished, aborted or failed
==========  ===========================================  ===================================

A request leaves every state by ``Finisher.finish`` (``hicache.scheduler.finishing``; also
when serving it raised: see
``Finisher.fail_request``), which gives back what it holds and emits its final output
(``finished``).

A running request's ``state`` (``RequestState``) is what the tree sees: its token ids
(prompt + output), its L1 pages (and SWA pages, Mamba state slot), the tree-owned prefix
length and its lock. ``computed`` is how many of those tokens have KV in the pages; the
last sampled token never has KV yet.

L1 reservations (the pages and slots a running request may still allocate) are kept by the
scheduler's ``L1Budget`` (``hicache.scheduler.budget``), keyed by the request id, not here.

Mamba models: a running request's state slots are its ``mamba`` (``MambaSlots``), the one
object that assigns and frees them: its own slot (``own``, which admission also sets as
``tree.aux["mamba"]``, the tree's view), the branch snapshots (``taken``: the states after
the ``branch_positions`` its prefill passes: the prompt boundary, the fork from a cached
path, every ``cache.mamba_branch_interval`` tokens; each handed to the tree as soon as the
prefill passes it) and the boundary snapshot (``boundary``: the state after ``boundary_pos`` tokens, the latest page
boundary its forward passes crossed; handed to the tree at finish when it is the last full
page). Which call moves a slot where:

==================  ==========================================  ==========================
call                takes                                       gives away / frees
==================  ==========================================  ==========================
``take_own``        the own slot (admission)                    --
``snapshots``       branch / boundary slots (when needed)       --
``pop_branches``    --                                          the branch slots passed, to
                                                                the caller (``cache_unfinished_req``)
``hand_over``       --                                          the boundary slot to the
                                                                caller when it is the last
                                                                full page; frees the rest
``free_all``        --                                          frees every slot
==================  ==========================================  ==========================
"""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from hicache.config import STATE_SLOTS_PER_REQUEST
from hicache.memory.allocator import PageAllocator
from hicache.model.sampling import PenaltyState
from hicache.model.sampling_params import SamplingParams
from hicache.tier_manager import LoadTicket, PrefetchTicket
from hicache.tree.node import LockToken
from hicache.tree.request_state import RequestState


class RequestStatus(enum.Enum):
    """A request's state (the table above); the value is its name in metrics."""

    WAITING = "waiting"
    PREFETCH = "prefetch"
    LOADING = "loading"
    RUNNING = "running"


WAITING, PREFETCH, LOADING, RUNNING = (RequestStatus.WAITING, RequestStatus.PREFETCH, RequestStatus.LOADING,
                                       RequestStatus.RUNNING)


@dataclass(eq=False)
class MambaSlots:
    """A running request's Mamba state slots: the only code that assigns or frees them.

    ``take`` gets one slot (from the request's L1 reservation while it lasts:
    ``L1Budget.take``), or None when none can be had; ``allocator`` is the L1 state-slot
    allocator they go back to.

    ``branch_positions``: the page boundaries past the matched prefix whose state the
    prefill inserts into the tree as soon as it has passed them (ascending; see
    ``branch_points``): the prompt's last page boundary before its last token (a repeat of
    the prompt matches there), the point where the prompt forks from a cached path (a
    sibling sharing that prefix matches there), and every ``interval`` tokens (prefixes
    shared by requests not seen yet). ``taken``: the snapshots of those positions that
    forward passes were given and the tree has not taken yet.
    ``boundary_pos``: the position ``boundary`` holds the state after; -1 once a failed
    forward pass may have written it (it is then never handed over).
    """

    allocator: PageAllocator
    take: Callable[[], int | None]
    page_size: int
    branch_positions: list[int] = field(default_factory=list)
    own: int | None = None
    taken: list[tuple[int, int]] = field(default_factory=list)
    boundary: int | None = None
    boundary_pos: int = 0

    @staticmethod
    def prompt_boundary(prompt_len: int, page_size: int) -> int:
        """The prompt's last page boundary before its last token."""
        return (prompt_len - 1) // page_size * page_size

    @classmethod
    def branch_points(cls, prompt_len: int, prefix: int, page_size: int, fork: int = 0,
                      interval: int = 0) -> list[int]:
        """The positions whose state a request admitted with ``prefix`` cached tokens
        inserts while it prefills (ascending, each a page boundary in ``(prefix, prompt
        boundary]``): the prompt boundary, ``fork`` (where its prompt leaves the cached
        path: 0 for none) and the multiples of ``interval`` (0: none)."""
        end = cls.prompt_boundary(prompt_len, page_size)
        out = {end, fork}
        if interval > 0:
            out.update(range(interval, end, interval))
        return sorted(p for p in out if prefix < p <= end and p % page_size == 0)

    @classmethod
    def needed(cls, prompt_len: int, prefix: int, page_size: int) -> int:
        """Slots a request admitted with ``prefix`` cached tokens reserves: its own, one
        for the branch-point snapshots (unless the prefix already reaches the prompt
        boundary; further ones are taken only when free, never reserved) and a boundary one."""
        return STATE_SLOTS_PER_REQUEST - (1 if cls.prompt_boundary(prompt_len, page_size) <= prefix else 0)

    @classmethod
    def for_admission(cls, allocator: PageAllocator, take: Callable[[], int | None], page_size: int,
                      prompt_len: int, prefix: int, *, fork: int = 0, interval: int = 0) -> MambaSlots:
        return cls(allocator, take, page_size,
                   branch_positions=cls.branch_points(prompt_len, prefix, page_size, fork, interval))

    def take_own(self) -> int | None:
        """The request's own state slot (once, at admission); None when none can be had."""
        if self.own is not None:
            raise RuntimeError("the request already has its own state slot")
        self.own = self.take()
        return self.own

    def snapshots(self, start: int, end: int) -> list[tuple[int, int]]:
        """``(position, slot)`` snapshots for computing ``[start, end)``: every branch
        position in ``(start, end]`` and the last page boundary in ``(start, end]``. A
        snapshot no slot can be had for is skipped: that state is then not cached, never
        an error."""
        out: list[tuple[int, int]] = []
        while self.branch_positions and self.branch_positions[0] <= start:
            self.branch_positions.pop(0)  # passed without a snapshot (none could be had)
        for pos in [p for p in self.branch_positions if start < p <= end]:
            self.branch_positions.remove(pos)
            slot = self.take()
            if slot is not None:
                self.taken.append((pos, slot))
                out.append((pos, slot))
        b = end // self.page_size * self.page_size
        if b > start:
            if self.boundary is None:
                self.boundary = self.take()
            if self.boundary is not None:
                out.append((b, self.boundary))
        return out

    def computed(self, snapshots: list[tuple[int, int]]) -> None:
        """The forward pass that was given ``snapshots`` ran: record what they hold."""
        for pos, slot in snapshots:
            if slot == self.boundary:
                self.boundary_pos = pos

    def forward_failed(self) -> None:
        """A forward pass with snapshots failed: the boundary slot's content is unknown."""
        self.boundary_pos = -1

    def pop_branches(self, computed: int) -> list[tuple[int, int]]:
        """``(position, slot)`` of the branch snapshots ``computed`` tokens have passed,
        ascending; the slots are the caller's from then on (``cache_unfinished_req(aux=
        {"mamba": slot})``)."""
        done = [t for t in self.taken if t[0] <= computed]
        self.taken = [t for t in self.taken if t[0] > computed]
        return done

    def hand_over(self, computed: int) -> int | None:
        """At finish, before ``cache_finished_req``: the boundary slot when it holds the
        state after the last full page of the ``computed`` tokens (the caller's from then
        on), else None; every other slot, the own one included, is freed here."""
        aligned = computed // self.page_size * self.page_size
        keep = None
        spare = [s for s in (self.own, *(slot for _pos, slot in self.taken)) if s is not None]
        if self.boundary is not None:
            if aligned > 0 and self.boundary_pos == aligned:
                keep = self.boundary
            else:
                spare.append(self.boundary)
        self._clear()
        if spare:
            self.allocator.free(spare)
        return keep

    def free_all(self) -> None:
        """Free every slot held (an admission undone)."""
        spare = [s for s in (self.own, self.boundary, *(slot for _pos, slot in self.taken)) if s is not None]
        self._clear()
        if spare:
            self.allocator.free(spare)

    def _clear(self) -> None:
        self.own = self.boundary = None
        self.taken = []
        self.branch_positions = []
        self.boundary_pos = 0


@dataclass
class Request:
    rid: str
    input_ids: array[int]
    params: SamplingParams
    seed: int
    stream: bool
    cache_salt: str
    arrival: float = field(default_factory=time.monotonic)
    status: RequestStatus = WAITING
    output_ids: list[int] = field(default_factory=list)
    tree: RequestState | None = None
    computed: int = 0
    mamba: MambaSlots | None = None
    """Its Mamba state slots while admitted (Mamba models only)."""
    swa_handed: int = 0
    """SWA pages of its own the request handed to the tree at its prompt boundary; they stay
    charged to its SWA reservation until it finishes (``hicache.config.swa_request_pages``)."""
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    prefetch: PrefetchTicket | None = None
    load: LoadTicket | None = None
    """Its load-back (``TierManager.start_load_back``); the tier manager sets ``ok``."""
    hold: LockToken | None = None
    """The loaded prefix, locked from the load's ack (``Admission.load_finished``) to admission."""
    first_token_at: float | None = None
    admitted_at: float | None = None
    load_sent_at: float | None = None
    load_done_at: float | None = None
    sent_tokens: int = 0
    penalties: PenaltyState | None = None
    """Built on the first sampled token when ``params.penalized``."""
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    """Parallel to ``output_ids`` when ``params.logprobs`` is set (``sample.token_logprobs``)."""
    finished: bool = False
    """Its final output has been emitted (by ``Finisher.finish`` or ``fail_request``)."""

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage

    def all_tokens(self) -> array[int]:
        """Prompt + output so far (what the tree keys this request by)."""
        out = array(self.input_ids.typecode, self.input_ids)
        out.extend(self.output_ids)
        return out
