"""Pinned prefixes in the scheduler (``hicache.scheduler.pins``), on the in-process rigs.

A pinned prefix survives a flood of other prompts that evicts everything else from L1 and
L2, and a request starting with it gets it as a hit with the output it gets cold. Sizes past
the tier's share are refused by name; unpinning makes the pages evictable again; a pin
after a restart (a new scheduler on the same L3 directory) is loaded from L3, not computed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

import protos
from hicache.config import HicacheConfig, config_from_dict
from tests.support.rigs import L2Rig, L3Rig, Rig, cold_tokens, gen


def _cfg(l2: bool = True, **cache: Any) -> HicacheConfig:
    return config_from_dict({
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 256}, "l2": {"enabled": l2, "tokens": 512},
                  "l3": {"backend": "none"}, "load_back_threshold": 0, **cache},
        "scheduler": {"chunked_prefill_tokens": 64, "max_prefill_tokens": 128},
    })


class Admin:
    """Rig outputs with the admin replies kept apart."""

    replies: dict[str, protos.AdminReply]

    def _emit(self, msg: protos.TokenizerMessage) -> None:
        if isinstance(msg, protos.AdminReply):
            self.replies[msg.rid] = msg
        else:
            super()._emit(msg)  # type: ignore[misc]

    def admin(self, op: str, args: dict[str, Any], steps: int = 400) -> protos.AdminReply:
        rid = f"admin-{len(self.replies)}-{op}"
        self.sched.admin(protos.AdminRequest(rid, op, args))  # type: ignore[attr-defined]
        for _ in range(steps):
            if rid in self.replies:
                break
            self.sched.step()  # type: ignore[attr-defined]
            pump = getattr(self, "pump", None)
            if pump is not None:
                pump()
        return self.replies[rid]


class PinRig(Admin, Rig):
    def __init__(self, cfg: HicacheConfig) -> None:
        self.replies = {}
        super().__init__(cfg)


class PinL2Rig(Admin, L2Rig):
    def __init__(self, cfg: HicacheConfig) -> None:
        self.replies = {}
        super().__init__(cfg)


class PinL3Rig(Admin, L3Rig):
    def __init__(self, cfg: HicacheConfig, l3_dir: str) -> None:
        self.replies = {}
        super().__init__(cfg, l3_dir)


PREFIX = [random.Random(1).randrange(3, 250) for _ in range(42)]  # 10 whole pages and 2 tokens


def _flood(rig: Rig, n: int, seed: int) -> None:
    rng = random.Random(seed)
    rig.run([gen(f"flood-{seed}-{i}", [rng.randrange(3, 250) for _ in range(60)], n=2) for i in range(n)])


def test_an_l1_and_l2_pin_survives_a_flood_and_serves_exact_hits() -> None:
    cfg = _cfg()
    rig = PinL2Rig(cfg)
    try:
        reply = rig.admin("pin", {"name": "system", "input_ids": PREFIX})
        assert reply.ok, reply.error
        assert reply.result["state"] == "pinned" and reply.result["tokens"] == 40
        assert reply.result["tiers"] == ["l1", "l2"]
        _flood(rig, 30, 1)  # 30 x 60 tokens: far more than L1 (256) and L2 (512)
        assert rig.cache.full.allocator.capacity * 4 < 30 * 60
        m = rig.cache.match_prefix(PREFIX)
        assert m.device_len == 40
        ids = PREFIX + [7, 8, 9, 10, 11]
        rig.run([gen("user", ids, n=5)])
        assert rig.cached("user") == 40
        assert rig.tokens("user") == cold_tokens(cfg, "user", ids, 5)
        listing = rig.admin("pins", {}).result
        assert listing["tiers"]["l1"]["pinned_tokens"] == 40 and listing["tiers"]["l2"]["pinned_tokens"] == 40
        assert rig.sched.stats()["pinned"]["l1"]["share_tokens"] == 128
        # unpinned, the same flood evicts it
        assert rig.admin("unpin", {"name": "system"}).ok
        _flood(rig, 30, 2)
        assert rig.cache.match_prefix(PREFIX).device_len == 0
        assert rig.cache.match_prefix(PREFIX).host_hit_length == 0
        assert rig.admin("pins", {}).result["pinned"] == []
    finally:
        rig.close()


def test_an_l1_pin_without_l2() -> None:
    cfg = _cfg(l2=False)
    rig = PinRig(cfg)
    reply = rig.admin("pin", {"name": "tools", "input_ids": PREFIX, "tiers": ["l1"], "cache_salt": "t1"})
    assert reply.ok, reply.error
    _flood(rig, 12, 3)
    assert rig.cache.match_prefix(PREFIX, "t1").device_len == 40
    assert rig.cache.match_prefix(PREFIX).device_len == 0  # the salt is part of the pin
    # a request larger than what the pin leaves of L1 is refused, naming the pin's share
    rig.run([gen("big", list(range(3, 230)), n=10)])
    assert rig.final("big").finish_reason == "error"
    assert "held by pinned prefixes" in (rig.final("big").error or "")
    assert rig.admin("pin", {"name": "x", "input_ids": PREFIX, "tiers": ["l2"]}).error == \
        "pinned prefix 'x' names l2, which is off"


def test_sizes_past_the_share_are_refused_by_name() -> None:
    rig = PinRig(_cfg(l2=False, pinned_fraction=0.25))  # 64 of 256 tokens
    assert rig.admin("pin", {"name": "a", "input_ids": PREFIX, "tiers": ["l1"]}).ok
    big = rig.admin("pin", {"name": "b", "input_ids": list(range(3, 35)), "tiers": ["l1"]})
    assert not big.ok and big.result["refused"]
    assert big.error == ("pinned prefix 'b' (32 tokens) does not fit L1's share for pinned prefixes: 64 of 256 "
                         "tokens (cache.pinned_fraction 0.25), 40 already pinned by a")
    # replacing 'a' by a larger prefix of the same name frees its own share first
    assert rig.admin("pin", {"name": "a", "input_ids": list(range(3, 67)), "tiers": ["l1"]}).ok
    assert rig.admin("pins", {}).result["tiers"]["l1"]["pinned_tokens"] == 64


def test_pins_are_named_per_tenant_and_a_tenant_pins_within_its_budget() -> None:
    """Two tenants' pins of one name are two pins; a tenant's own call (``args["tenant"]``)
    lists, unpins and replaces its own only, within its budget, and its refusals name none of
    another tenant's pins; the operator (no ``tenant``) is bound by the share alone."""
    from hicache.tenants import tenant_salt

    cfg = config_from_dict({
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 256}, "l2": {"enabled": False}, "l3": {"backend": "none"},
                  "pinned_fraction": 0.25},
        "scheduler": {"chunked_prefill_tokens": 64, "max_prefill_tokens": 128},
        "server": {"api_keys": [{"tenant": "a", "key": "key-a-0123456789", "quota": {"pinned_tokens": 32}},
                                {"tenant": "b", "key": "key-b-0123456789", "quota": {"pinned_tokens": 64}}]},
    })
    rig = PinRig(cfg)

    def pin(tenant: str | None, name: str, ids: list[int], owner: str | None = None) -> protos.AdminReply:
        args: dict[str, Any] = {"name": name, "input_ids": ids, "tiers": ["l1"],
                                "cache_salt": tenant_salt(owner or tenant, "")}
        if tenant is not None:
            args["tenant"] = tenant
        return rig.admin("pin", args)

    assert pin("a", "sys", list(range(3, 27))).ok  # 24 tokens of a's 32
    assert pin("b", "sys", list(range(40, 72))).ok  # another pin of the same name: b's
    assert [(p["tenant"], p["name"]) for p in rig.admin("pins", {"tenant": "b"}).result["pinned"]] == [("b", "sys")]
    over = pin("a", "more", list(range(100, 112)))
    assert not over.ok and "pin budget" in over.error and "24 pinned by its other pins" in over.error
    # the share (64 tokens) is full: b's refusal says so without naming a's pin
    full = pin("b", "x", list(range(120, 132)))
    assert not full.ok and "too little of it is left (32 by your pins)" in full.error and "sys" not in full.error
    op = pin(None, "x", list(range(120, 132)), owner="a")  # the operator: the share alone, naming every pin
    assert not op.ok and "56 already pinned by sys, sys" in op.error
    assert not pin("a", "bad", list(range(1, 9)), owner="b").ok  # a tenant pins in its own namespace only
    missing = rig.admin("unpin", {"name": "sys", "tenant": "a"})
    assert missing.ok and missing.result["unpinned"] == "sys"
    assert rig.admin("unpin", {"name": "sys", "tenant": "a"}).result.get("missing")
    assert [p["tenant"] for p in rig.admin("pins", {}).result["pinned"]] == ["b"]  # b's pin stayed
    assert rig.admin("unpin", {"name": "sys", "owner": "b"}).ok  # the operator unpins b's


