"""The tokenizer process: HTTP API, tokenization and detokenization, the link to the scheduler.

Entry point for the launcher: ``tokenizer_main(TokenizerArgs(...))`` as a ``spawn`` target
(``hicache.api_server.process``). Modules: ``args`` (what the launcher passes), ``process``
(start-up and shutdown), ``scheduler_link`` (ZeroMQ <-> asyncio), ``http_api`` (routes),
``validation`` (request bodies), ``generation`` (one request's round trip), ``textstream``
(incremental detokenization and stop strings), ``formats`` (response bodies).
"""

from __future__ import annotations

from hicache.api_server.args import DEFAULT_GRACE_S, DEFAULT_MAX_BODY_BYTES, TokenizerArgs
from hicache.api_server.process import tokenizer_main

__all__ = ["DEFAULT_GRACE_S", "DEFAULT_MAX_BODY_BYTES", "TokenizerArgs", "tokenizer_main"]
