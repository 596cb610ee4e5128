"""The per-component request hooks (``hicache.scheduler.component_hooks``) and the one
entry that calls them (``AuxMemory``): a tree component without hooks is refused by name,
and a hybrid request calls every hook of every component at the points the contract
table of ``component_hooks.base`` names, in that order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hicache.memory.allocator import PageAllocator
from hicache.scheduler.aux_memory import HOOK_CLASSES, AuxMemory
from hicache.scheduler.component_hooks.base import ComponentHooks
from hicache.tree.cache import UnifiedRadixCache
from hicache.tree.components import FullComponent, PagedAuxComponent
from tests.scheduler.test_hybrid_engine import PATTERNS, _cfg
from tests.support.rigs import Rig, cold_tokens, gen

HOOKS = ("refusal", "amount", "admit", "ensure_pages", "fill_item", "insert_points", "insert_part", "inserted",
         "settle", "hand_over")


class _Untaught(PagedAuxComponent):
    ctype = None
    name = "untaught"


def test_a_component_without_hooks_is_refused_by_name() -> None:
    cache = UnifiedRadixCache([FullComponent(PageAllocator(8)), _Untaught(PageAllocator(8))], 4)
    rig = Rig(_cfg(PATTERNS["swa"], 4))
    rig.sched.aux.s.cache = cache  # the scheduler's state, now over a tree it has no hooks for
    with pytest.raises(ValueError, match="untaught"):
        AuxMemory(rig.sched.aux.s)


def test_every_hook_runs_at_its_point_for_each_component(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(PATTERNS["swa+mamba"], 4)
    rig = Rig(cfg)
    calls: list[tuple[str, str]] = []
    for hooks in rig.sched.aux.hooks:
        for name in HOOKS:
            original: Callable[..., Any] = getattr(hooks, name)

            def record(*args: Any, _name: str = name, _orig: Callable[..., Any] = original,
                       _comp: str = hooks.name) -> Any:
                calls.append((_comp, _name))
                return _orig(*args)

            monkeypatch.setattr(hooks, name, record)
    assert [type(h) for h in rig.sched.aux.hooks] == list(HOOK_CLASSES)
    prompt = list(range(1, 30))
    rig.run([gen("a", prompt)])
    assert rig.tokens("a") == cold_tokens(cfg, "a", prompt)
    rig.assert_idle()

    def first(comp: str, hook: str) -> int:
        return calls.index((comp, hook))

    for comp in ("mamba", "swa"):
        seen = {h for c, h in calls if c == comp}
        # Mamba places the inserts (at its snapshots, its slot the payload): SWA adds its part
        expected = set(HOOKS) - ({"insert_part"} if comp == "mamba" else {"insert_points"})
        assert seen == expected, comp
        order = [first(comp, h) for h in HOOKS if h in expected]
        assert order == sorted(order), comp
    # every SWA part went into an insert Mamba placed, and the tree took both
    assert calls.count(("swa", "insert_part")) == calls.count(("swa", "inserted")) >= 1
    assert calls.count(("mamba", "inserted")) == calls.count(("swa", "inserted"))
    assert all(isinstance(h, ComponentHooks) for h in rig.sched.aux.hooks)
