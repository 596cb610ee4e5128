"""Messages the tokenizer process receives from the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protos.base import Message, message

__all__ = ["AdminReply", "TokenizerMessage", "TokenOutput", "Usage"]


class TokenizerMessage(Message):
    """Base of everything the tokenizer can be told."""

    __slots__ = ()


@dataclass(slots=True)
class Usage:
    """Token accounting of one request; the three ``cached_*`` add up to the cached prompt tokens.

    Where the time to the first token went, in the scheduler: ``queue_ms`` from arrival to
    admission (it includes any L2 load-back or L3 prefetch wait), ``load_ms`` the load-back
    alone (from sending it to its acknowledgement), ``prefill_ms`` from admission to the
    first sampled token (the suffix prefill).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    queue_ms: float = 0.0
    load_ms: float = 0.0
    prefill_ms: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage


@message("token_output")
@dataclass(slots=True)
class TokenOutput(TokenizerMessage):
    """New tokens of a request. ``finish_reason`` (stop | length | abort | error) when finished.

    With ``SamplingParams.logprobs`` set, three lists parallel to ``token_ids``:
    ``logprobs[i]`` is token i's log-probability, ``top_ids[i]`` / ``top_logprobs[i]`` the
    most likely ids and theirs (most likely first). Otherwise all three are None."""

    rid: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


@message("admin_reply")
@dataclass(slots=True)
class AdminReply(TokenizerMessage):
    rid: str
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
