"""Messages an engine's connector receives from the cache server (answers to
``protos.to_cache_server`` requests; ``req`` is the request's number)."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.base import Message, message

__all__ = ["BUSY", "EngineError", "EngineMessage", "EngineRegistered", "L2PoolInfo", "LookupResult", "Reservation",
           "ReserveResult"]


class EngineMessage(Message):
    """Base of everything the cache server answers an engine."""

    __slots__ = ()


@dataclass(frozen=True)
class L2PoolInfo:
    """Where engines map the L2 pool (``EngineRegistered.pool``): shared-memory segments in
    ``directory`` whose names start with ``instance`` (this daemon run's). ``segment`` holds
    ``pages`` pages' full parts of ``page_bytes`` each (page ``i`` at byte ``i * page_bytes``;
    the whole page without window layers; no segment and 0 bytes when every layer has the
    window)."""

    instance: str
    segment: str
    directory: str
    pages: int
    page_bytes: int
    """Bytes of a page's full part (the whole page without window layers)."""
    window_segment: str = ""
    window_pages: int = 0
    window_page_bytes: int = 0
    """The pool of window parts (none without window layers)."""
    state_segment: str = ""
    state_slots: int = 0
    state_bytes: int = 0
    """The pool of states (none without state layers)."""


@message("engine_registered")
@dataclass(slots=True)
class EngineRegistered(EngineMessage):
    """The session is open. ``pool`` says where the engine maps the L2 pool (its full
    parts, and with window layers the window parts, with state layers the states).
    ``run`` (random per start) is what every later message of the session carries. The
    session expires ``lease_ttl_s`` after the last message it sent."""

    req: int
    session: int
    run: int
    pool: L2PoolInfo
    lease_ttl_s: float


@message("engine_lookup_result")
@dataclass(slots=True)
class LookupResult(EngineMessage):
    """``host_pages[i]`` is the L2 page holding page ``i`` of the looked-up tokens, locked
    under ``lease`` (0: nothing locked). ``storage_pages`` of them arrived from L3 for this
    lookup. ``pending``: a prefetch from L3, or another engine's save of the pages after the
    hit, is in flight; ask again later (nothing is locked).
    With window layers, ``host_pages`` hold the full parts and ``window_pages`` the window
    parts of the *last* ``len(window_pages)`` pages (the window before the hit's end), locked
    too; the pages before them have none here. With state layers, ``state_slot`` holds the
    state after the hit's last page, locked too (a hit ends only where a state is kept;
    -1 with no hit)."""

    req: int
    lease: int = 0
    host_pages: list[int] = field(default_factory=list)
    storage_pages: int = 0
    pending: bool = False
    window_pages: list[int] = field(default_factory=list)
    state_slot: int = -1


@dataclass(slots=True)
class Reservation:
    """The answer to one ``SaveRange``: save pages ``start_page ..`` into ``host_pages`` (in
    order), then ``Commit(lease)``. ``start_page`` may be later than asked (the server held
    those pages already); no ``host_pages`` (lease 0): nothing to save. ``code`` names why
    the range was refused (``unknown_request``: send its tokens again with ``base`` 0;
    ``bad_request``), "" when it was not. With window layers, ``host_pages`` take the full
    parts and ``window_pages[i]`` the window part of page ``window_at[i]`` of the prefix: the
    window before the range's end, and before the first page the server lacked where no hit
    can end yet (a prefix other requests go on from), from ``SaveRange.window_from`` on;
    there may be window parts and no ``host_pages``. With state layers, ``state_slots[i]``
    takes the state after page ``state_at[i]`` (one of ``SaveRange.state_pages`` the server
    lacks); there may be states and no ``host_pages``."""

    lease: int = 0
    start_page: int = 0
    host_pages: list[int] = field(default_factory=list)
    code: str = ""
    reason: str = ""
    window_pages: list[int] = field(default_factory=list)
    window_at: list[int] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)
    state_at: list[int] = field(default_factory=list)


@message("engine_reserve_result")
@dataclass(slots=True)
class ReserveResult(EngineMessage):
    """``items[i]`` answers the ``Reserve``'s ``items[i]``."""

    req: int
    items: list[Reservation] = field(default_factory=list)


@message("engine_error")
@dataclass(slots=True)
class EngineError(EngineMessage):
    """Request ``req`` was refused. ``code``: ``refused`` (registration does not match what
    the daemon serves), ``unknown_session`` and ``stale_run`` (register again),
    ``unknown_request`` (a ``Lookup`` named tokens the server does not hold: send them all),
    ``bad_request``, ``BUSY`` (the daemon's queue for this engine is full: the engine goes on
    without the cache for this request or step; nothing was done)."""

    req: int
    code: str
    reason: str


BUSY = "busy"
"""The ``EngineError.code`` of a ``Lookup`` or ``Reserve`` the daemon did not serve because
the engine's queue was past its bound (``engine.queue_limit``): a lookup of no hit, a step
that saves nothing. Nothing of the request changed on the daemon."""
