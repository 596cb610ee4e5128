"""One generation request as the scheduler tracks it.

States and who moves a request between them:

==========  ===========================================  ===================================
state       meaning                                      leaves it when
==========  ===========================================  ===================================
waiting     queued; re-matched on every scheduling pass  admitted, or an L2/L3 tier op starts
prefetch    L3 pages are being fetched into L2           the ticket is ready (per policy)
loading     its L2-only prefix is being loaded into L1    the load is acknowledged
running     admitted: holds a tree lock and L1 pages     finished, aborted or failed
==========  ===========================================  ===================================

A request leaves every state by ``Finisher.finish`` (``hicache.scheduler.finishing``; also
when serving it raised: see
``Finisher.fail_request``), which gives back what it holds and emits its final output
(``finished``).

A running request's ``state`` (``RequestState``) is what the tree sees: its token ids
(prompt + output), its L1 pages (and SWA pages, Mamba state slot), the tree-owned prefix
length and its lock. ``computed`` is how many of those tokens have KV in the pages; the
last sampled token never has KV yet.

L1 reservations (the pages and slots a running request may still allocate) are kept by the
scheduler's ``L1Budget`` (``hicache.scheduler.budget``), keyed by the request id, not here.

What each auxiliary component (SWA, Mamba) keeps for a running request is under its name
in ``aux``, read only by that component's hooks (``hicache.scheduler.component_hooks``).
"""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field

from hicache.model.sampling import PenaltyState
from hicache.model.sampling_params import SamplingParams
from hicache.scheduler.controller_driver import LoadTicket, PrefetchTicket
from hicache.tree.node import LockToken
from hicache.tree.request_state import RequestState


class RequestStatus(enum.Enum):
    """A request's state (the table above); the value is its name in metrics."""

    WAITING = "waiting"
    PREFETCH = "prefetch"
    LOADING = "loading"
    RUNNING = "running"


WAITING, PREFETCH, LOADING, RUNNING = (RequestStatus.WAITING, RequestStatus.PREFETCH, RequestStatus.LOADING,
                                       RequestStatus.RUNNING)


@dataclass
class Request:
    rid: str
    input_ids: array[int]
    params: SamplingParams
    seed: int
    stream: bool
    cache_salt: str
    arrival: float = field(default_factory=time.monotonic)
    status: RequestStatus = WAITING
    output_ids: list[int] = field(default_factory=list)
    tree: RequestState | None = None
    computed: int = 0
    aux: dict[str, object] = field(default_factory=dict)
    """While admitted: each auxiliary component's memory of it, by component name (only
    that component's hooks read it; ``hicache.scheduler.component_hooks``)."""
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    prefetch: PrefetchTicket | None = None
    load: LoadTicket | None = None
    """Its load-back (``ControllerDriver.start_load_back``); the tier manager sets ``ok``."""
    hold: LockToken | None = None
    """The loaded prefix, locked from the load's ack (``Admission.load_finished``) to admission."""
    first_token_at: float | None = None
    admitted_at: float | None = None
    load_sent_at: float | None = None
    load_done_at: float | None = None
    sent_tokens: int = 0
    penalties: PenaltyState | None = None
    """Built on the first sampled token when ``params.penalized``."""
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    """Parallel to ``output_ids`` when ``params.logprobs`` is set (``sample.token_logprobs``)."""
    finished: bool = False
    """Its final output has been emitted (by ``Finisher.finish`` or ``fail_request``)."""

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage

    def all_tokens(self) -> array[int]:
        """Prompt + output so far (what the tree keys this request by)."""
        out = array(self.input_ids.typecode, self.input_ids)
        out.extend(self.output_ids)
        return out
