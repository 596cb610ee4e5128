"""The HTTP API of a real tokenizer process, against a fake scheduler over the real sockets."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

import protos
from hicache.config import MetricsConfig, to_dict
from hicache.metrics import SPECS, mark_process_dead

from .fake_scheduler import OUTPUT, expected_cached
from .harness import TokenizerProcess, parse_sse

BOS = 256


def _usage_ok(usage: dict, prompt_tokens: int, completion_tokens: int) -> None:
    d, h, s = expected_cached(prompt_tokens)
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == prompt_tokens + completion_tokens
    assert usage["prompt_tokens_details"] == {"cached_tokens": d + h + s}
    assert usage["cached_tokens_details"] == {"device": d, "host": h, "storage": s}


# --------------------------------------------------------------------------- /generate


def test_generate_text(tok: TokenizerProcess, fake) -> None:
    r = tok.post("/generate", {"text": "Hello world", "sampling_params": {"max_new_tokens": 12}})
    assert r.status == 200, r.body
    body = r.json()
    assert body["text"] == OUTPUT[:12]
    assert body["output_ids"] == list(OUTPUT[:12].encode())
    meta = body["meta_info"]
    n = len("Hello world") + 1  # BOS
    d, h, s = expected_cached(n)
    assert meta["prompt_tokens"] == n and meta["completion_tokens"] == 12
    assert meta["cached_tokens"] == d + h + s
    assert meta["cached_tokens_details"] == {"device": d, "host": h, "storage": s}
    assert meta["finish_reason"] == "length"
    sent = next(m for m in fake.generate_requests() if m.rid == meta["id"])
    assert sent.input_ids == [BOS, *b"Hello world"]
    assert sent.sampling.max_new_tokens == 12 and sent.sampling.temperature == 0.0
    assert not sent.stream


def test_generate_input_ids_sampling_and_salt(tok: TokenizerProcess, fake) -> None:
    body = {"input_ids": [1, 2, 3, 500], "cache_salt": "tenant-a",
            "sampling_params": {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 7,
                                "stop_token_ids": [511], "ignore_eos": True}}
    r = tok.post("/generate", body)
    assert r.status == 200, r.body
    rid = r.json()["meta_info"]["id"]
    sent = next(m for m in fake.generate_requests() if m.rid == rid)
    assert sent.input_ids == [1, 2, 3, 500] and sent.cache_salt == "tenant-a"
    assert sent.sampling == protos.SamplingParams(5, 0.7, 0.9, 20, 7, [511], True)


def test_generate_default_max_new_tokens(tok: TokenizerProcess, fake) -> None:
    r = tok.post("/generate", {"input_ids": [5] * 10})
    assert r.status == 200, r.body
    assert r.json()["meta_info"]["completion_tokens"] == tok.config.scheduler.default_max_new_tokens
    # near the end of the context the default shrinks to the room left
    ctx = tok.config.model.reference.max_context
    r = tok.post("/generate", {"input_ids": [5] * (ctx - 3)})
    assert r.status == 200, r.body
    assert r.json()["meta_info"]["completion_tokens"] == 3


def test_generate_stream_matches_non_stream(tok: TokenizerProcess) -> None:
    req = {"text": "stream me", "sampling_params": {"max_new_tokens": 20}}
    full = tok.post("/generate", req).json()
    events = tok.stream("/generate", {**req, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [i for c in chunks for i in c["output_ids"]] == full["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]["meta_info"]
    assert last["finish_reason"] == "length" and last["completion_tokens"] == 20
    assert last["cached_tokens_details"] == full["meta_info"]["cached_tokens_details"]


def test_stop_strings_cut_the_text_and_abort(tok: TokenizerProcess, fake) -> None:
    r = tok.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 40, "stop": ["brown", "lazy"]}})
    assert r.status == 200, r.body
    body = r.json()
    assert body["text"] == "The quick "
    assert body["meta_info"]["finish_reason"] == "stop"
    rid = body["meta_info"]["id"]
    assert fake.wait_for(lambda f: rid in f.aborts), "the scheduler was not told to stop"
    # streaming: the same text, no chunk ever shows a part of the stop string
    events = tok.stream("/generate", {"text": "x", "stream": True,
                                      "sampling_params": {"max_new_tokens": 40, "stop": "brown"}})
    chunks = events[:-1]
    assert "".join(c["text"] for c in chunks) == "The quick "
    assert chunks[-1]["meta_info"]["finish_reason"] == "stop"


def test_stop_token_id_ends_with_stop(tok: TokenizerProcess) -> None:
    r = tok.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 40, "stop_token_ids": [ord("k")]}})
    body = r.json()
    assert body["text"] == "The quick" and body["meta_info"]["finish_reason"] == "stop"


# --------------------------------------------------------------------------- OpenAI routes


def test_completions(tok: TokenizerProcess, fake) -> None:
    r = tok.post("/v1/completions", {"model": "hicache-reference-tiny", "prompt": "Once upon", "max_tokens": 9,
                                     "temperature": 0})
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "hicache-reference-tiny"
    assert body["choices"] == [{"index": 0, "text": OUTPUT[:9], "logprobs": None, "finish_reason": "length"}]
    _usage_ok(body["usage"], len("Once upon") + 1, 9)
    rid = body["id"].removeprefix("cmpl-")
    assert next(m for m in fake.generate_requests() if m.rid == rid).sampling.temperature == 0.0


def test_completions_token_prompt_and_default_temperature(tok: TokenizerProcess, fake) -> None:
    r = tok.post("/v1/completions", {"prompt": [[7, 8, 9]], "max_tokens": 2})
    assert r.status == 200, r.body
    rid = r.json()["id"].removeprefix("cmpl-")
    sent = next(m for m in fake.generate_requests() if m.rid == rid)
    assert sent.input_ids == [7, 8, 9]
    assert sent.sampling.temperature == 1.0  # the OpenAI default


def test_completions_stream(tok: TokenizerProcess) -> None:
    events = tok.stream("/v1/completions", {"prompt": "abc", "max_tokens": 6, "stream": True,
                                            "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    # the text chunks (usage null), the last one with finish_reason, then the usage-only chunk
    usage_only = chunks[-1]
    assert usage_only["choices"] == []
    _usage_ok(usage_only["usage"], 4, 6)
    text_chunks = chunks[:-1]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == OUTPUT[:6]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert all("usage" in c and c["usage"] is None for c in text_chunks)  # usage exactly once


def test_chat_completions(tok: TokenizerProcess, fake) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]
    r = tok.post("/v1/chat/completions", {"model": "", "messages": messages, "max_completion_tokens": 4})
    assert r.status == 200, r.body
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT[:4], "refusal": None}
    assert body["choices"][0]["finish_reason"] == "length"
    rid = body["id"].removeprefix("chatcmpl-")
    sent = next(m for m in fake.generate_requests() if m.rid == rid)
    expected = [BOS, *b"system: Be brief.", 259, *b"user: Hi!", 259, *b"assistant: "]
    assert sent.input_ids == expected
    _usage_ok(body["usage"], len(expected), 4)


def test_chat_stream(tok: TokenizerProcess) -> None:
    events = tok.stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "yo"}],
                                                 "max_tokens": 5, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == OUTPUT[:5]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("usage" in c for c in chunks)  # no usage without stream_options.include_usage


def test_models_and_health(tok: TokenizerProcess) -> None:
    models = tok.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "hicache-reference-tiny"
    assert models["data"][0]["max_model_len"] == 512
    r = tok.get("/health")
    assert r.status == 200
    health = r.json()
    assert health["status"] == "ok"
    assert health["processes"]["tokenizer"] == tok.proc.pid
    assert health["processes"]["scheduler"] == os.getpid()


def test_launcher_updates_health_pids(tok: TokenizerProcess) -> None:
    tok.push(protos.Ready("controller", os.getpid()))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if tok.get("/health").json()["processes"].get("controller") == os.getpid():
            return
        time.sleep(0.05)
    raise AssertionError("the controller's pid never showed in /health")


# --------------------------------------------------------------------------- admin routes


def test_admin_routes(tok: TokenizerProcess, fake) -> None:
    r = tok.get("/cache/stats")
    assert r.status == 200 and r.json()["device"]["full"]["capacity"] == 100
    assert tok.post("/cache/flush").json() == {"flushed": True, "args": {}}  # no key: the operator's, unscoped
    assert tok.get("/cache/storage").json() == {"backend": "file", "up": True, "args": {}}
    assert tok.request("DELETE", "/cache/storage").json() == {"detached": True, "args": {}}
    assert tok.post("/cache/storage/clear").json() == {"cleared": 42, "args": {}}
    ops = [m.op for m in fake.received if isinstance(m, protos.AdminRequest)]
    for op in ("stats", "flush", "storage_status", "storage_detach", "storage_clear"):
        assert op in ops


def test_storage_attach_takes_a_store_the_config_names(tok: TokenizerProcess, fake) -> None:
    r = tok.request("PUT", "/cache/storage", {"store": "default"})
    assert r.status == 200, r.body
    l3 = r.json()["args"]["l3"]
    assert l3 == to_dict(tok.config.cache.l3)  # the config's own section, defaults filled in
    for body in ({"backend": "redis", "redis": {"url": "redis://10.0.0.5:6380/2"}}, {"store": "elsewhere"},
                 {"store": "default", "file": {"dir": "/tmp/x"}}):
        bad = tok.request("PUT", "/cache/storage", body)
        assert bad.status == 400 and "(default)" in bad.json()["error"]["message"], bad.body


def test_detach_when_busy_is_409(tok: TokenizerProcess, fake) -> None:
    fake.busy = True
    r = tok.request("DELETE", "/cache/storage")
    assert r.status == 409
    assert "busy" in r.json()["error"]["message"]


def test_admin_failures(tok: TokenizerProcess, fake) -> None:
    fake.admin_mode = "errorreply"
    r = tok.get("/cache/stats")
    assert r.status == 500 and "admin exploded" in r.json()["error"]["message"]
    fake.admin_mode = "silent"
    r = tok.post("/cache/flush")
    assert r.status == 504 and "did not answer flush" in r.json()["error"]["message"]
    fake.admin_mode = "normal"
    r = tok.post("/cache/flush", {"everything": True})
    assert r.status == 400 and "takes no body fields" in r.json()["error"]["message"]
    assert tok.post("/cache/flush", {}).status == 200


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("path", "body", "needle"), [
    ("/generate", b"{not json", "not valid JSON"),
    ("/generate", b"[1, 2]", "must be a JSON object"),
    ("/generate", b"", "empty"),
    ("/generate", b'{"text": "a", "temperature": NaN}', "not valid JSON"),
    ("/generate", {"text": "a", "colour": "red"}, "unknown field(s): colour"),
    ("/generate", {"text": "a", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    ("/generate", {"text": "a", "input_ids": [1]}, "exactly one of text and input_ids"),
    ("/generate", {}, "exactly one of text and input_ids"),
    ("/generate", {"input_ids": [1, 512]}, "input_ids[1] = 512 is outside the vocabulary [0, 512)"),
    ("/generate", {"input_ids": [-1]}, "outside the vocabulary"),
    ("/generate", {"input_ids": [1, "2"]}, "input_ids must be an array of integers"),
    ("/generate", {"input_ids": []}, "the prompt is empty"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be >= 1"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -5}}, "max_new_tokens must be >= 1"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 257}}, "must be <= 256"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2.5}}, "must be an integer"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 600}}, "top_k"),
    ("/generate", {"text": "a", "sampling_params": {"stop_token_ids": [9999]}}, "stop_token_ids"),
    ("/generate", {"text": "a", "sampling_params": {"stop": [""]}}, "stop string"),
    ("/generate", {"text": "a", "stream": "yes"}, "stream must be true or false"),
    ("/generate", {"input_ids": [1] * 512}, "the model's context is 512 tokens"),
    ("/generate", {"text": "a" * 600}, "the model's context is 512 tokens"),
    ("/generate", {"text": "long " * 20_000}, "the model's context is 512 tokens"),  # parsed off the loop
    ("/generate", {"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 100}}, "exceeds the model's context"),
    ("/v1/completions", {"prompt": "a", "n": 129}, "n must be an integer in [1, 128]"),
    ("/v1/completions", {"prompt": "a", "logprobs": 30}, "logprobs must be an integer in [0, 20]"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "only one prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt must be"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens must be >= 1"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": 5}, "frequency_penalty must be a number in [-2, 2]"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias is not implemented"),
    ("/v1/completions", {"prompt": "a", "bogus": 1}, "unknown field(s): bogus"),
    ("/v1/chat/completions", {"messages": []}, "messages must be a non-empty array"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role must be one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "content must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tool calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 999},
     "max_completion_tokens must be <= 256"),
])
def test_invalid_bodies_are_400(tok: TokenizerProcess, path: str, body: object, needle: str) -> None:
    r = tok.post(path, raw=body) if isinstance(body, bytes) else tok.post(path, body)
    assert r.status == 400, (r.status, r.body)
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error"
    assert needle in err["message"], err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_pinned_input_ids_follow_the_generate_rule(tok: TokenizerProcess) -> None:
    """``PUT /cache/pinned`` takes the token ids ``/generate`` takes (the model's vocabulary,
    512 here, beyond the byte-level tokenizer's 260) and refuses the same ones."""
    for ids in ([300] * 8, [511]):
        assert tok.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}).status == 200
        r = tok.request("PUT", "/cache/pinned", {"name": "p", "input_ids": ids})
        assert r.status == 200, r.body
    for ids, needle in (([1, 512], "input_ids[1] = 512 is outside the vocabulary [0, 512)"),
                        ([-1], "outside the vocabulary"), ([1, "2"], "[0, 512)")):
        r = tok.request("PUT", "/cache/pinned", {"name": "p", "input_ids": ids})
        assert r.status == 400 and needle in r.json()["error"]["message"], r.body


