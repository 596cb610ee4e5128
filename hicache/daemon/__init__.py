"""The daemon as a whole, above every process: the start checks ``hicache serve`` and
``hicache check-config`` share (``startup_checks``) and the launcher that creates the pools,
spawns, supervises and stops the processes (``launcher``)."""
