"""``GET /openapi.json`` and ``hicache.api_server.openapi``: the document is valid OpenAPI 3.1,
lists exactly the routes the app registers, and agrees with the request validation field by
field: a value the document allows is accepted, a value outside a range (or set) the
document gives is refused with 400."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, cast

import jsonschema
import pytest

import protos
from hicache.api_server.http_api import HttpApi
from hicache.api_server.openapi import openapi_document
from hicache.api_server.validation import (
    ModelLimits,
    RequestError,
    parse_chat,
    parse_completion,
    parse_generate,
)
from hicache.config import config_from_dict
from hicache.metrics import Metrics
from hicache.text import ByteTokenizer

from .fake_scheduler import FakeScheduler
from .harness import TokenizerProcess

LIMITS = ModelLimits("m", vocab_size=512, max_context=512, max_new_tokens_limit=32, default_max_new_tokens=8)
TOKENIZER = ByteTokenizer()
CONFIG = config_from_dict({"model": {"reference": {"preset": "tiny"}}})
DOC = openapi_document(LIMITS)
METHODS = ("get", "put", "post", "delete", "patch", "options", "head", "trace")

# a value of each JSON type: the ones a field's schema allows must be accepted
POOL: tuple[Any, ...] = (None, "x", "", 0, 1, 2, -1, 1.5, True, False, [], [1], ["x"], [None], {}, {"a": 1})


def test_document_is_valid_openapi_3_1() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(DOC)
    assert DOC["openapi"].startswith("3.1")
    for path, item in DOC["paths"].items():
        for method, op in item.items():
            if method not in METHODS:
                continue
            errors = [c for c in op["responses"] if int(c) >= 400]
            assert errors, (method, path)
            for code in errors:  # every error is the Error object (but /metrics' plain-text 404)
                content = op["responses"][code]["content"]
                if (path, code) not in (("/metrics", "404"), ("/health", "503")):
                    assert content == {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}


def _app() -> HttpApi:
    return HttpApi(link=cast(Any, None), tokenizer=TOKENIZER, limits=LIMITS, config=CONFIG, pids={},
                   metrics=Metrics(None), max_body_bytes=1 << 20, admin_timeout_s=1.0)


def test_document_lists_exactly_the_registered_routes() -> None:
    registered = set()
    for route in _app().app.router.routes():
        if route.method == "HEAD":  # aiohttp's implicit HEAD of every GET
            continue
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info["formatter"].replace("{model_id:.+}", "{model_id}")
        registered.add((route.method.lower(), path.replace("{model_id:.+}", "{model_id}")))
    documented = {(m, p) for p, item in DOC["paths"].items() for m in item if m in METHODS}
    assert documented == registered
    assert ("get", "/openapi.json") in registered


def test_served_document_needs_no_scheduler(tok: TokenizerProcess, fake: FakeScheduler) -> None:
    before = len([m for m in fake.received if isinstance(m, protos.AdminRequest | protos.GenerateRequest)])
    r = tok.get("/openapi.json")
    assert r.status == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc == openapi_document(ModelLimits.from_config(tok.config))
    gen = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    sp = gen["properties"]["sampling_params"]["anyOf"][0]["properties"]
    assert sp["max_new_tokens"]["anyOf"][0]["maximum"] == tok.config.scheduler.max_new_tokens_limit
    after = len([m for m in fake.received if isinstance(m, protos.AdminRequest | protos.GenerateRequest)])
    assert after == before


# --------------------------------------------------------------------------- field by field


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    node: Any = DOC
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return cast(dict[str, Any], node)


def _valid_samples(schema: dict[str, Any]) -> Iterator[Any]:
    """Values the schema allows, at the edges of its ranges where it has them."""
    schema = _resolve(schema)
    yield from schema.get("examples", ())
    if "const" in schema:
        yield schema["const"]
    yield from schema.get("enum", ())
    for option in schema.get("anyOf", ()):
        yield from _valid_samples(option)
    t = schema.get("type")
    if t in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum", 0) + (1 if "exclusiveMinimum" in schema else 0))
        hi = schema.get("maximum", lo + 1)
        yield from (lo, hi)
    elif t == "string":
        yield "y" * max(schema.get("minLength", 1), 1)
        if "maxLength" in schema:
            yield "y" * schema["maxLength"]
    elif t == "array":
        item = next(iter(_valid_samples(schema.get("items", {"type": "string"}))), "y")
        yield [item] * max(schema.get("minItems", 1), 1) if schema.get("maxItems", 1) else []
        if schema.get("maxItems"):
            yield [item] * schema["maxItems"]
    elif t == "boolean":
        yield from (True, False)
    elif t == "null":
        yield None
    elif t == "object":
        yield {}


def _edge_candidates(schema: dict[str, Any]) -> Iterator[Any]:
    """Values just outside each range, length, count or set the schema (or an option of it) gives."""
    schema = _resolve(schema)
    for option in schema.get("anyOf", ()):
        yield from _edge_candidates(option)
    integer = schema.get("type") == "integer"
    step = 1 if integer else 0.005
    if "minimum" in schema:
        yield schema["minimum"] - step
    if "maximum" in schema:
        yield schema["maximum"] + step
    if "exclusiveMinimum" in schema:
        yield schema["exclusiveMinimum"]
    if "maxLength" in schema:
        yield "y" * (schema["maxLength"] + 1)
    if schema.get("minLength"):
        yield ""
    if "maxItems" in schema:
        yield ["y"] * (schema["maxItems"] + 1)
        yield [1] * (schema["maxItems"] + 1)
    if schema.get("minItems"):
        yield []
    if "maxProperties" in schema:
        yield {"a": 1}
    values = [*schema.get("enum", ()), *([schema["const"]] if "const" in schema else [])]
    for value in values:
        if isinstance(value, bool):
            yield not value
        elif isinstance(value, int | float):
            yield value + 1
        elif isinstance(value, str):
            yield value + "x"
    if schema.get("type") == "null":
        yield from ("x", 1, True)


Parser = Callable[[dict[str, Any]], Any]


def _body(path: str, method: str = "post") -> dict[str, Any]:
    return cast(dict[str, Any], DOC["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"])


def _object_of(schema: dict[str, Any]) -> dict[str, Any]:
    """The object option of a (nullable) object schema."""
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == "object":
            return option
    raise AssertionError(schema)


def _cases() -> Iterator[tuple[str, dict[str, Any], Callable[[Any], dict[str, Any]], Parser]]:
    """(name, field schema, body holding a value of that field, parser) for every body field."""
    gen = lambda d: parse_generate(d, "r", TOKENIZER, LIMITS)  # noqa: E731
    comp = lambda d: parse_completion(d, "r", TOKENIZER, LIMITS)  # noqa: E731
    chat = lambda d: parse_chat(d, "r", TOKENIZER, LIMITS)  # noqa: E731
    prompts = {"text": "hi", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}

    companions = {"top_logprobs": {"logprobs": True}}  # the body's dependentSchemas: sent beside the field

    def top(base: dict[str, Any], name: str, exclusive: tuple[str, ...] = (),
            beside: dict[str, Any] | None = None) -> Callable[[Any], dict[str, Any]]:
        def make(value: Any) -> dict[str, Any]:
            body = {k: x for k, x in base.items() if k != name and not (name in exclusive and k in exclusive)}
            body.update(beside or {})
            body[name] = value
            return body
        return make

    def nested(base: dict[str, Any], outer: str, name: str) -> Callable[[Any], dict[str, Any]]:
        return lambda value: {**base, outer: {name: value}}

    routes: list[tuple[str, dict[str, Any], dict[str, Any], Parser, tuple[str, ...]]] = [
        ("/generate", _body("/generate"), {"text": "hi"}, gen, ("text", "input_ids")),
        ("/v1/completions", _body("/v1/completions"), {"prompt": "hi"}, comp, ()),
        ("/v1/chat/completions", _body("/v1/chat/completions"), {"messages": prompts["messages"]}, chat, ()),
    ]
    for route, schema, base, parse, exclusive in routes:
        for name, field in schema["properties"].items():
            beside = companions.get(name) if "dependentSchemas" in schema else None
            yield f"{route} {name}", field, top(base, name, exclusive, beside), parse
            obj = next((o for o in field.get("anyOf", [field]) if o.get("type") == "object" and "properties" in o),
                       None)
            if obj is not None:
                inner_base = {**base, "backend": "redis"} if name == "redis" else base
                for inner, inner_field in obj["properties"].items():
                    yield f"{route} {name}.{inner}", inner_field, nested(inner_base, name, inner), parse


CASES = list(_cases())


def _verdict(parse: Parser, body: dict[str, Any]) -> str:
    try:
        parse(body)
    except RequestError as exc:
        # 400, but 404 for a model that is not served (OpenAI's answer, documented as such)
        assert exc.status == (404 if exc.param == "model" else 400), (body, exc.status, exc.message)
        return f"refused: {exc.message}"
    return "accepted"


@pytest.mark.parametrize("name,schema,make,parse", CASES, ids=[c[0] for c in CASES])
def test_field_agrees_with_the_validator(name: str, schema: dict[str, Any],
                                         make: Callable[[Any], dict[str, Any]], parse: Parser) -> None:
    check = jsonschema.Draft202012Validator(schema).is_valid
    samples = list(_valid_samples(schema))
    assert samples, name
    for value in itertools.chain(samples, POOL):
        if check(value) and not (isinstance(value, bool) and value in (0, 1) and any(
                s is not value and s == value and not isinstance(s, bool) for s in samples)):
            assert _verdict(parse, make(value)) == "accepted", (name, value)
    for value in _edge_candidates(schema):
        if not check(value):
            assert _verdict(parse, make(value)).startswith("refused"), (name, value)


def test_every_range_is_exercised() -> None:
    """The edge candidates are not vacuous: the sampling ranges each give refused values."""
    gen = {name: field for name, field, _, _ in CASES if name.startswith("/generate sampling_params.")}
    for field in ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop", "stop_token_ids"):
        schema = gen[f"/generate sampling_params.{field}"]
        refused = [x for x in _edge_candidates(schema) if not jsonschema.Draft202012Validator(schema).is_valid(x)]
        assert refused, field
