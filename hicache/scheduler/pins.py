"""Pinned prefixes: token prefixes kept in the tiers named and never evicted from them.

The operator names them in ``cache.pinned`` (the tokenizer process pins those before it
opens the HTTP port) or at run time with ``PUT /cache/pinned``; ``DELETE /cache/pinned/NAME``
lets one go. They reach the scheduler as admin ops (``AdminRequest`` ``pin``, ``unpin``,
``pins``), and ``Scheduler`` hands them to ``PinnedPrefixes``.

A pin's life (``PinState``):

==========  ================================================  ==============================
state       meaning                                           leaves it when
==========  ================================================  ==============================
computing   an internal request of the prefix (one output     it finishes and its lock fits
            token, greedy) goes the way every request goes:   L1's budget (-> writing, or
            matched in L1, loaded from L2, prefetched from    pinned), or fails (the pin is
            L3, the rest computed                             dropped, its caller gets the
                                                              error)
writing     L1-locked; the L2 copies of its path are being    every node of the path has its
            written (pins naming l2)                          L2 copy (-> pinned)
pinned      locked in each tier named                         ``unpin`` (or a ``pin`` of the
                                                              same name, which replaces it)
==========  ================================================  ==============================

What a pin holds, and who releases it (only ``unpin`` / a replacing ``pin`` do):

- ``l1``: one ``inc_lock_ref`` on the node that ends the prefix; the Full lock holds the
  whole path to the root, each auxiliary component its own part (an SWA window, a Mamba
  state), so the prefix stays a valid match for every component. Taken only when what it
  makes unevictable fits the L1 budget (``L1Budget.lock_if_room``): a computed pin waits
  for running requests to give room back rather than take what they were promised;
- ``l2``: one ``protect_host`` per node of the path, each released with the page count it
  returned (a node split meanwhile is walked up from, as for every host lock);
- while ``writing``, a temporary L1 lock (even for a pin without ``l1``) so the pages cannot
  leave L1 before their L2 copies exist.

Bounded time: once its internal request has finished, a pin is pinned within ``settle_s``
(``PIN_SETTLE_S``) or fails, releasing what it holds: a lock L1's budget never finds room
for, or L2 copies that cannot be written (L2 held by other pins, a tenant's L2 quota
smaller than the prefix), would otherwise hold its temporary lock for good. A pin in that
stretch may be unpinned (its callers are told it failed); only a pin whose request still
runs is "still being pinned".

Only whole pages are pinned: a prefix's partial last page is computed by every request, as
for any cached prefix. Sizes: each tier's pins together may take at most
``cache.pinned_fraction`` of that tier; a pin past it is refused, naming it, the share and
the pins that hold it. Every lock counts: a pin naming l2 alone takes its share of L1 too,
for its temporary lock (``holds_l1``). Two pins that share pages count them twice (never too little). The
internal requests' outputs never reach the tokenizer (``owns`` / ``on_output``).

Tenants: a pin belongs to the tenant of its ``cache_salt`` (``Pin.tenant``; None: no
tenant's) and is named within that tenant: ``(tenant, name)`` is its key, so two tenants'
pins of one name are two pins. An op whose ``args`` carry ``"tenant"`` is that tenant's own
call (the tokenizer sets it from the caller's key): it sees, replaces and unpins only that
tenant's pins, may pin only in that tenant's namespace and within its budget
(``server.api_keys[].quota.pinned_tokens`` per tier; none: it cannot pin), and a refusal
names none of another tenant's pins. An op without it is the operator's: every pin, the
shares only (``unpin`` then names the pin's tenant in ``"owner"``).

Tiers: L1 and L2. L3 is where a pinned prefix comes back from after a restart (its pages are
backed up like any others); L3 stores evict on their own terms (the file store's size bound,
Redis's ``maxmemory``), so a pin does not hold pages there.
"""

from __future__ import annotations

import enum
import itertools
import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import protos
from hicache.config import PIN_NAME_RE, HicacheConfig
from hicache.scheduler.state import SchedulerState
from hicache.tenants import split_tenant_salt, tenant_of_salt
from hicache.tree.base import MatchResult
from hicache.tree.node import KEY_TYPECODE, LockToken, TreeNode

log = logging.getLogger("hicache.scheduler.pins")

