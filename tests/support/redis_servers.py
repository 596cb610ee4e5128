"""Where ``redis-server`` is, and the skip reason of a test that needs one where it is not.

The servers themselves are ``hicache.bench.local_redis.started`` (a free loopback port, its
own directory, persistence off, killed at exit); each folder's ``redis_server`` fixture
starts one with the scope that folder needs.
"""

from __future__ import annotations

from hicache.bench.local_redis import find_redis_server

REDIS_SERVER = find_redis_server()
NO_REDIS = "redis-server not installed (apt-get install redis-server)"