@pytest.mark.parametrize("args, error", [
    ({"name": "", "input_ids": [1]}, "name must be"),
    ({"name": "a b", "input_ids": [1]}, "name must be"),
    ({"name": "a", "input_ids": []}, "input_ids must be"),
    ({"name": "a", "input_ids": [1, 2]}, "less than one page"),
    ({"name": "a", "input_ids": [1] * 8, "tiers": ["l3"]}, "tiers must be"),
    ({"name": "a", "input_ids": [1] * 8, "cache_salt": 3}, "cache_salt must be"),
    ({"name": "a", "input_ids": [999_999] * 8}, "outside the vocabulary"),
])
def test_bad_pins_are_refused_with_the_reason(args: dict[str, Any], error: str) -> None:
    rig = PinRig(_cfg(l2=False))
    reply = rig.admin("pin", args)
    assert not reply.ok and error in (reply.error or "") and reply.result["refused"]
    assert rig.admin("pins", {}).result["pinned"] == []
    assert not rig.admin("unpin", {"name": "nope"}).ok
    rig.assert_idle()


def test_a_pin_after_a_restart_is_loaded_from_l3(tmp_path: Path) -> None:
    cfg = _cfg(prefetch={"threshold_tokens": 4})
    first = PinL3Rig(cfg, str(tmp_path))
    try:
        reply = first.admin("pin", {"name": "system", "input_ids": PREFIX})
        assert reply.ok and reply.result["loaded"]["storage"] == 0
        for _ in range(50):  # let the backups reach L3
            first.sched.step()
            first.pump()
    finally:
        first.close()
    second = PinL3Rig(cfg, str(tmp_path))
    try:
        reply = second.admin("pin", {"name": "system", "input_ids": PREFIX})
        assert reply.ok, reply.error
        assert reply.result["loaded"]["storage"] == 40  # every whole page came from L3
        assert second.cache.match_prefix(PREFIX).device_len == 40
    finally:
        second.close()


