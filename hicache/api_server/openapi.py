"""The OpenAPI 3.1 description of the HTTP API, served as ``GET /openapi.json``.

``openapi_document(limits)`` returns the document as a plain dict (JSON-serialisable). It
is built from the same names and constants the request validation uses: the field tuples
of the dialect modules of ``hicache.api_server.validation`` (every accepted field is a
property, and every body schema has ``additionalProperties: false``, as unknown fields are
refused), the sampling ranges of ``hicache.model.sampling_params`` and the model's own
limits (vocabulary size, ``max_new_tokens_limit``), so that the document cannot drift from
what is accepted without a test noticing (``tests/api_server/test_openapi.py``).

Contract: every range in the document is one the validator enforces (a value inside is
accepted on its own, one outside is refused with 400). The document may be stricter than
the validator where JSON Schema cannot say what it accepts (``null`` for an absent prompt
field, ``true`` compared equal to ``1``); it never allows a value the validator refuses on
its own, except for the checks that involve several fields or the tokenized prompt
(exactly one of ``text`` and ``input_ids``, the prompt plus the token budget fitting the
context), which are described in the operation's text and answered with 400.

Every error response (4xx, 5xx) is the ``Error`` object ``{"error": {"message", "type",
"param", "code"}}``, except ``GET /metrics``' 404 when metrics are disabled (plain text).
aiohttp's implicit ``HEAD`` for each ``GET`` route is not listed.
"""

from __future__ import annotations

import copy
from typing import Any

from hicache.api_server.validation import common, generate, openai_api
from hicache.api_server.validation.common import ModelLimits
from hicache.model.sampling_params import (
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
)

Schema = dict[str, Any]

OPENAPI_VERSION = "3.1.0"

_ERROR_TEXT = {
    400: "invalid request body or parameter",
    401: "missing or wrong API key (only when server.api_key, server.api_keys or server.operator is set)",
    403: "the operator's route or object, and the key is a tenant's (docs/operations.md \"Security\")",
    404: "not found (an unknown path, or a model that is not served)",
    405: "method not allowed",
    408: "the request body did not arrive within server.body_timeout_s",
    409: "conflict (the cache is busy, or an L3 backend without L2)",
    413: "the request body is over the size limit",
    500: "the scheduler failed the request",
    501: "the daemon runs in engine mode (engine.kind: vllm): the engines generate",
    503: "shutting down, or the scheduler is unavailable or its queue is full",
    504: "the scheduler did not answer in time",
}


def _nullable(schema: Schema) -> Schema:
    """``schema`` or null (the validator reads null as "absent")."""
    return {"anyOf": [schema, {"type": "null"}]}


def _int(minimum: int | None = None, maximum: int | None = None, **extra: Any) -> Schema:
    s: Schema = {"type": "integer", **extra}
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return s


def _neutral(*values: Any, description: str) -> Schema:
    """A field this server does not implement: only null and its neutral value(s)."""
    return {"enum": [*values, None], "description": f"not implemented; only the neutral value ({description})"}


def _never(description: str) -> Schema:
    """A field that must be null or absent."""
    return {"type": "null", "description": f"not supported: {description}"}


def _empty_or_null() -> Schema:
    return {"anyOf": [{"type": "null"}, {"const": ""}, {"type": "array", "maxItems": 0},
                      {"type": "object", "maxProperties": 0}]}


def _object(props: dict[str, Schema], fields: tuple[str, ...], required: tuple[str, ...] = (), **extra: Any) -> Schema:
    """An object with exactly ``fields`` as properties (asserted: the document must list every
    accepted field and nothing else) and no other properties."""
    assert set(props) == set(fields), sorted(set(props) ^ set(fields))
    s: Schema = {"type": "object", "properties": {k: props[k] for k in fields}, "additionalProperties": False}
    if required:
        s["required"] = list(required)
    s.update(extra)
    return s


def _sampling_props(limits: ModelLimits) -> dict[str, Schema]:
    """The sampling fields every generation route shares (null: the default)."""
    token = _int(0, limits.vocab_size - 1)
    return {
        "temperature": _nullable({"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_TEMPERATURE,
                                                            "maximum": MAX_TEMPERATURE}]}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable(_int(0, min(MAX_TOP_K, limits.vocab_size), description="0 = off")),
        "seed": _nullable(_int(0, MAX_SEED)),
        "stop": _nullable({"anyOf": [
            {"type": "string", "minLength": 1, "maxLength": common.MAX_STOP_LENGTH},
            {"type": "array", "maxItems": common.MAX_STOP_STRINGS,
             "items": {"type": "string", "minLength": 1, "maxLength": common.MAX_STOP_LENGTH}}]}),
        "stop_token_ids": _nullable({"type": "array", "items": token}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "presence_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
        "repetition_penalty": _nullable({"type": "number", "minimum": MIN_REPETITION_PENALTY,
                                         "maximum": MAX_REPETITION_PENALTY, "description": "1 = off"}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1, "description": "0 = off"}),
    }


