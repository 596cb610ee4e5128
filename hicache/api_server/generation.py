"""One generation request's round trip through the scheduler, as a stream of ``Step``s.

``generate_steps`` sends the request, turns each ``TokenOutput`` into text (``OutputText``:
incremental detokenization, stop strings) and yields ``Step``s; the last one has the
``finish_reason`` and the final ``Usage``. It records the request's latencies and token
counts through the ``RequestTracker`` it is given.

Ending a request (the table every path follows):

==================================  ============================  ===========================
how it ends                         finish_reason                 sent to the scheduler
==================================  ============================  ===========================
scheduler: finished=True            the scheduler's (stop,        nothing
                                    length, abort)
a stop string appears in the text   stop                          AbortRequest(rid)
scheduler: finish_reason "error"    raises GenerationError        nothing
consumer stops early (client gone,  —                             AbortRequest(rid)
cancelled, exception)
==================================  ============================  ===========================

Run it under ``contextlib.aclosing`` so an early stop reliably sends the abort.

Stop strings are checked after every token, streaming or not (a request with stop strings
asks the scheduler for one ``TokenOutput`` per step, see ``PreparedRequest.to_message``), so
the abort reaches the scheduler as soon as the text shows one. The ids after the token that
completed the stop string (the scheduler may have sent a few more meanwhile) are dropped:
the output ids are exactly the ones that spell the returned text, the stop string and the
rest of that last token. Logprob entries (when asked) travel with their ids and are cut the
same way.

Usage of the last step: ``prompt_tokens`` and the ``cached_*`` split from the scheduler's
latest ``Usage`` (``prompt_tokens`` falls back to the prompt's length when the scheduler did
not send one), ``completion_tokens`` = the number of token ids returned to the client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator

import protos
from hicache.api_server.formats import Step, TokenLogprob, token_logprobs
from hicache.api_server.request_log import RequestLog
from hicache.api_server.scheduler_link import SchedulerLink
from hicache.api_server.textstream import OutputText
from hicache.api_server.validation import PreparedRequest
from hicache.metrics import RequestTracker, TokenCounts
from hicache.text import Tokenizer


class GenerationError(RuntimeError):
    """The scheduler failed the request (``finish_reason="error"`` or an ``ErrorReply``)."""


def final_usage(req: PreparedRequest, latest: protos.Usage | None, completion_tokens: int) -> protos.Usage:
    """The scheduler's latest usage, with the prompt length filled in if missing and the
    completion count as this process received it."""
    u = latest or protos.Usage()
    return dataclasses.replace(u, prompt_tokens=u.prompt_tokens or len(req.input_ids),
                               completion_tokens=completion_tokens)


async def generate_steps(link: SchedulerLink, tokenizer: Tokenizer, req: PreparedRequest,
                         tracker: RequestTracker, log: RequestLog | None = None) -> AsyncGenerator[Step, None]:
    """Yield the steps of ``req``. Streaming: one per ``TokenOutput`` that adds text or ids,
    the last with ``finish_reason`` and ``usage``. Otherwise: one step, the whole output.
    A request that ends with a final output is appended to ``log`` (``server.request_log``)."""
    channel = link.generate(req.to_message())
    text = OutputText(tokenizer, req.stop, incremental=req.stream, keep_stop=req.keep_stop)
    all_ids: list[int] = []
    all_logprobs: list[TokenLogprob] = []
    usage: protos.Usage | None = None
    ended = False
    try:
        while True:
            out = await channel.next()
            if out.usage is not None:
                usage = out.usage
            if out.finish_reason == "error":
                ended = True
                raise GenerationError(out.error or "the scheduler failed the request")
            piece, stopped = text.push(out.token_ids)
            ids = out.token_ids[:text.used]
            logprobs = token_logprobs(out)[:text.used]
            tracker.tokens(len(ids))
            all_ids.extend(ids)
            all_logprobs.extend(logprobs)
            if stopped or out.finished:
                ended = True
                if stopped:
                    link.abort(req.rid)
                    reason = "stop"
                else:
                    piece += text.finish()
                    reason = "stop" if text.stopped else (out.finish_reason or "stop")
                final = final_usage(req, usage, len(all_ids))
                tracker.finish("aborted" if reason == "abort" else "ok", TokenCounts(
                    final.prompt_tokens, final.completion_tokens, final.cached_device, final.cached_host,
                    final.cached_storage))
                if log is not None:
                    log.record(req.input_ids, req.cache_salt, final.completion_tokens,
                               final.cached_device + final.cached_host + final.cached_storage)
                if req.stream:
                    yield Step(piece, ids, reason, final, logprobs)
                else:  # nothing was yielded before: the whole output at once
                    yield Step(text.text, all_ids, reason, final, all_logprobs)
                return
            if req.stream and (piece or ids):
                yield Step(piece, ids, logprobs=logprobs)
    finally:
        channel.close()
        if not ended:
            link.abort(req.rid)