def test_oversized_body_is_413_without_reading_it(tok: TokenizerProcess) -> None:
    garbage = os.urandom(2 * 1024 * 1024)
    start = time.monotonic()
    r = tok.post("/generate", raw=garbage)
    assert r.status == 413, r.body
    assert "limit" in r.json()["error"]["message"]
    assert time.monotonic() - start < 10
    # a chunked body without Content-Length is cut off at the limit too
    conn = tok.conn()
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.putheader("Content-Type", "application/json")
    conn.endheaders()
    try:
        for _ in range(40):  # 40 x 64 KiB = 2.5 MiB
            conn.send(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
        conn.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    resp = conn.getresponse()
    assert resp.status == 413
    conn.close()
    assert tok.get("/health").status == 200


def test_unknown_route_and_method(tok: TokenizerProcess) -> None:
    r = tok.get("/nope")
    assert r.status == 404 and r.json()["error"]["code"] == 404
    r = tok.get("/generate")
    assert r.status == 405


# --------------------------------------------------------------------------- failures


def test_scheduler_errors_are_500(tok: TokenizerProcess) -> None:
    r = tok.post("/generate", {"text": "[fail]"})
    assert r.status == 500 and "the model exploded" in r.json()["error"]["message"]
    r = tok.post("/v1/completions", {"prompt": "[errorreply]"})
    assert r.status == 500 and "cannot schedule" in r.json()["error"]["message"]


def _wait_abort(fake, rid_filter, timeout_s: float = 10.0) -> str:
    found: list[str] = []

    def aborted(f) -> bool:
        rids = [m.rid for m in f.received if isinstance(m, protos.GenerateRequest) and rid_filter(m)]
        found[:] = [r for r in rids if r in f.aborts]
        return bool(found)

    assert fake.wait_for(aborted, timeout_s), "no AbortRequest reached the scheduler"
    return found[0]


def test_client_disconnect_mid_stream_aborts(tok: TokenizerProcess, fake) -> None:
    marker = b"[slow] disconnect-stream"
    s = socket.create_connection(("127.0.0.1", tok.port))
    body = b'{"text": "%s", "stream": true, "sampling_params": {"max_new_tokens": 200}}' % marker
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    first = s.recv(4096)
    assert b"200 OK" in first
    s.close()
    _wait_abort(fake, lambda m: m.stream and bytes(i for i in m.input_ids if i < 256).endswith(marker))


def test_client_disconnect_while_waiting_aborts(tok: TokenizerProcess, fake) -> None:
    marker = b"[silent] disconnect-wait"
    s = socket.create_connection(("127.0.0.1", tok.port))
    body = b'{"prompt": "%s", "max_tokens": 5}' % marker
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert fake.wait_for(lambda f: any(
        bytes(i for i in m.input_ids if i < 256).endswith(marker) for m in f.generate_requests()))
    s.close()
    _wait_abort(fake, lambda m: bytes(i for i in m.input_ids if i < 256).endswith(marker))


def test_garbage_frames_are_logged_and_serving_goes_on(tok: TokenizerProcess) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(tok.endpoints.address("tokenizer"))
    push.send(b"\x00garbage\xff")
    push.send(b"\x81\xa1v\x63")  # a msgpack map with a wrong version
    # a well-formed message of a type the tokenizer does not accept
    push.send(protos.encode(protos.AbortRequest("r")))
    # outputs for a request nobody waits for
    push.send(protos.encode(protos.TokenOutput("no-such-rid", [1], True, "stop")))
    push.close(linger=2000)
    ctx.term()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and tok.log().count("dropped a bad frame") < 3:
        time.sleep(0.05)
    assert tok.log().count("dropped a bad frame") >= 3, tok.log()
    assert tok.post("/generate", {"text": "still here"}).status == 200


# --------------------------------------------------------------------------- metrics


def _record_elsewhere(path: str) -> None:
    """Spawn target: record like the scheduler, controller and launcher would."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    from hicache.metrics import init_process_metrics

    m = init_process_metrics(MetricsConfig(enabled=True), "scheduler")
    m.set_pool("device", "full", 100, 1000)
    m.set_queue("waiting", 3)
    m.evicted("host", 64)
    m.prefetched(128)
    m.backed_up(256)
    m.load_join_waited(0.25)
    with m.transfer("h2d", 4096):
        pass
    m.set_storage_up(True)
    m.storage_error("get", 2)
    m.process_restarted("controller")
    m.set_tenant_usage("acme", "host", 64, 128)
    m.set_tenant_l3_usage("acme", 4096, 8192)
    m.set_pinned("device", 32)


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: dict, family: str, sample: str, **labels: str) -> float | None:
    if family not in fams:
        return None
    for s in fams[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def test_metrics_exposition_spans_processes(tok: TokenizerProcess, metrics_dir: Path) -> None:
    assert tok.post("/generate", {"text": "metrics please", "sampling_params": {"max_new_tokens": 4}}).status == 200
    assert tok.post("/generate", {"input_ids": [999999]}).status == 400
    child = mp.get_context("spawn").Process(target=_record_elsewhere, args=(str(metrics_dir),))
    child.start()
    child.join(30)
    assert child.exitcode == 0

    r = tok.get("/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
    fams = _families(r.body.decode())  # the parser raises on invalid exposition
    for spec in SPECS:  # every defined metric is exposed, under its documented name
        base = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
        assert base in fams, spec.name
    # recorded by the tokenizer process
    assert _value(fams, "hicache_requests", "hicache_requests_total", status="ok") >= 1
    assert _value(fams, "hicache_requests", "hicache_requests_total", status="invalid") >= 1
    assert _value(fams, "hicache_ttft_seconds", "hicache_ttft_seconds_count") >= 1
    assert _value(fams, "hicache_e2e_latency_seconds", "hicache_e2e_latency_seconds_count") >= 1
    assert _value(fams, "hicache_inter_token_latency_seconds", "hicache_inter_token_latency_seconds_count") >= 1
    assert _value(fams, "hicache_generation_tokens", "hicache_generation_tokens_total") >= 4
    assert _value(fams, "hicache_cached_tokens", "hicache_cached_tokens_total", tier="device") > 0
    # recorded by the other process
    assert _value(fams, "hicache_pool_used_tokens", "hicache_pool_used_tokens", tier="device", component="full") == 100
    assert _value(fams, "hicache_pool_capacity_tokens", "hicache_pool_capacity_tokens", tier="device") == 1000
    assert _value(fams, "hicache_tenant_used_tokens", "hicache_tenant_used_tokens", tenant="acme", tier="host") == 64
    assert _value(fams, "hicache_tenant_quota_tokens", "hicache_tenant_quota_tokens", tenant="acme", tier="host") == 128
    assert _value(fams, "hicache_tenant_l3_used_bytes", "hicache_tenant_l3_used_bytes", tenant="acme") == 4096
    assert _value(fams, "hicache_tenant_l3_quota_bytes", "hicache_tenant_l3_quota_bytes", tenant="acme") == 8192
    assert _value(fams, "hicache_pinned_tokens", "hicache_pinned_tokens", tier="device") == 32
    assert _value(fams, "hicache_queue_requests", "hicache_queue_requests", queue="waiting") == 3
    assert _value(fams, "hicache_transfer_bytes", "hicache_transfer_bytes_total", direction="h2d") == 4096
    assert _value(fams, "hicache_transfer_seconds", "hicache_transfer_seconds_count", direction="h2d") == 1
    assert _value(fams, "hicache_evicted_tokens", "hicache_evicted_tokens_total", tier="host") == 64
    assert _value(fams, "hicache_prefetch_tokens", "hicache_prefetch_tokens_total") == 128
    assert _value(fams, "hicache_backup_tokens", "hicache_backup_tokens_total") == 256
    assert _value(fams, "hicache_load_join_wait_seconds", "hicache_load_join_wait_seconds_total") == 0.25
    assert _value(fams, "hicache_storage_up", "hicache_storage_up") == 1
    assert _value(fams, "hicache_storage_errors", "hicache_storage_errors_total", op="get") == 2
    assert _value(fams, "hicache_process_restarts", "hicache_process_restarts_total", process="controller") == 1

    # once the launcher marks it dead, its gauges go and its counters stay
    mark_process_dead(child.pid)
    fams = _families(tok.get("/metrics").body.decode())
    assert _value(fams, "hicache_pool_used_tokens", "hicache_pool_used_tokens", tier="device") is None
    assert _value(fams, "hicache_transfer_bytes", "hicache_transfer_bytes_total", direction="h2d") == 4096


def test_sse_parser_sanity() -> None:
    assert parse_sse(b'data: {"a": 1}\n\ndata: [DONE]\n\n') == [{"a": 1}, "[DONE]"]
