"""Engine mode (docs/engine-mode.md): the scheduler process as the cache server of engines
that keep L1 themselves (``server``: the logic; ``process``: its sockets and loop)."""