def test_a_hybrid_models_pin_must_name_l1_and_then_hits_exactly() -> None:
    cfg = config_from_dict({
        "model": {"reference": {"preset": "tiny", "layers": ["full", "swa", "full", "swa"], "sliding_window": 8}},
        "cache": {"page_size": 4, "l1": {"tokens": 256}, "l2": {"enabled": False}, "l3": {"backend": "none"}},
        "scheduler": {"chunked_prefill_tokens": 64, "max_prefill_tokens": 128},
    })
    rig = PinRig(cfg)
    reply = rig.admin("pin", {"name": "w", "input_ids": PREFIX, "tiers": ["l2"]})
    assert not reply.ok and "must name l1" in (reply.error or "")
    assert rig.admin("pin", {"name": "w", "input_ids": PREFIX}).ok
    _flood(rig, 12, 4)
    ids = PREFIX + [5, 6, 7, 8]
    rig.run([gen("user", ids, n=4)])
    assert rig.cached("user") == 40
    assert rig.tokens("user") == cold_tokens(cfg, "user", ids, 4)


def test_a_pin_naming_l2_alone_counts_its_temporary_l1_lock_against_l1s_share() -> None:
    rig = PinL2Rig(_cfg(pinned_fraction=0.25))  # shares: L1 64 of 256 tokens, L2 128 of 512
    try:
        assert rig.admin("pin", {"name": "a", "input_ids": PREFIX, "tiers": ["l1"]}).ok  # 40 tokens
        b = rig.admin("pin", {"name": "b", "input_ids": list(range(3, 35)), "tiers": ["l2"]})
        assert not b.ok and b.result["refused"]
        assert b.error == ("pinned prefix 'b' (32 tokens) does not fit L1's share for pinned prefixes: 64 of 256 "
                           "tokens (cache.pinned_fraction 0.25), 40 already pinned by a")
        assert rig.admin("pin", {"name": "c", "input_ids": list(range(3, 27)), "tiers": ["l2"]}).ok  # 24 fits
        listing = rig.admin("pins", {}).result["tiers"]
        assert listing["l1"]["pinned_tokens"] == 40 and listing["l2"]["pinned_tokens"] == 24  # c's lock is gone
    finally:
        rig.close()


