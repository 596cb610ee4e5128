"""Ending a request: what it holds goes back, its client gets its final output.

``Finisher.finish`` is the one way out of every request state (``hicache.scheduler.request``):
finished, aborted, or failed. Fault isolation: an exception while serving one request
(admitting it, preparing its part of a forward pass, sampling or appending its token) fails
that request alone, through ``request_scope`` and ``fail_request``: its client gets a final
``TokenOutput`` with finish_reason ``error`` and the exception as the message, whatever it
held goes back to the tree or the allocators as for an abort, and the scheduler goes on with
the others.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import protos
from hicache.scheduler.aux_memory import AuxMemory
from hicache.scheduler.request import Request
from hicache.scheduler.state import SchedulerState

log = logging.getLogger("hicache.scheduler")


def internal_error(during: str, exc: BaseException) -> str:
    """The message a client gets for a request that failed on an exception."""
    return f"internal error while {during}: {type(exc).__name__}: {exc}"


class Finisher:
    """Finishes requests and isolates their faults (see the module docstring)."""

    def __init__(self, state: SchedulerState, aux: AuxMemory) -> None:
        self.s = state
        self.aux = aux

    def release_hold(self, req: Request) -> None:
        """Unlock the prefix a load-back brought for ``req`` (held until admission)."""
        if req.hold is not None:
            self.s.cache.dec_lock_ref(req.hold)
            req.hold = None

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Give back everything ``req`` holds and send its final output."""
        s = self.s
        s.forget(req)
        if req.prefetch is not None and not req.prefetch.complete and s.tier is not None:
            s.tier.cancel_prefetch(req.prefetch)
        self.release_hold(req)
        s.budget.release(req.rid)
        if req.tree is not None:
            req.tree.token_ids = req.all_tokens()
            self.aux.hand_over(req)
            s.cache.cache_finished_req(req.tree, committed_len=req.computed)
            req.tree = None
        if reason == "error":
            s.counters.requests_error += 1
        elif reason != "abort":
            s.counters.requests_ok += 1
        usage = protos.Usage(req.prompt_len, len(req.output_ids), req.cached_device, req.cached_host,
                             req.cached_storage, *timings_ms(req))
        req.finished = True
        s.emit(unsent(req, True, reason, usage, error))

    @contextmanager
    def request_scope(self, req: Request, during: str) -> Iterator[None]:
        """Run a piece of ``req``'s own work: an exception in it fails ``req`` alone
        (``fail_request``) and goes no further; the caller carries on with the others."""
        try:
            yield
        except Exception as exc:
            self.fail_request(req, exc, during)

    def fail_request(self, req: Request, exc: BaseException, during: str, *, logged: bool = False) -> None:
        """The one place an exception while serving ``req`` becomes a failed request.

        ``req`` is finished with reason ``error`` and the message ``internal error while
        <during>: <exception>``, which its client receives; everything it holds goes back to
        the tree or the allocators (``finish``, as for an abort), so nothing leaks. A
        request whose final output already went out is left as it is. Should giving back
        fail as well (now, or in the ``finish`` the exception came from), the request is
        still forgotten and answered, so that it cannot fail every step again; what it held
        is then lost, and that is logged.
        """
        if not logged:
            log.error("request %s failed while %s", req.rid, during, exc_info=exc)
        if req.finished:
            return
        error = internal_error(during, exc)
        if self.s.by_rid.get(req.rid) is req:  # else a ``finish`` of it was under way and failed
            try:
                self.finish(req, "error", error)
                return
            except Exception:
                log.exception("request %s: giving back what it held failed", req.rid)
        log.error("request %s is dropped; what it held may be lost", req.rid)
        self.s.budget.release(req.rid)  # its reservation is only a number: that is never lost
        self.s.forget(req)
        req.tree = None
        req.finished = True
        self.s.emit(protos.TokenOutput(req.rid, [], True, "error", protos.Usage(req.prompt_len), error))


def timings_ms(req: Request) -> tuple[float, float, float]:
    """(queue, load, prefill) in ms for ``Usage``; 0 for a phase that did not happen."""
    def ms(a: float | None, b: float | None) -> float:
        return (b - a) * 1000.0 if a is not None and b is not None else 0.0

    return (ms(req.arrival, req.admitted_at), ms(req.load_sent_at, req.load_done_at),
            ms(req.admitted_at, req.first_token_at))


def unsent(req: Request, finished: bool = False, reason: str | None = None,
           usage: protos.Usage | None = None, error: str | None = None) -> protos.TokenOutput:
    """The output of the tokens not sent yet (with their logprobs when asked); marks them sent."""
    start = req.sent_tokens
    req.sent_tokens = len(req.output_ids)
    out = protos.TokenOutput(req.rid, req.output_ids[start:], finished, reason, usage, error)
    if req.params.logprobs is not None:
        out.logprobs = req.logprobs[start:]
        out.top_ids = req.top_ids[start:]
        out.top_logprobs = req.top_logprobs[start:]
    return out
