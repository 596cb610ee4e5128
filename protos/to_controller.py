"""Messages the cache-controller process receives from the scheduler.

Page lists are keyed by component name (``full``, ``swa``, ``mamba``); the ``i``-th source
page of a component is copied to its ``i``-th destination page. The controller copies what it
is told and acknowledges every op with exactly one ``OpDone`` (``PrefetchQuery`` with one
``PrefetchHits``); it never decides anything about the tree.

Every op names the controller ``run`` it is meant for (``ControllerArgs.run``, a fresh
number per controller start, which the scheduler learns from its ``SchedulerArgs`` and
then from ``ControllerStarted``). A controller refuses an op of another run before it
touches memory (``OpDone`` ``rejected``): an op queued for a controller that died, whose
pages the scheduler freed when it learned of the death, can never run in the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protos.base import Message, message

__all__ = [
    "BackupToStorage", "Cancel", "ControllerMessage", "LoadToDevice", "PrefetchFetch", "PrefetchQuery",
    "StorageAdmin", "WriteToHost",
]


class ControllerMessage(Message):
    """Base of everything the controller can be told."""

    __slots__ = ()


@message("write_to_host")
@dataclass(slots=True)
class WriteToHost(ControllerMessage):
    """Copy L1 pages to L2 pages (device -> host)."""

    op_id: int
    device_pages: dict[str, list[int]]
    host_pages: dict[str, list[int]]
    run: int = 0


@message("load_to_device")
@dataclass(slots=True)
class LoadToDevice(ControllerMessage):
    """Copy L2 pages to L1 pages (host -> device)."""

    op_id: int
    host_pages: dict[str, list[int]]
    device_pages: dict[str, list[int]]
    run: int = 0


@message("backup")
@dataclass(slots=True)
class BackupToStorage(ControllerMessage):
    """Write L2 pages to L3 under their page hashes; pages L3 already holds are skipped.

    ``aux_pages[name]`` / ``aux_keys[name]``: an auxiliary component's L2 units (SWA pages,
    Mamba state slots) and the L3 key of each (``hicache.hashing.component_key``), equal
    lengths; written after the ``component`` pages, each object on its own. ``tenant``: the
    tenant whose L3 partition the pages go to (``server.api_keys[].quota.l3_gb``); "" for the
    shared store."""

    op_id: int
    host_pages: list[int]
    hashes: list[str]
    component: str = "full"
    aux_pages: dict[str, list[int]] = field(default_factory=dict)
    aux_keys: dict[str, list[str]] = field(default_factory=dict)
    tenant: str = ""
    run: int = 0


@message("prefetch_query")
@dataclass(slots=True)
class PrefetchQuery(ControllerMessage):
    """How many consecutive pages of this hash chain does L3 hold? Answered by ``PrefetchHits``.

    ``aux_keys[name][i]``: the key of an auxiliary component's object for page ``i`` of
    the chain; ``PrefetchHits.aux_present`` says which of them L3 holds. ``tenant``: the L3
    partition to ask, as for ``BackupToStorage``."""

    op_id: int
    hashes: list[str]
    component: str = "full"
    aux_keys: dict[str, list[str]] = field(default_factory=dict)
    tenant: str = ""
    run: int = 0


@message("prefetch_fetch")
@dataclass(slots=True)
class PrefetchFetch(ControllerMessage):
    """Read these L3 pages into these L2 pages; ``OpDone.pages_done`` says how many arrived.

    ``aux_keys[name]`` / ``aux_pages[name]``: auxiliary objects to read into these L2 units
    (equal lengths), each on its own; ``OpDone.aux_done[name][i]`` says whether object
    ``i`` arrived verified (the units of the others hold nothing usable). ``tenant``: the L3
    partition to read, as for ``BackupToStorage``."""

    op_id: int
    hashes: list[str]
    host_pages: list[int]
    component: str = "full"
    aux_keys: dict[str, list[str]] = field(default_factory=dict)
    aux_pages: dict[str, list[int]] = field(default_factory=dict)
    tenant: str = ""
    run: int = 0


@message("cancel")
@dataclass(slots=True)
class Cancel(ControllerMessage):
    """Cancel op ``op_id`` if it has not finished; it is then acknowledged as ``cancelled``."""

    op_id: int


@message("storage_admin")
@dataclass(slots=True)
class StorageAdmin(ControllerMessage):
    """``op``: status | attach | detach | clear. Answered by ``StorageStatus``. ``attach``
    takes ``args = {"l3": <a cache.l3 section, as in the YAML>}``, the shape the admin API's
    ``AdminRequest`` carries (the scheduler forwards it unchanged)."""

    op_id: int
    op: str
    args: dict[str, Any] = field(default_factory=dict)
