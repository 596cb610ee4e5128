"""Randomised operation sequences on hybrid caches with L2 on: FULL with SWA, with Mamba,
with both, and with both plus ``TagComponent``, a fourth kind defined in the test machine only
(tests/support/hybrid_machine.py; the tree must work through the component hooks alone).

No reference model here (the differential test covers FULL); these check that every
sequence of match / insert / lock / unlock / evict (per component) / write / L2 evict /
load back keeps ``check_integrity()`` true, that locked data is never evicted, that
evicting everything evictable leaves nothing evictable (evictable means ``evict`` can free
it), and that every allocator returns to empty once the cache is unlocked and flushed.
"""

from __future__ import annotations

from hypothesis import settings

from tests.support.hybrid_machine import HybridMachine


class MambaMachine(HybridMachine):
    kinds = ("mamba",)


class SWAMachinePage2(HybridMachine):
    page_size = 2


class SWAMambaMachine(HybridMachine):
    kinds = ("swa", "mamba")


class SWAMambaMachinePage2(HybridMachine):
    kinds = ("swa", "mamba")
    page_size = 2


class FourComponentMachine(HybridMachine):
    kinds = ("swa", "mamba", "tag")


class SWAMambaWriteBackMachine(HybridMachine):
    kinds = ("swa", "mamba")
    write_policy = "write_back"


class SWAMambaWriteBackMachinePage2(SWAMambaWriteBackMachine):
    page_size = 2


# fewer examples than the differential test: these only guard the hybrid code paths
_few = settings(max_examples=max(10, settings.default.max_examples // 3))
for _m in (HybridMachine, MambaMachine, SWAMachinePage2, SWAMambaWriteBackMachine, SWAMambaWriteBackMachinePage2):
    _m.TestCase.settings = _few
# the three- and four-component machines run the full example count: the naive match model
# needs L2-only tails with part of their auxiliary data missing, which take longer to reach
for _m in (SWAMambaMachine, SWAMambaMachinePage2, FourComponentMachine):
    _m.TestCase.settings = settings(max_examples=max(100, settings.default.max_examples), deadline=None)

TestHybridSWA = HybridMachine.TestCase
TestHybridMamba = MambaMachine.TestCase
TestHybridSWAPage2 = SWAMachinePage2.TestCase
TestHybridSWAMamba = SWAMambaMachine.TestCase
TestHybridSWAMambaPage2 = SWAMambaMachinePage2.TestCase
TestFourComponents = FourComponentMachine.TestCase
TestHybridSWAMambaWriteBack = SWAMambaWriteBackMachine.TestCase
TestHybridSWAMambaWriteBackPage2 = SWAMambaWriteBackMachinePage2.TestCase