def _logprobs_count(description: str) -> Schema:
    return _nullable(_int(0, MAX_LOGPROBS, description=description))


def _max_tokens(limits: ModelLimits) -> Schema:
    return _nullable(_int(1, limits.max_new_tokens_limit,
                          description="the prompt plus this must fit the model's context; "
                                      "default: min(default_max_new_tokens, room left)"))


def _salt() -> Schema:
    return _nullable({"type": "string", "maxLength": common.MAX_CACHE_SALT_LENGTH})


def generate_body(limits: ModelLimits) -> Schema:
    """The ``POST /generate`` body (SGLang's shape)."""
    sp = {
        **_sampling_props(limits),
        "max_new_tokens": _max_tokens(limits),
        "sampling_seed": _nullable(_int(0, MAX_SEED, description="the same as seed (they must agree)")),
        "no_stop_trim": _nullable({"type": "boolean"}),
        "skip_special_tokens": _neutral(True, description="true"),
        "spaces_between_special_tokens": _nullable({"type": "boolean"}),
        "stream_interval": _nullable({"type": "integer"}),
        "min_new_tokens": _neutral(0, description="0"),
        "n": _neutral(1, description="1; the OpenAI routes take n"),
        **{name: _never("constrained decoding") for name in ("json_schema", "regex", "ebnf", "structural_tag")},
        "stop_regex": _empty_or_null(),
        "logit_bias": _empty_or_null(),
        "custom_params": _empty_or_null(),
    }
    sampling = _nullable(_object(sp, generate.GENERATE_SAMPLING))
    props: dict[str, Schema] = {
        "text": {"type": "string", "description": "the prompt as text (exactly one of text and input_ids)"},
        "input_ids": {"type": "array", "minItems": 1, "items": _int(0, limits.vocab_size - 1),
                      "description": "the prompt as token ids (exactly one of text and input_ids)"},
        "sampling_params": sampling,
        "stream": _nullable({"type": "boolean"}),
        "cache_salt": _salt(),
        "rid": _nullable({"type": "string", "description": "ignored (the server names requests)"}),
        "return_logprob": _nullable({"type": "boolean", "description": "logprobs of the output tokens"}),
        "logprob_start_len": _nullable({"type": "integer", "description": "with return_logprob only -1 "
                                                                           "(prompt logprobs are not implemented)"}),
        "top_logprobs_num": _logprobs_count("alternatives per output token (with return_logprob)"),
        "token_ids_logprob": _nullable({"type": "array", "items": {"type": "integer"},
                                        "description": "with return_logprob only empty"}),
        "return_text_in_logprobs": _nullable({"type": "boolean"}),
        "return_hidden_states": _neutral(False, description="false"),
        "return_routed_experts": _neutral(False, description="false"),
        "modalities": _nullable({"type": "array", "items": _nullable({"type": "string"})}),
        **{name: _empty_or_null() for name in generate.MEDIA_FIELDS},
        "session_params": _empty_or_null(),
        "session_id": _nullable({"type": "string"}),
        "lora_path": _nullable({"type": "array", "items": {"type": "null"}}),
        "lora_id": _never("LoRA adapters"),
        "custom_logit_processor": _never("custom logit processors"),
        **{name: _never("prefill-decode disaggregation") for name in generate.DISAGG_FIELDS},
        "data_parallel_rank": _neutral(0, description="0"),
        "routed_dp_rank": _neutral(0, description="0"),
        "priority": _nullable({"type": "integer"}),
        "extra_key": _salt(),
        "log_metrics": _nullable({"type": "boolean"}),
        "no_logs": _nullable({"type": "boolean"}),
        "custom_labels": _nullable({"type": "object"}),
        "conversation_id": _nullable({"type": "string"}),
        "routing_key": _nullable({"type": "string"}),
        "return_cached_tokens_details": _nullable({"type": "boolean"}),
    }
    return _object(props, generate.GENERATE_FIELDS,
                   oneOf=[{"required": ["text"], "not": {"required": ["input_ids"]}},
                          {"required": ["input_ids"], "not": {"required": ["text"]}}])


