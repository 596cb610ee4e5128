"""What every daemon process runs on: the launcher that starts and supervises them
(``launcher``), ZeroMQ sockets and endpoints (``ipc``), heartbeats, process hygiene (``proc``),
logging, the start-up checks ``hicache serve`` and ``hicache check-config`` share, and the
garbage-collector guard of the serving loops (``gc_guard``)."""
