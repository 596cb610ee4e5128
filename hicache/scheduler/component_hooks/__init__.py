"""Each auxiliary tree component's part of a running request's memory, one module each.

``base.ComponentHooks`` is the contract; ``swa`` and ``mamba`` implement it. The phases
never call them directly: ``hicache.scheduler.aux_memory.AuxMemory`` holds one hooks
object per auxiliary component of the tree and calls them in turn. A new component adds a
module here and its class to ``aux_memory.HOOK_CLASSES``.
"""