def _openai_common(limits: ModelLimits) -> dict[str, Schema]:
    return {
        **_sampling_props(limits),
        "model": {"enum": [*limits.names, "", None],
                  "description": "one of the served names; empty or absent: the first; any other name: 404"},
        "max_tokens": _max_tokens(limits),
        "n": _nullable(_int(1, limits.max_samples,
                            description="independent samples (server.max_samples); with a seed, sample i uses "
                                        "seed + i")),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable(_object(
            {"include_usage": _nullable({"type": "boolean"}), "continuous_usage_stats": _nullable({"type": "boolean"})},
            ("include_usage", "continuous_usage_stats"))),
        "user": _nullable({"type": "string"}),
        "logit_bias": {"anyOf": [{"type": "null"}, {"type": "object", "maxProperties": 0}],
                       "description": "not implemented; only {} or null"},
        "cache_salt": _salt(),
        "return_cached_tokens_details": _nullable({"type": "boolean"}),
    }


def completion_body(limits: ModelLimits) -> Schema:
    """The ``POST /v1/completions`` body."""
    ids = {"type": "array", "minItems": 1, "items": _int(0, limits.vocab_size - 1)}
    props = {
        **_openai_common(limits),
        "prompt": {"anyOf": [{"type": "string"}, ids, {"type": "array", "minItems": 1, "maxItems": 1,
                                                        "items": {"anyOf": [{"type": "string"}, ids]}}],
                   "description": "one prompt: text or token ids (an array of one of them is a batch of one)"},
        "echo": _neutral(False, description="false"),
        "best_of": _neutral(1, description="1"),
        "suffix": _neutral("", description='""'),
        "logprobs": _logprobs_count("the chosen token's logprob and this many alternatives per token"),
    }
    return _object(props, openai_api.COMPLETION_FIELDS, required=("prompt",))


def chat_body(limits: ModelLimits) -> Schema:
    """The ``POST /v1/chat/completions`` body."""
    part = _object({"type": {"const": "text"}, "text": _nullable({"type": "string"})}, ("type", "text"),
                   required=("type",))
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    name = _nullable({"type": "string"})
    message = {"anyOf": [
        _object({"role": {"enum": [r for r in openai_api.CHAT_ROLES if r != "assistant"]}, "content": content, "name": name},
                ("role", "content", "name"), required=("role", "content")),
        _object({"role": {"const": "assistant"}, "content": _nullable(content), "name": name},
                ("role", "content", "name"), required=("role",)),
    ]}
    props = {
        **_openai_common(limits),
        "messages": {"type": "array", "minItems": 1, "items": message},
        "max_completion_tokens": _max_tokens(limits),
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _logprobs_count("alternatives per token (needs logprobs: true)"),
        "response_format": {"anyOf": [{"type": "null"}, _object({"type": {"const": "text"}}, ("type",),
                                                                 required=("type",))],
                            "description": "only the text format"},
        "tools": {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}], "description": "not implemented"},
        "tool_choice": _neutral("none", description='"none"'),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
    }
    needs_logprobs = {"anyOf": [{"properties": {"top_logprobs": {"enum": [0, None]}}},
                                {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}]}
    return _object(props, openai_api.CHAT_FIELDS, required=("messages",), dependentSchemas={"top_logprobs": needs_logprobs})


def storage_body() -> Schema:
    """The ``PUT /cache/storage`` body: the name of a store the config names
    (``validation.parse_storage_choice``)."""
    return _object({"store": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                              "description": "default (cache.l3) or a name of cache.l3_stores; an HTTP caller "
                                             "never names a URL, a path or a secret source"}},
                   ("store",), required=("store",))


# --------------------------------------------------------------------------- responses

_USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details",
                 "cached_tokens_details"],
    "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "required": ["cached_tokens"],
                                  "properties": {"cached_tokens": {"type": "integer"}}},
        "cached_tokens_details": {"$ref": "#/components/schemas/CachedTokensDetails"},
    },
}


def _openai_response(obj: str, payload: str, payload_schema: dict[str, Any]) -> dict[str, Any]:
    """The schema of a non-streamed OpenAI completion object (``obj``) whose choices carry
    ``payload`` (``text`` or ``message``, described by ``payload_schema``)."""
    return {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", payload, "logprobs", "finish_reason"],
                "properties": {"index": {"type": "integer"}, **payload_schema,
                               "logprobs": {"type": ["object", "null"], "description": "null unless asked"},
                               "finish_reason": {"type": ["string", "null"]}}}},
            "usage": {"$ref": "#/components/schemas/Usage"},
            "sglext": {"type": "object"},
        },
    }