PinKey = tuple[str | None, str]
"""A pin's key: (its tenant, its name)."""

PIN_RID_PREFIX = "pin:"
"""Internal request ids; the tokenizer's ids are hex, so they never collide."""
PIN_TIERS = ("l1", "l2")
PIN_SETTLE_S = 60.0
"""The most a pin may take from the end of its internal request to pinned (module docstring)."""


class PinState(enum.Enum):
    """A pin's state (the table above); the value is its name in ``/cache/pinned``."""

    COMPUTING = "computing"
    WRITING = "writing"
    PINNED = "pinned"


class PinRefused(ValueError):
    """A pin that cannot be taken (the message says why, naming it)."""


@dataclass
class Pin:
    """One pinned prefix. ``pages``: the whole pages pinned; ``waiters``: admin rids to
    answer once it is pinned (or failed)."""

    name: str
    tokens: array[int]
    salt: str
    tiers: tuple[str, ...]
    pages: int
    rid: str
    state: PinState = PinState.COMPUTING
    waiters: list[str] = field(default_factory=list)
    usage: protos.Usage | None = None
    l1_lock: LockToken | None = None
    hold: LockToken | None = None
    """The temporary L1 lock of ``writing``."""
    l2_locks: list[tuple[TreeNode, int]] = field(default_factory=list)
    outcome: protos.TokenOutput | None = None
    """The internal request's final output, until ``poll`` takes it up."""
    computed_at: float | None = None
    """When the internal request finished (None: it runs); ``settle_s`` counts from here."""

    def holds_l1(self) -> bool:
        """Whether it holds, or will hold, an L1 lock: pins naming l1, and pins naming l2
        until pinned (the temporary lock of ``writing``)."""
        return "l1" in self.tiers or ("l2" in self.tiers and self.state is not PinState.PINNED)

    @property
    def tenant(self) -> str | None:
        return tenant_of_salt(self.salt)

    @property
    def key(self) -> PinKey:
        return self.tenant, self.name

    def describe(self, page_size: int) -> dict[str, Any]:
        u = self.usage
        tenant, salt = split_tenant_salt(self.salt) or (None, self.salt)
        return {"name": self.name, "state": self.state.value, "tokens": self.pages * page_size,
                "prompt_tokens": len(self.tokens), "tiers": list(self.tiers), "tenant": tenant, "cache_salt": salt,
                "loaded": None if u is None else {"device": u.cached_device, "host": u.cached_host,
                                                  "storage": u.cached_storage}}


def pin_budgets(cfg: HicacheConfig) -> dict[str, int]:
    """Per tenant, its pin budget in tokens (``server.api_keys[].quota.pinned_tokens``)."""
    return {k.tenant: k.quota.pinned_tokens for k in cfg.server.api_keys if k.quota is not None and k.quota.pinned_tokens}


def parse_pin_args(args: dict[str, Any]) -> tuple[str, list[int], str, tuple[str, ...]]:
    """``(name, input_ids, cache_salt, tiers)`` of a ``pin`` op (tiers absent or None: ``()``,
    every tier that is on); ``PinRefused`` naming the first bad field."""
    name = args.get("name")
    if not isinstance(name, str) or not PIN_NAME_RE.match(name):
        raise PinRefused(f"name must be 1-64 letters, digits, '.', '_' or '-' (first a letter or digit), "
                         f"got {name!r}")
    ids = args.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise PinRefused(f"pinned prefix {name!r}: input_ids must be a non-empty list of token ids")
    salt = args.get("cache_salt", "")
    if not isinstance(salt, str):
        raise PinRefused(f"pinned prefix {name!r}: cache_salt must be a string")
    tiers = args.get("tiers")
    if tiers is None:
        return name, ids, salt, ()
    if (not isinstance(tiers, list) or not tiers or len(set(tiers)) != len(tiers)
            or not all(t in PIN_TIERS for t in tiers)):
        raise PinRefused(f"pinned prefix {name!r}: tiers must be a non-empty subset of {list(PIN_TIERS)}, "
                         f"got {tiers!r}")
    return name, ids, salt, tuple(t for t in PIN_TIERS if t in tiers)


