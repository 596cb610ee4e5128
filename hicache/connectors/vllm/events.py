"""The daemon's KV events for this engine's pages, handed to vLLM's KV event publisher.

With vLLM's KV events on (``--kv-events-config``) and the daemon's (``events.enabled``), the
scheduler side holds one ``EventRelay``: it follows the daemon's stream for the engine's
namespace (``hicache.kv_events.follower``), starts its numbering again when the daemon run
changes, and hands each step's events to vLLM as vLLM's classes. The events are a view for
routers: nothing here fails a step or refuses an engine. docs/architecture.md §14.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed import kv_events as vllm_events
from vllm.distributed.kv_events import KVCacheEvent

from hicache.kv_events.follower import EventFollower, connect_address
from hicache.kv_events.format import BlockRemoved, BlockStored, KVEvent

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    import protos

log = logging.getLogger("hicache.connector")


def _vllm_event(event: KVEvent) -> KVCacheEvent:
    """One of hicache's KV events as vLLM's class of it."""
    if isinstance(event, BlockStored):
        return vllm_events.BlockStored(block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
                                       token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None,
                                       medium=event.medium, lora_name=None, extra_keys=event.extra_keys)
    if isinstance(event, BlockRemoved):
        return vllm_events.BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium)
    return vllm_events.AllBlocksCleared()


class EventRelay:
    """A follower of the daemon's event stream for one engine namespace."""

    def __init__(self, follower: EventFollower) -> None:
        self.follower = follower
        self._run = 0  # the daemon run the follower's numbering belongs to

    @classmethod
    def follow(cls, vllm_config: VllmConfig, config: Any, namespace: str) -> EventRelay | None:
        """With vLLM's KV events on and the daemon's ``events`` on: a relay of the daemon's
        stream, else None (also when the stream cannot be followed: vLLM publishes its own only)."""
        wanted = vllm_config.kv_events_config
        ev = config.events
        if wanted is None or not wanted.enable_kv_cache_events or not ev.enabled:
            return None
        host = config.ipc.tcp_host
        try:
            follower = EventFollower(connect_address(ev.endpoint, host),
                                     connect_address(ev.replay_endpoint, host) if ev.replay_endpoint else None,
                                     namespace)
        except Exception as exc:  # the events are a view for routers, never a reason not to serve
            log.error("hicache: cannot follow the daemon's KV events at %s (%s); vLLM publishes its own only",
                      ev.endpoint, exc)
            return None
        log.info("hicache: handing the daemon's KV events (%s) to vLLM's publisher", ev.endpoint)
        return cls(follower)

    def take(self, reg: protos.EngineRegistered | None) -> Iterable[KVCacheEvent]:
        """The events since the last call, as vLLM's; ``reg``: the open registration (a new
        daemon run restarts the follower's numbering). Never raises."""
        try:
            if reg is not None and reg.run != self._run:
                if self._run:
                    self.follower.restart()
                self._run = reg.run
            return [_vllm_event(e) for e in self.follower.take()]
        except Exception:  # the events are a view for routers: never a reason to fail a step
            log.exception("hicache: cannot hand on the daemon's KV events")
            return ()

    def change_namespace(self, namespace: str) -> None:
        self.follower.change_namespace(namespace)

    def close(self) -> None:
        self.follower.close()