_COMPONENTS: dict[str, Schema] = {
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
    },
    "CachedTokensDetails": {
        "type": "object", "required": ["device", "host", "storage"],
        "properties": {k: {"type": "integer", "minimum": 0} for k in ("device", "host", "storage")},
    },
    "Usage": _USAGE,
    "GenerateResponse": {
        "type": "object", "required": ["text", "output_ids", "meta_info"],
        "properties": {
            "text": {"type": "string"}, "output_ids": {"type": "array", "items": {"type": "integer"}},
            "meta_info": {
                "type": "object",
                "required": ["id", "prompt_tokens", "completion_tokens", "cached_tokens", "cached_tokens_details",
                             "timings_ms", "finish_reason"],
                "properties": {
                    "id": {"type": "string"}, "prompt_tokens": {"type": "integer"},
                    "completion_tokens": {"type": "integer"}, "cached_tokens": {"type": "integer"},
                    "cached_tokens_details": {"$ref": "#/components/schemas/CachedTokensDetails"},
                    "timings_ms": {"type": "object", "required": ["queue", "load", "prefill"],
                                   "properties": {k: {"type": "number"} for k in ("queue", "load", "prefill")}},
                    "finish_reason": {"type": ["string", "null"]},
                    "output_token_logprobs": {"type": "array", "description": "with return_logprob: "
                                              "[logprob, id, text or null] per output token"},
                    "output_top_logprobs": {"type": "array"},
                    "input_token_logprobs": {"type": "array", "maxItems": 0},
                    "input_top_logprobs": {"type": "array", "maxItems": 0},
                }},
        },
    },
    "Completion": _openai_response("text_completion", "text", {"text": {"type": "string"}}),
    "ChatCompletion": _openai_response("chat.completion", "message", {
        "message": {"type": "object", "required": ["role", "content"],
                    "properties": {"role": {"const": "assistant"}, "content": {"type": "string"},
                                   "refusal": {"type": "null"}}}}),
    "Model": {
        "type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"],
        "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                       "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}},
    },
    "ModelList": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}},
    },
    "Health": {
        "type": "object", "required": ["status", "processes"],
        "properties": {
            "status": {"enum": ["ok", "degraded", "draining"]},
            "processes": {"type": "object", "additionalProperties": {"type": "integer"}},
            "dead": {"type": "array", "items": {"type": "string"}},
            "stale": {"type": "object", "additionalProperties": {"type": "number"}},
        },
    },
    "AdminResult": {"type": "object", "description": "the scheduler's AdminReply.result"},
}


def _json_content(ref: str) -> Schema:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


def _responses(ok: Schema, *errors: int) -> dict[str, Any]:
    out: dict[str, Any] = {"200": ok}
    for code in sorted({*errors, 405}):
        out[str(code)] = {"description": _ERROR_TEXT[code], "content": _json_content("Error")}
    return out


def _generation(summary: str, body: Schema, ok_ref: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "description": "Refused with 400 also for what involves several fields or the tokenized prompt: the "
                       "prompt must be non-empty and leave room in the model's context for the token budget.",
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": _responses(
            {"description": "the result; with stream: true, server-sent events (data: <chunk>, ..., data: [DONE])",
             "content": {**_json_content(ok_ref), "text/event-stream": {}}},
            400, 401, 404, 408, 413, 500, 501, 503),
    }}


def _admin(method: str, summary: str, *errors: int, body: Schema | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary,
                          "responses": _responses({"description": "the scheduler's answer",
                                                   "content": _json_content("AdminResult")},
                                                  401, 403, 409, 500, 503, 504, *errors)}
    if body is not None:
        op["requestBody"] = {"required": method == "put", "content": {"application/json": {"schema": body}}}
    return {method: op}


def _no_body() -> Schema:
    return {"type": "object", "maxProperties": 0, "description": "no body, or an empty object"}