class PinnedPrefixes:
    """The pins of one scheduler (see the module docstring). ``submit`` queues an internal
    request as the tokenizer's are queued; ``reply`` answers an admin rid."""

    def __init__(self, state: SchedulerState, submit: Callable[[protos.GenerateRequest], None],
                 reply: Callable[[protos.AdminReply], None], fraction: float,
                 budgets: dict[str, int] | None = None, settle_s: float = PIN_SETTLE_S) -> None:
        """``budgets``: per tenant, the tokens its own pins may hold in each tier;
        ``settle_s``: the bound of the module docstring's "Bounded time"."""
        self.s = state
        self.settle_s = settle_s
        self.submit = submit
        self.reply = reply
        self.fraction = fraction
        self.budgets = dict(budgets or {})
        self.pins: dict[PinKey, Pin] = {}
        self._by_rid: dict[str, Pin] = {}
        self._seq = itertools.count(1)

    # ---------------------------------------------------------------- sizes
    def capacity_pages(self, tier: str) -> int:
        """The tier's Full pages (0 for an L2 that is off)."""
        c = self.s.cache.full
        a = c.allocator if tier == "l1" else c.host_allocator
        return 0 if a is None else a.capacity

    def pinned_pages(self, tier: str, but: PinKey | None = None) -> int:
        """The pages pins hold in ``tier`` (but the pin ``but``)."""
        return sum(p.pages for p in self._pins_in(tier, but))

    def own_pinned_pages(self, tier: str, tenant: str | None, but: PinKey | None = None) -> int:
        """The pages ``tenant``'s pins hold in ``tier`` (but the pin ``but``)."""
        return sum(p.pages for p in self._pins_in(tier, but) if p.tenant == tenant)

    def _pins_in(self, tier: str, but: PinKey | None) -> list[Pin]:
        return [p for p in self.pins.values() if p.key != but and (p.holds_l1() if tier == "l1" else tier in p.tiers)]

    def _check_share(self, key: PinKey, pages: int, tiers: tuple[str, ...], caller: str | None) -> None:
        """Refuse a pin past a tier's share, or past the budget of ``caller`` (a tenant
        pinning for itself; None: the operator); a tenant's refusal names only its own pins."""
        ps = self.s.page_size
        tenant, name = key
        if "l2" in tiers and "l1" not in tiers:
            tiers = ("l1", *tiers)  # its temporary L1 lock while writing counts too
        for tier in tiers:
            cap = self.capacity_pages(tier)
            if cap == 0:
                raise PinRefused(f"pinned prefix {name!r} names {tier}, which is off")
            share = int(cap * self.fraction)
            if caller is not None:
                budget = self.budgets.get(caller, 0) // ps
                own = self.own_pinned_pages(tier, tenant, but=key)
                if own + pages > budget:
                    raise PinRefused(
                        f"pinned prefix {name!r} ({pages * ps} tokens) does not fit tenant {caller!r}'s pin budget "
                        f"in {tier.upper()}: {budget * ps} tokens (server.api_keys[].quota.pinned_tokens), "
                        f"{own * ps} pinned by its other pins")
            held = self.pinned_pages(tier, but=key)
            if held + pages > share:
                if caller is None:
                    named = sorted(p.name for p in self._pins_in(tier, key))
                    held_by = f"{held * ps} already pinned" + (f" by {', '.join(named)}" if named else "")
                else:  # a tenant learns nothing of other tenants' pins
                    held_by = f"too little of it is left ({self.own_pinned_pages(tier, tenant, but=key) * ps} by your pins)"
                raise PinRefused(
                    f"pinned prefix {name!r} ({pages * ps} tokens) does not fit {tier.upper()}'s share for pinned "
                    f"prefixes: {share * ps} of {cap * ps} tokens (cache.pinned_fraction {self.fraction:g}), {held_by}")

    # ---------------------------------------------------------------- admin ops
    def pin(self, admin_rid: str, args: dict[str, Any]) -> None:
        """Start pinning (the reply comes once it is pinned); a pin of the same name is
        replaced once the new one is taken. Refusals are answered at once."""
        caller = args.get("tenant")
        try:
            name, ids, salt, tiers = parse_pin_args(args)
            if caller is not None and tenant_of_salt(salt) != caller:
                raise PinRefused(f"pinned prefix {name!r}: a tenant pins in its own namespace only")
            key: PinKey = (tenant_of_salt(salt), name)
            tiers = tiers or tuple(t for t in PIN_TIERS if self.capacity_pages(t))
            if self.s.cache.aux and "l1" not in tiers:
                raise PinRefused(f"pinned prefix {name!r}: this model's windows and states are held in L1, "
                                 "so its pins must name l1")
            pages = len(ids) // self.s.page_size
            if pages == 0:
                raise PinRefused(f"pinned prefix {name!r} has {len(ids)} tokens, less than one page "
                                 f"({self.s.page_size}): nothing to pin")
            old = self.pins.get(key)
            if old is not None and old.state is not PinState.PINNED:
                raise PinRefused(f"pinned prefix {name!r} is still being pinned; retry when it is")
            self._check_share(key, pages, tiers, caller)
        except PinRefused as exc:
            self.reply(protos.AdminReply(admin_rid, False, {"refused": True}, str(exc)))
            return
        rid = f"{PIN_RID_PREFIX}{name}:{next(self._seq)}"
        pin = Pin(name, array(KEY_TYPECODE, ids), salt, tiers, pages, rid, waiters=[admin_rid])
        if old is not None:
            self._release(old)
            del self.pins[key]
        self.pins[key] = pin
        self._by_rid[rid] = pin
        self.submit(protos.GenerateRequest(rid, ids, protos.SamplingParams(max_new_tokens=1), False, salt))

    def unpin(self, admin_rid: str, args: dict[str, Any]) -> None:
        """Let the pin ``args["name"]`` of the caller (``"tenant"``) go, or the operator's
        choice of tenant (``"owner"``; absent: the pin of no tenant)."""
        name = args.get("name")
        owner = args["tenant"] if args.get("tenant") is not None else args.get("owner")
        pin = self.pins.get((owner, name)) if isinstance(name, str) else None
        if pin is None:
            self.reply(protos.AdminReply(admin_rid, False, {"missing": True}, f"no pinned prefix named {name!r}"))
            return
        if pin.state is not PinState.PINNED and pin.computed_at is None:
            self.reply(protos.AdminReply(admin_rid, False, {"refused": True},
                                         f"pinned prefix {name!r} is still being pinned; retry when it is"))
            return
        if pin.state is not PinState.PINNED:  # computed, waiting for room or for its L2 copies
            self._fail(pin, "unpinned before it was pinned", refused=False)
        else:
            self._release(pin)
            del self.pins[pin.key]
        self.reply(protos.AdminReply(admin_rid, True, {"unpinned": pin.name, "tokens": pin.pages * self.s.page_size}))

    def listing(self, tenant: str | None = None) -> dict[str, Any]:
        """Every pin and each tier's share; for ``tenant`` (a tenant's own call), its pins
        only, what they hold and its budget."""
        ps = self.s.page_size
        if tenant is None:
            tiers = {t: {"pinned_tokens": self.pinned_pages(t) * ps,
                         "share_tokens": int(self.capacity_pages(t) * self.fraction) * ps} for t in PIN_TIERS}
            return {"pinned": [p.describe(ps) for p in self.pins.values()], "tiers": tiers}
        budget = self.budgets.get(tenant, 0) // ps * ps
        tiers = {t: {"pinned_tokens": self.own_pinned_pages(t, tenant) * ps, "budget_tokens": budget}
                 for t in PIN_TIERS}
        return {"pinned": [p.describe(ps) for p in self.pins.values() if p.tenant == tenant], "tiers": tiers}

    # ---------------------------------------------------------------- the internal requests
    def owns(self, rid: str) -> bool:
        return rid in self._by_rid

    def on_output(self, out: protos.TokenOutput) -> None:
        """An output of a pin's internal request (called instead of sending it to the
        tokenizer). The final one is kept for ``poll``: the tree is not changed from inside
        a finishing request."""
        if out.finished:
            pin = self._by_rid.pop(out.rid)
            pin.outcome = out
            pin.computed_at = self.s.clock()

    def poll(self) -> None:
        """Advance every pin that can: computed ones are locked, written ones protected; a
        pin past ``settle_s`` fails."""
        now = self.s.clock()
        for pin in list(self.pins.values()):
            try:
                if (pin.state is not PinState.PINNED and pin.computed_at is not None
                        and now - pin.computed_at > self.settle_s):
                    why = ("its L2 copies could not be written (L2 held by other pins, or its tenant's L2 quota "
                           "smaller than the prefix)" if pin.state is PinState.WRITING
                           else "L1 had no room for its lock (running requests held it)")
                    self._fail(pin, f"not pinned within {self.settle_s:g} s of computing it: {why}", refused=False)
                elif pin.outcome is not None:
                    out, pin.outcome = pin.outcome, None
                    self._computed(pin, out)
                elif pin.state is PinState.WRITING:
                    self._try_protect_l2(pin)
            except Exception as exc:  # a bug here must not stop the scheduler: that pin fails alone
                log.exception("pinned prefix %s failed", pin.name)
                self._fail(pin, f"internal error while pinning: {type(exc).__name__}: {exc}", refused=False)

    def _computed(self, pin: Pin, out: protos.TokenOutput) -> None:
        if out.finish_reason in ("error", "abort"):
            self._fail(pin, out.error or f"the prefix's request ended with {out.finish_reason}")
            return
        pin.usage = out.usage
        cache = self.s.cache
        m = cache.match_prefix(pin.tokens, pin.salt, copy_on_match=False)
        want = pin.pages * self.s.page_size
        if m.device_len < want:
            self._fail(pin, f"only {m.device_len} of its {want} tokens were in L1 after computing it")
            return
        node = m.last_device_node
        lock = self.s.budget.lock_if_room(node)
        if lock is None:  # it would take what running requests were promised: wait for them
            pin.outcome = out
            return
        if "l1" in pin.tiers:
            pin.l1_lock = lock
        if "l2" in pin.tiers:
            if pin.l1_lock is None:
                pin.hold = lock
            pin.state = PinState.WRITING
            self._try_protect_l2(pin, m)
        else:
            self._done(pin)

    def _try_protect_l2(self, pin: Pin, m: MatchResult | None = None) -> None:
        """Protect the path's L2 copies once all exist; write the missing ones meanwhile."""
        if m is None:
            m = self.s.cache.match_prefix(pin.tokens, pin.salt, copy_on_match=False)
        missing = [n for n in m.path or () if n.data[0].host_value is None]
        if missing:
            tier = self.s.tier
            if tier is None:
                self._fail(pin, "L2 is off: nothing writes its pages to L2")
                return
            tier.write_nodes([n for n in missing if not n.in_flight and not n.loading])
            return
        pin.l2_locks = self.s.cache.host.protect_host_path(m.last_device_node)
        if pin.hold is not None:
            self.s.cache.dec_lock_ref(pin.hold)
            pin.hold = None
        self._done(pin)

    def _done(self, pin: Pin) -> None:
        pin.state = PinState.PINNED
        log.info("pinned prefix %s: %d tokens in %s", pin.name, pin.pages * self.s.page_size, "+".join(pin.tiers))
        result = pin.describe(self.s.page_size)
        for rid in pin.waiters:
            self.reply(protos.AdminReply(rid, True, result))
        pin.waiters = []

    def _fail(self, pin: Pin, error: str, refused: bool = True) -> None:
        """Drop ``pin`` and answer its callers; ``refused``: the prefix itself is the cause
        (the request of it was refused or failed), not the scheduler."""
        log.warning("pinned prefix %s not pinned: %s", pin.name, error)
        self._release(pin)
        self.pins.pop(pin.key, None)
        self._by_rid.pop(pin.rid, None)
        for rid in pin.waiters:
            self.reply(protos.AdminReply(rid, False, {"refused": refused}, f"pinned prefix {pin.name!r}: {error}"))
        pin.waiters = []

    def _release(self, pin: Pin) -> None:
        """Give back every lock ``pin`` holds (the table in the module docstring)."""
        cache = self.s.cache
        for lock in (pin.l1_lock, pin.hold):
            if lock is not None:
                cache.dec_lock_ref(lock)
        pin.l1_lock = pin.hold = None
        for node, npages in pin.l2_locks:
            cache.host.release_host(node, npages)
        pin.l2_locks = []

    @property
    def l1_pages(self) -> int:
        """L1 pages pins hold locked now (what running requests can never use)."""
        return sum(p.pages for p in self.pins.values() if p.l1_lock is not None or p.hold is not None)