def test_a_pin_whose_l2_copies_cannot_be_written_fails_in_bounded_time() -> None:
    """A tenant's L2 quota (16 tokens) smaller than its pin (40): the copies can never all be
    in L2. The pin fails once ``settle_s`` has passed since it was computed, and lets its
    temporary L1 lock go; before that, an unpin ends it at once."""
    from hicache.scheduler.pins import PIN_SETTLE_S
    from hicache.tenants import tenant_salt

    cfg = config_from_dict({
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 256}, "l2": {"tokens": 512}, "l3": {"backend": "none"},
                  "load_back_threshold": 0},
        "scheduler": {"chunked_prefill_tokens": 64, "max_prefill_tokens": 128},
        "server": {"api_keys": [{"tenant": "a", "key": "key-a-0123456789",
                                 "quota": {"l2_tokens": 16, "pinned_tokens": 64}}]},
    })
    rig = PinL2Rig(cfg)
    now = [1000.0]
    rig.sched.clock = lambda: now[0]
    try:
        args = {"name": "sys", "input_ids": PREFIX, "cache_salt": tenant_salt("a", "")}

        def ask(rid: str, steps: int = 200) -> protos.AdminReply | None:
            rig.sched.admin(protos.AdminRequest(rid, "pin", args))
            for _ in range(steps):
                if rid in rig.replies:
                    break
                rig.sched.step()
                rig.pump()
            return rig.replies.get(rid)

        assert ask("first") is None  # computed, its L2 copies blocked by the quota: writing
        (pin,) = rig.admin("pins", {}).result["pinned"]
        assert pin["state"] == "writing"
        assert rig.sched.pins.l1_pages == 10  # the temporary lock
        now[0] += PIN_SETTLE_S + 1
        for _ in range(3):
            rig.sched.step()
            rig.pump()
        failed = rig.replies["first"]
        assert not failed.ok and f"not pinned within {PIN_SETTLE_S:g} s" in failed.error
        assert "L2 quota" in failed.error
        assert rig.admin("pins", {}).result["pinned"] == [] and rig.sched.pins.l1_pages == 0
        # again, and this time unpinned while it waits for its copies: it ends at once
        assert ask("second") is None
        unpinned = rig.admin("unpin", {"name": "sys", "owner": "a"})
        assert unpinned.ok, unpinned.error
        assert not rig.replies["second"].ok and "unpinned before it was pinned" in rig.replies["second"].error
        assert rig.sched.pins.l1_pages == 0
        rig.run([])
    finally:
        rig.close()