def pin_body(limits: ModelLimits) -> Schema:
    """The ``PUT /cache/pinned`` body (``hicache.api_server.pinning``); the scheduler refuses
    with 400 what only it can judge: a prefix shorter than a page, or past its tier's share."""
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0,
                                                      "maximum": limits.vocab_size - 1}}
    return _object({
        "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"},
        "text": {"type": "string", "minLength": 1, "description": "tokenized as a completion prompt is"},
        "input_ids": ids,
        "cache_salt": {"type": "string"},
        "tiers": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"enum": ["l1", "l2"]},
                  "description": "default: every tier that is on"},
        "tenant": {"type": "string", "description": "the operator's: pin in this tenant's namespace (a tenant "
                                                    "pins in its own)"},
    }, ("name", "text", "input_ids", "cache_salt", "tiers", "tenant"), required=("name",),
        oneOf=[{"required": ["text"], "not": {"required": ["input_ids"]}},
               {"required": ["input_ids"], "not": {"required": ["text"]}}])


def openapi_document(limits: ModelLimits) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API for the model ``limits`` describes (a fresh dict:
    the caller may change it). Needs nothing from the scheduler."""
    paths: dict[str, Any] = {
        "/generate": _generation("native generation (SGLang's /generate)", generate_body(limits), "GenerateResponse"),
        "/v1/completions": _generation("OpenAI completions", completion_body(limits), "Completion"),
        "/v1/chat/completions": _generation("OpenAI chat completions", chat_body(limits), "ChatCompletion"),
        "/v1/models": {"get": {"summary": "the served model names",
                               "responses": _responses({"description": "the models",
                                                        "content": _json_content("ModelList")}, 401)}},
        "/v1/models/{model_id}": {"get": {
            "summary": "one served model",
            "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": _responses({"description": "the model", "content": _json_content("Model")}, 401, 404)}},
        "/health": {"get": {
            "summary": "readiness; with live=1, liveness (always 200)",
            "parameters": [{"name": "live", "in": "query", "required": False, "schema": {"type": "string"},
                            "description": "anything but empty, 0 or false: liveness"}],
            "responses": {
                "200": {"description": "ready (or live)", "content": _json_content("Health")},
                "405": {"description": _ERROR_TEXT[405], "content": _json_content("Error")},
                "503": {"description": "not ready: degraded or draining", "content": _json_content("Health")},
            }}},
        "/metrics": {"get": {
            "summary": "Prometheus exposition of all processes",
            "responses": {
                "200": {"description": "the metrics", "content": {"text/plain": {"schema": {"type": "string"}}}},
                "401": {"description": _ERROR_TEXT[401], "content": _json_content("Error")},
                "403": {"description": _ERROR_TEXT[403], "content": _json_content("Error")},
                "404": {"description": "metrics are disabled", "content": {"text/plain": {"schema": {"type": "string"}}}},
                "405": {"description": _ERROR_TEXT[405], "content": _json_content("Error")},
            }}},
        "/openapi.json": {"get": {
            "summary": "this document",
            "responses": _responses({"description": "the OpenAPI document",
                                     "content": {"application/json": {"schema": {"type": "object"}}}}, 401)}},
        "/cache/stats": _admin("get", "cache statistics"),
        "/cache/flush": _admin("post", "flush L1 and L2 (L3 is kept)", 400, 408, 413, body=_no_body()),
        "/cache/storage": {
            **_admin("get", "the L3 backend's status"),
            **_admin("put", "attach an L3 store the config names", 400, 408, 413, body=storage_body()),
            **_admin("delete", "detach the L3 backend", 400, 408, 413, body=_no_body()),
        },
        "/cache/storage/clear": _admin("post", "clear the L3 backend", 400, 408, 413, body=_no_body()),
        "/cache/pinned": {
            **_admin("get", "the pinned prefixes, and each tier's share for them"),
            **_admin("put", "pin a prefix (or replace the pin of that name); answered once it is pinned",
                     400, 408, 413, body=pin_body(limits)),
        },
        "/cache/pinned/{name}": {"delete": {
            **_admin("delete", "unpin a prefix (its pages stay cached, evictable)", 404)["delete"],
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
                           {"name": "tenant", "in": "query", "required": False, "schema": {"type": "string"},
                            "description": "the operator's: the pin of this tenant"}]}},
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "hicache", "version": "1",
                 "description": "Tiered KV-cache daemon: generation (native and OpenAI-compatible), health, "
                                "metrics and cache administration."},
        "paths": paths,
        "components": {
            "schemas": copy.deepcopy(_COMPONENTS),
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "One of the configured keys, when any is: the operator's (server.operator, or "
                               "server.api_key) or a tenant's (server.api_keys: a tenant's requests only hit its "
                               "own cached pages, whatever cache_salt they send, and its /cache calls act on its "
                               "own namespaces; /metrics and /cache/storage are the operator's). Not needed for "
                               "/health."}},
        },
        "security": [{}, {"bearer": []}],
    }
