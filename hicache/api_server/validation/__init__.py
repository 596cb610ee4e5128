"""Request bodies -> validated requests, one module per API dialect. Every problem is a
``RequestError`` (400 unless it says otherwise) whose message starts with the field as the
route spells it (``sampling_params.temperature`` on ``/generate``, ``temperature`` on the
OpenAI routes) and whose ``param`` names it.

| module       | owns                                                                      |
|--------------|---------------------------------------------------------------------------|
| `common`     | `RequestError`, `ModelLimits`, `PreparedRequest`, JSON, typed field reads, |
|              | the checks every route shares (`finish_request`)                           |
| `generate`   | `POST /generate` (SGLang's fields)                                         |
| `openai_api` | `POST /v1/completions`, `POST /v1/chat/completions`                        |
| `storage`    | `PUT /cache/storage` (a store the config names)                            |

Unknown fields are refused (a typo must not silently change behaviour). Fields this server
does not implement (OpenAI's ``logit_bias``, ``echo``; SGLang's ``regex``, ``json_schema``,
``lora_path``, prompt logprobs, ``n`` on ``/generate`` ...) are accepted only with their
neutral value (``logit_bias: {}``, ``lora_path: null``, ``n: 1`` ...) and refused by name
otherwise: a field that would change the result is never silently ignored. Fields that
cannot change the result (SGLang's ``rid``, ``priority`` ...) are type-checked and ignored,
as SGLang ignores them. Penalties, ``min_p`` and logprobs (``k`` at most ``MAX_LOGPROBS``)
are honoured on every route. This package re-exports the names the HTTP layer uses.
See docs/architecture.md §11.
"""

from __future__ import annotations

from hicache.api_server.validation.common import (
    MAX_CACHE_SALT_LENGTH,
    MAX_N,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    ModelLimits,
    PreparedRequest,
    RequestError,
    check_token_ids,
    check_unicode,
    encode_prompt,
    parse_json,
)
from hicache.api_server.validation.generate import parse_generate
from hicache.api_server.validation.openai_api import parse_chat, parse_completion
from hicache.api_server.validation.storage import STORAGE_FIELDS, attachable_stores, parse_storage_choice

__all__ = [
    "MAX_CACHE_SALT_LENGTH",
    "MAX_N",
    "MAX_STOP_LENGTH",
    "MAX_STOP_STRINGS",
    "STORAGE_FIELDS",
    "ModelLimits",
    "PreparedRequest",
    "RequestError",
    "attachable_stores",
    "check_token_ids",
    "check_unicode",
    "encode_prompt",
    "parse_chat",
    "parse_completion",
    "parse_generate",
    "parse_json",
    "parse_storage_choice",
]
