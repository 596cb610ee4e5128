"""The ``hicache`` command line: ``main`` dispatches to one module per command (``serve``,
``check_config``, ``replay``, ``advise``, ``storage``, ``events``, ``keygen``, ``version``) and to
``hicache.bench``'s benchmarks. Each command module exposes ``add_arguments(parser)`` and
``run(args) -> exit code`` and keeps its module-level imports light (no torch, no zmq)."""
