"""The forward pass: one model call over every running request, then its tokens.

``ForwardPass.run`` gives each running request one prefill chunk of at most
``chunked_prefill_tokens`` (all chunks together at most ``max_prefill_tokens``) or one
decode token, with the pages it needs taken from its reservation; runs the model once; then
for each request caches each finished prefill chunk (``cache_unfinished_req``; for
full-attention models the last one too, so that a prompt admitted in one chunk is matched
by concurrent requests while it decodes), settles its auxiliary memory, samples its next
token and finishes it when a stop condition is met.

An exception in the batched model call fails every request of that batch (each through
``Finisher.fail_request``); one in a single request's preparation, caching or sampling
fails that request alone.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable

import torch

from hicache.model.runner import ForwardItem, LogitsMode, ModelRunner
from hicache.model.sampling import PenaltyState, sample_next, token_logprobs
from hicache.model.sampling_params import finish_reason
from hicache.scheduler.aux_memory import AuxMemory
from hicache.scheduler.finishing import Finisher, unsent
from hicache.scheduler.request import Request
from hicache.scheduler.state import SchedulerState
from hicache.tree.node import KEY_TYPECODE, ComponentType

FULL = ComponentType.FULL

log = logging.getLogger("hicache.scheduler")


class ForwardPass:
    """The forward phase (see the module docstring)."""

    def __init__(self, state: SchedulerState, runner: ModelRunner, aux: AuxMemory, finisher: Finisher,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.s = state
        self.runner = runner
        self.aux = aux
        self.finisher = finisher
        self.eos_token_ids = eos_token_ids
        self.before_model: Callable[[], None] | None = None
        """Called right before each model call (the loop publishes the KV events of the
        tier changes so far, so that none waits for the pass)."""

    def run(self) -> None:
        """One forward pass over the running requests (nothing when none has work)."""
        s, finisher = self.s, self.finisher
        chunk_cap = s.cfg.scheduler.chunked_prefill_tokens
        budget = s.cfg.scheduler.max_prefill_tokens
        batch: list[tuple[Request, ForwardItem]] = []
        for req in list(s.running):
            with finisher.request_scope(req, "preparing its forward pass"):
                assert req.tree is not None
                if req.prefilling:
                    n = min(req.prompt_len - req.computed, chunk_cap, max(budget, 0))
                    if n <= 0:
                        continue
                    budget -= n
                    tokens = req.input_ids[req.computed : req.computed + n]
                    logits: LogitsMode = "last" if req.computed + n == req.prompt_len else "none"
                else:
                    tokens = array(KEY_TYPECODE, [req.output_ids[-1]])
                    logits = "last"
                if not self.ensure_pages(req, req.computed + len(tokens)):
                    if s.tier is not None and (s.tier.in_flight or s.cache.tiers.nodes_to_write_to_host(limit=1)):
                        # Pages held by in-flight transfers, or queued for an L2 write before
                        # eviction (write_back), free up once the controller is done: sit this
                        # pass out rather than fail (the admission reservation covers us then).
                        continue
                    finisher.finish(req, "error", "L1 is out of pages for this request")
                    continue
                item = ForwardItem(tokens, req.computed, req.tree.kv_pages, logits=logits)
                batch.append((req, self.aux.fill_item(req, item)))
        if not batch:
            return
        if self.before_model is not None:
            self.before_model()
        try:
            outputs = list(self.runner.forward([item for _r, item in batch]))
            if len(outputs) != len(batch):
                raise RuntimeError(f"the model runner returned {len(outputs)} outputs for {len(batch)} requests")
        except Exception as exc:
            log.exception("the forward pass over %d requests failed", len(batch))
            for req, item in batch:
                self.aux.forward_failed(req, item)
                finisher.fail_request(req, exc, "running the forward pass", logged=True)
            return
        s.counters.forward_passes += 1
        for (req, item), out in zip(batch, outputs, strict=True):
            with finisher.request_scope(req, "caching what its forward pass computed"):
                self.advance(req, item)
            if out is not None and not req.finished:
                with finisher.request_scope(req, "sampling its next token"):
                    self.append_token(req, out)

    def ensure_pages(self, req: Request, upto: int) -> bool:
        """L1 pages (Full, and the auxiliary components') for ``req``'s first ``upto`` tokens, from its reservation."""
        assert req.tree is not None
        need = -(-upto // self.s.page_size) - len(req.tree.kv_pages)
        if need > 0:
            pages = self.s.budget.take(req.rid, FULL, need)
            if pages is None:
                return False
            req.tree.kv_pages.extend(pages)
        return self.aux.ensure_pages(req, upto)

    def advance(self, req: Request, item: ForwardItem) -> None:
        """After a forward pass: ``req`` has computed ``item``; hand the tree what is new.

        - the auxiliary components' prompt-boundary inserts (``AuxMemory.advance``);
        - every prefill chunk's Full pages (``cache_unfinished_req``). The last chunk (the
          one with logits) too for full-attention models, so that a concurrent request
          with the same prompt matches it while this one decodes. Not for hybrid models:
          there a match ends at the prompt's last page boundary before its last token,
          which the prompt-boundary insert already covers (with Mamba's state, with the
          window of SWA pages before it, or both);
        - the auxiliary components settle (``AuxMemory.settle``; SWA frees what fell out
          of the window).
        """
        st = req.tree
        assert st is not None
        prefill = item.start < req.prompt_len
        req.computed = item.end
        self.aux.advance(req, item, prefill)
        if prefill and (req.prefilling or not self.s.hybrid):
            self.s.cache.cache_unfinished_req(st, committed_len=req.computed)
        self.aux.settle(req)

    def append_token(self, req: Request, logits: torch.Tensor) -> None:
        """Sample ``req``'s next token from ``logits``, send it, finish ``req`` if it stops."""
        params = req.params
        if params.penalized and req.penalties is None:
            req.penalties = PenaltyState(req.input_ids, logits.numel())
        token = sample_next(logits, params, req.seed, len(req.output_ids), req.penalties)
        req.output_ids.append(token)
        if req.penalties is not None:
            req.penalties.add(token)
        if params.logprobs is not None:
            chosen, ids, values = token_logprobs(logits, token, params.logprobs)
            req.logprobs.append(chosen)
            req.top_ids.append(ids)
            req.top_logprobs.append(values)
        if req.first_token_at is None:
            req.first_token_at = self.s.clock()
        self.s.counters.generation_tokens += 1
        reason = finish_reason(req.output_ids, params, self.eos_token_ids)
        if reason is not None:
            self.finisher.finish(req, reason)
        elif req.stream or req.sent_tokens == 0:  # non-streaming: the first token at once (TTFT)
            self.s.emit(unsent(req))
