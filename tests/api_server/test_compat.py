"""Client compatibility of the HTTP API: SGLang's ``/generate`` bodies, OpenAI's details, stop
strings checked token by token. A real tokenizer process against the fake scheduler."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .fake_scheduler import OUTPUT, FakeScheduler, expected_cached
from .harness import TokenizerProcess

MODEL = "hicache-reference-tiny"


def _sglang_bench_body(prompt: str | list[int], output_len: int, *, stream: bool) -> dict:
    """The body SGLang's ``bench_serving --backend sglang`` posts to ``/generate`` (its field
    set, with its defaults: ``--disable-ignore-eos`` off, no LoRA, no ``--return-logprob``)."""
    return {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": stream,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
    }


# --------------------------------------------------------------------------- SGLang /generate


def test_sglang_bench_body_non_streaming(tok: TokenizerProcess, fake) -> None:
    r = tok.post("/generate", _sglang_bench_body("Hello", 7, stream=False))
    assert r.status == 200, r.body
    body = r.json()
    assert body["text"] == OUTPUT[:7] and body["meta_info"]["completion_tokens"] == 7
    assert body["meta_info"]["finish_reason"] == "length"


def test_sglang_bench_body_streaming_counts_tokens_as_sglang_does(tok: TokenizerProcess) -> None:
    chunks = tok.stream("/generate", _sglang_bench_body([5, 6, 7], 6, stream=True))[:-1]
    # SGLang's client reads meta_info.completion_tokens of each chunk as the tokens so far
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert counts == [sum(len(c["output_ids"]) for c in chunks[:i + 1]) for i in range(len(chunks))]


def test_sglang_bench_body_with_cache_report_and_extras(tok: TokenizerProcess, fake) -> None:
    body = {**_sglang_bench_body("Hi", 3, stream=False), "return_cached_tokens_details": True,
            "rid": "client-chosen", "top_logprobs_num": 0, "return_text_in_logprobs": False,
            "return_hidden_states": False, "modalities": [], "custom_logit_processor": None,
            "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "image_data": None,
            "priority": 3, "log_metrics": True, "data_parallel_rank": None}
    body["sampling_params"].update({"min_new_tokens": 0, "stop_token_ids": [], "skip_special_tokens": True,
                                    "spaces_between_special_tokens": True, "no_stop_trim": False,
                                    "json_schema": None, "regex": None, "ebnf": None, "n": 1,
                                    "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                    "repetition_penalty": 1.0, "min_p": 0.0, "sampling_seed": 11})
    r = tok.post("/generate", body)
    assert r.status == 200, r.body
    meta = r.json()["meta_info"]
    d, h, s = expected_cached(len("Hi") + 1)
    assert meta["cached_tokens_details"] == {"device": d, "host": h, "storage": s}
    sent = next(m for m in fake.generate_requests() if m.rid == meta["id"])
    assert sent.sampling.seed == 11 and sent.sampling.temperature == 0.0


@pytest.mark.parametrize(("top", "sampling", "param"), [
    ({"return_logprob": True, "logprob_start_len": 0}, {}, "logprob_start_len"),
    ({"return_logprob": True, "token_ids_logprob": [3]}, {}, "token_ids_logprob"),
    ({"return_logprob": True, "top_logprobs_num": 21}, {}, "top_logprobs_num"),
    ({"lora_path": "adapter-a"}, {}, "lora_path"),
    ({"image_data": "http://x/y.png"}, {}, "image_data"),
    ({"custom_logit_processor": "{}"}, {}, "custom_logit_processor"),
    ({"return_hidden_states": True}, {}, "return_hidden_states"),
    ({"bootstrap_host": "10.0.0.1"}, {}, "bootstrap_host"),
    ({"session_params": {"id": "s"}}, {}, "session_params"),
    ({"rid": ["a", "b"]}, {}, "rid"),
    ({}, {"regex": "a+"}, "sampling_params.regex"),
    ({}, {"json_schema": "{}"}, "sampling_params.json_schema"),
    ({}, {"ebnf": "root ::= 'a'"}, "sampling_params.ebnf"),
    ({}, {"n": 2}, "sampling_params.n"),
    ({}, {"min_p": 1.1}, "sampling_params.min_p"),
    ({}, {"frequency_penalty": 2.5}, "sampling_params.frequency_penalty"),
    ({}, {"presence_penalty": -2.5}, "sampling_params.presence_penalty"),
    ({}, {"repetition_penalty": 0}, "sampling_params.repetition_penalty"),
    ({}, {"min_new_tokens": 4}, "sampling_params.min_new_tokens"),
    ({}, {"skip_special_tokens": False}, "sampling_params.skip_special_tokens"),
    ({}, {"stop_regex": "x$"}, "sampling_params.stop_regex"),
    ({}, {"seed": 1, "sampling_seed": 2}, "sampling_params.sampling_seed"),
])
def test_sglang_fields_that_would_change_the_result_are_refused_by_name_or_out_of_range(
        tok: TokenizerProcess, top: dict, sampling: dict, param: str) -> None:
    body = _sglang_bench_body("Hi", 3, stream=False)
    body.update(top)
    body["sampling_params"].update(sampling)
    r = tok.post("/generate", body)
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_no_stop_trim_keeps_the_stop_string(tok: TokenizerProcess) -> None:
    r = tok.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 40, "stop": "brown",
                                                                "no_stop_trim": True}})
    body = r.json()
    assert body["text"] == "The quick brown" and body["meta_info"]["finish_reason"] == "stop"
    assert body["output_ids"] == list(b"The quick brown")


# --------------------------------------------------------------------------- stop strings


def test_non_streaming_stop_is_checked_per_token_and_aborts(tok: TokenizerProcess, fake) -> None:
    r = tok.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 200, "stop": "quick"}})
    body = r.json()
    rid = body["meta_info"]["id"]
    assert body["text"] == "The " and body["meta_info"]["finish_reason"] == "stop"
    # the ids up to the token that completed the stop string, and no more
    assert body["output_ids"] == list(b"The quick")
    assert body["meta_info"]["completion_tokens"] == len(b"The quick")
    sent = next(m for m in fake.generate_requests() if m.rid == rid)
    assert sent.stream, "a request with stop strings must ask the scheduler for every token"
    assert fake.wait_for(lambda f: rid in f.aborts), "the scheduler was not told to stop"


def test_requests_without_stop_strings_are_not_streamed_from_the_scheduler(tok: TokenizerProcess, fake) -> None:
    rid = tok.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 5}}).json()["meta_info"]["id"]
    assert not next(m for m in fake.generate_requests() if m.rid == rid).stream


@pytest.mark.parametrize("stream", [False, True])
def test_openai_stop_counts_agree(tok: TokenizerProcess, stream: bool) -> None:
    body = {"prompt": "abc", "max_tokens": 200, "stop": ["fox"], "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    if stream:
        chunks = tok.stream("/v1/completions", body)[:-1]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert len(usage) == 1
        usage = usage[0]
    else:
        r = tok.post("/v1/completions", body).json()
        text, usage = r["choices"][0]["text"], r["usage"]
    assert text == "The quick brown "
    assert usage["completion_tokens"] == len("The quick brown fox")


# --------------------------------------------------------------------------- OpenAI details


def test_unknown_model_is_404_and_the_served_name_or_none_is_accepted(tok: TokenizerProcess) -> None:
    for path, body in (("/v1/completions", {"prompt": "a", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1})):
        r = tok.post(path, {**body, "model": "gpt-4o"})
        assert r.status == 404, r.body
        assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                     "param": "model", "code": 404}
        assert "gpt-4o" in r.json()["error"]["message"]
        for ok in ({"model": MODEL}, {"model": ""}, {}):
            r = tok.post(path, {**body, **ok})
            assert r.status == 200, (ok, r.body)
            assert r.json()["model"] == MODEL


def test_model_route(tok: TokenizerProcess) -> None:
    r = tok.get(f"/v1/models/{MODEL}")
    assert r.status == 200
    card = r.json()
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 512
    r = tok.get("/v1/models/org/other-model")
    assert r.status == 404 and r.json()["error"]["param"] == "model"


def test_served_model_names_from_config(tmp_path: Path, metrics_dir: Path) -> None:
    tp = TokenizerProcess(tmp_path, {"server.served_model_names": ["alias-a", "org/alias-b"]},
                          pids={"scheduler": os.getpid()})
    fake = FakeScheduler(tp.endpoints)
    tp.start()
    try:
        assert [m["id"] for m in tp.get("/v1/models").json()["data"]] == ["alias-a", "org/alias-b"]
        assert tp.get("/v1/models/org/alias-b").json()["id"] == "org/alias-b"
        assert tp.get(f"/v1/models/{MODEL}").status == 404  # the names replace the model's own
        r = tp.post("/v1/completions", {"model": "org/alias-b", "prompt": "a", "max_tokens": 2})
        assert r.status == 200 and r.json()["model"] == "org/alias-b"
        r = tp.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
        assert r.json()["model"] == "alias-a"  # no model: the first served name
        assert tp.post("/v1/completions", {"model": MODEL, "prompt": "a"}).status == 404
    finally:
        code = tp.stop()
        fake.close()
    assert code == 0, tp.log()


def test_chat_message_has_refusal_null(tok: TokenizerProcess) -> None:
    r = tok.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 3})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": OUTPUT[:3], "refusal": None}


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "abc", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}),
])
def test_streamed_usage_exactly_once_and_only_when_asked(tok: TokenizerProcess, path: str, body: dict) -> None:
    plain = tok.stream(path, {**body, "stream": True})[:-1]
    assert not any("usage" in c for c in plain)
    off = tok.stream(path, {**body, "stream": True, "stream_options": {"include_usage": False}})[:-1]
    assert not any("usage" in c for c in off)
    on = tok.stream(path, {**body, "stream": True, "stream_options": {"include_usage": True}})[:-1]
    with_usage = [c for c in on if c["usage"] is not None]
    assert len(with_usage) == 1 and with_usage[0] is on[-1] and on[-1]["choices"] == []
    assert with_usage[0]["usage"]["completion_tokens"] == 4
    full = tok.post(path, body).json()  # non-streaming: always
    assert full["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "abc", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 4}),
])
def test_return_cached_tokens_details_adds_sglext(tok: TokenizerProcess, path: str, body: dict) -> None:
    full = tok.post(path, {**body, "return_cached_tokens_details": True}).json()
    details = full["usage"]["cached_tokens_details"]
    assert full["sglext"] == {"cached_tokens_details": details}
    assert "sglext" not in tok.post(path, body).json()
    chunks = tok.stream(path, {**body, "stream": True, "return_cached_tokens_details": True})[:-1]
    ext = [c for c in chunks if "sglext" in c]
    assert len(ext) == 1 and ext[0]["choices"] == [] and ext[0]["sglext"] == {"cached_tokens_details": details}


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfffy"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages[0].content[0].text"),
    ("/generate", b'{"text": "\\udc00"}', "text"),
    ("/generate", b'{"text": "a", "sampling_params": {"stop": ["\\ud800"]}}', "sampling_params.stop[0]"),
])
def test_text_that_is_not_unicode_is_400(tok: TokenizerProcess, path: str, raw: bytes, param: str) -> None:
    r = tok.post(path, raw=raw)
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == param and "not valid Unicode" in err["message"], err


def test_a_valid_surrogate_pair_is_text(tok: TokenizerProcess) -> None:
    r = tok.post("/generate", raw=b'{"text": "\\ud83d\\ude00", "sampling_params": {"max_new_tokens": 2}}')
    assert r.status == 200, r.body


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a", "n": 2, "seed": 2**63 - 1}, "seed"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "min_p": -0.2}, "min_p"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.01}, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 101}, "repetition_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "a", "colour": 1}, "colour"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "a"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ("/generate", {"input_ids": [1, 9999]}, "input_ids"),
])
def test_errors_name_the_field(tok: TokenizerProcess, path: str, body: dict, param: str) -> None:
    r = tok.post(path, body)
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
