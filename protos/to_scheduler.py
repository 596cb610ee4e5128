"""Messages the scheduler process receives: from the tokenizer and from the cache controller."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from protos.base import Message, message

__all__ = [
    "AbortRequest", "AdminRequest", "ControllerStarted", "GenerateRequest", "OpDone", "PrefetchHits", "SamplingParams",
    "SchedulerMessage", "StorageEvicted", "StorageStatus",
]

OpStatus = Literal["ok", "failed", "cancelled", "error", "rejected"]
"""How a controller op ended (``OpDone.status``); the codec refuses any other value."""


class SchedulerMessage(Message):
    """Base of everything the scheduler can be told."""

    __slots__ = ()


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature`` 0 means greedy; ``seed`` makes sampling repeatable.
    Penalties 0 (``repetition_penalty`` 1) and ``min_p`` 0 are off; ``logprobs`` None = no
    logprobs, k = the chosen token's and the k most likely ones (``TokenOutput.logprobs``).
    Ranges: ``hicache.model.sampling_params``."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None


# ---- from the tokenizer


@message("generate")
@dataclass(slots=True)
class GenerateRequest(SchedulerMessage):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    cache_salt: str = ""


@message("abort")
@dataclass(slots=True)
class AbortRequest(SchedulerMessage):
    rid: str


@message("admin")
@dataclass(slots=True)
class AdminRequest(SchedulerMessage):
    """``op``: flush | stats | storage_status | storage_attach | storage_detach | storage_clear."""

    rid: str
    op: str
    args: dict[str, Any] = field(default_factory=dict)


# ---- from the launcher


@message("controller_started")
@dataclass(slots=True)
class ControllerStarted(SchedulerMessage):
    """A restarted cache controller is serving: process ``pid``, controller ``run``, the
    number every op for it must carry (``protos.to_controller``). The launcher sends it
    after the ``ProcessEvent`` ``died`` of the one it replaces, on the same socket, so the
    scheduler always learns of the death first. (The first controller's run comes with
    the scheduler's start arguments.)"""

    pid: int
    run: int


# ---- from the cache controller


@message("op_done")
@dataclass(slots=True)
class OpDone(SchedulerMessage):
    """The end of one controller op. ``status`` (``OpStatus``): ``ok``; ``failed`` (L3
    trouble: the pages that did not move are misses); ``cancelled`` (a ``Cancel`` reached
    it before it started); ``error`` (it raised); ``rejected`` (refused before touching
    memory: bad indices, an unknown component, a duplicate op id).

    ``pages_done`` counts the pages that were completely moved (a prefix of the op's pages).
    ``aux_done[name][i]`` (a ``PrefetchFetch`` only): whether auxiliary object ``i`` of
    component ``name`` arrived verified.
    """

    op_id: int
    status: OpStatus
    pages_done: int = 0
    error: str | None = None
    aux_done: dict[str, list[bool]] = field(default_factory=dict)


@message("prefetch_hits")
@dataclass(slots=True)
class PrefetchHits(SchedulerMessage):
    """Answer to ``PrefetchQuery``: L3 holds the first ``n`` pages of the queried chain.

    ``aux_present[name]``: the indices ``i < n`` whose ``aux_keys[name][i]`` L3 holds."""

    op_id: int
    n: int
    aux_present: dict[str, list[int]] = field(default_factory=dict)


@message("storage_status")
@dataclass(slots=True)
class StorageStatus(SchedulerMessage):
    """The L3 store's state: after a ``StorageAdmin`` op (``op_id``) or unprompted (``op_id`` -1)."""

    op_id: int
    backend: str
    up: bool
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@message("storage_evicted")
@dataclass(slots=True)
class StorageEvicted(SchedulerMessage):
    """Pages the L3 store removed on its own (its capacity eviction), unprompted, oldest
    first; nothing answers it. The scheduler announces them as KV events (``BlockRemoved``,
    medium ``STORAGE``); the tree is not changed (a prefetch finds what is missing)."""

    hashes: list[str]
