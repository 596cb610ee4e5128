"""End to end: stop strings end a generation early, on every route, streaming or not.

One real daemon with the tiny reference model. Its greedy output is the oracle: a first run
without a stop string gives the reference ids and text; a stop string is then picked from
that text (an ASCII piece a few tokens in, at its first occurrence; the seeded random model
writes mostly bytes that are not valid UTF-8), and the same request
with ``stop`` must

- end with ``finish_reason: "stop"`` and text = the reference text cut before the stop string;
- return exactly the ids up to the token that completed the stop string (``output_ids`` a
  prefix of the reference ids; ``completion_tokens`` = their number), far fewer than the
  budget;
- end early at the scheduler too: with a budget of ``BUDGET`` tokens, the stopped request
  takes a fraction of the time of the full-budget request without a stop string.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache.text import ByteTokenizer
from tests.support.daemon import Daemon

TOK = ByteTokenizer()
BUDGET = 256
"""The token budget of the stopped requests (and of the full-length timing reference)."""
REFERENCE = 64
"""How many greedy tokens the reference run generates to pick a stop string from."""
PROMPT = "Tell me a story about caches and tiers"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("stop")
    d = Daemon(tmp, {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 4096}, "l2": {"enabled": False}, "l3": {"backend": "none"}},
        "scheduler": {"max_new_tokens_limit": 1024},
        "logging": {"level": "warning"},
    })
    d.start()
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()


def _stream(d: Daemon, path: str, body: dict[str, Any]) -> list[Any]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.status == 200, (resp.status, raw)
    finally:
        conn.close()
    events = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            payload = block.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]"
    return events[:-1]


def _post(d: Daemon, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, resp = d.request("POST", path, body)
    assert status == 200, (status, resp, d.log())
    return resp


def _pick_stop(ids: list[int]) -> tuple[str, int]:
    """A stop string from the greedy text and the number of ids that complete it: an ASCII
    piece of 1 to 3 characters (no whitespace), after at least 2 characters and 3 tokens."""
    text = TOK.decode(ids)
    for length in (3, 2, 1):
        for start in range(2, len(text) - length):
            cand = text[start:start + length]
            if not (cand.isascii() and cand.isprintable() and cand.strip() == cand):
                continue
            pos = text.find(cand)
            n = next(k for k in range(1, len(ids) + 1) if cand in TOK.decode(ids[:k]))
            if pos >= 2 and 3 <= n < len(ids):
                return cand, n
    pytest.fail(f"no usable stop string in the greedy output {text!r}")


def _reference(d: Daemon, input_ids: list[int]) -> tuple[list[int], str, int]:
    """The greedy ids of ``input_ids``, a stop string in them and how many ids complete it."""
    ref = _post(d, "/generate", {"input_ids": input_ids,
                                 "sampling_params": {"max_new_tokens": REFERENCE, "ignore_eos": True}})
    assert ref["meta_info"]["completion_tokens"] == REFERENCE
    stop, n = _pick_stop(ref["output_ids"])
    return ref["output_ids"], stop, n


def _check_ids(ids: list[int], ref_ids: list[int], stop: str, n: int, text: str, completion_tokens: int) -> None:
    """ids, text and counts agree, and the generation stopped at the stop string."""
    assert ids == ref_ids[:n], "the output ids are not the reference ids up to the stop string"
    assert completion_tokens == len(ids) == n
    full = TOK.decode(ids)
    assert full.startswith(text) and full[len(text):].startswith(stop)
    assert stop not in TOK.decode(ids[:-1])  # the last id completed the stop string


def _elapsed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_generate_stops_early(daemon: Daemon) -> None:
    prompt_ids = TOK.encode(PROMPT, add_special_tokens=True)
    ref_ids, stop, n = _reference(daemon, prompt_ids)
    ref_text = TOK.decode(ref_ids)
    expected_text = ref_text[:ref_text.find(stop)]
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": BUDGET, "ignore_eos": True, "stop": [stop]}}

    r = _post(daemon, "/generate", body)
    assert r["meta_info"]["finish_reason"] == "stop"
    assert r["text"] == expected_text
    _check_ids(r["output_ids"], ref_ids, stop, n, r["text"], r["meta_info"]["completion_tokens"])

    chunks = _stream(daemon, "/generate", {**body, "stream": True})
    ids = [i for c in chunks for i in c["output_ids"]]
    text = "".join(c["text"] for c in chunks)
    assert text == expected_text and chunks[-1]["meta_info"]["finish_reason"] == "stop"
    _check_ids(ids, ref_ids, stop, n, text, chunks[-1]["meta_info"]["completion_tokens"])

    # no_stop_trim (SGLang) keeps the stop string in the text, with the same ids
    kept = _post(daemon, "/generate", {**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True}})
    assert kept["text"] == expected_text + stop and kept["output_ids"] == r["output_ids"]

    # the scheduler stopped too: the stopped request is much faster than the full budget
    full = _elapsed(lambda: _post(daemon, "/generate", {
        "text": PROMPT, "sampling_params": {"max_new_tokens": BUDGET, "ignore_eos": True}}))
    stopped = min(_elapsed(lambda: _post(daemon, "/generate", body)) for _ in range(3))
    assert stopped < full / 3, f"stopped in {stopped:.3f} s, the full {BUDGET} tokens took {full:.3f} s"


def test_completions_stop_early(daemon: Daemon) -> None:
    ref_ids, stop, n = _reference(daemon, TOK.encode(PROMPT, add_special_tokens=True))
    ref_text = TOK.decode(ref_ids)
    expected_text = ref_text[:ref_text.find(stop)]
    body = {"prompt": PROMPT, "max_tokens": BUDGET, "temperature": 0, "ignore_eos": True, "stop": stop}

    r = _post(daemon, "/v1/completions", body)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == expected_text
    assert r["usage"]["completion_tokens"] == n < REFERENCE

    chunks = _stream(daemon, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected_text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usages) == 1 and usages[0]["completion_tokens"] == n


def test_chat_stops_early(daemon: Daemon) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    ref_ids, stop, n = _reference(daemon, TOK.apply_chat_template(messages, add_generation_prompt=True))
    ref_text = TOK.decode(ref_ids)
    expected_text = ref_text[:ref_text.find(stop)]
    body = {"messages": messages, "max_tokens": BUDGET, "temperature": 0, "ignore_eos": True, "stop": [stop]}

    r = _post(daemon, "/v1/chat/completions", body)
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": expected_text, "refusal": None}
    assert r["usage"]["completion_tokens"] == n < REFERENCE

    chunks = _stream(daemon, "/v1/chat/completions", {**body, "stream": True})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == expected_text and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert not any("usage" in c for c in chunks)  # only with stream_options.include_usage


def test_stop_strings_leave_the_daemon_serving(daemon: Daemon, tmp_path: Path) -> None:
    """Many stopped requests in a row: every abort is handled, nothing is left running."""
    prompt_ids = TOK.encode(PROMPT, add_special_tokens=True)
    _ref_ids, stop, n = _reference(daemon, prompt_ids)
    for _ in range(10):
        r = _post(daemon, "/generate", {"input_ids": prompt_ids,
                                        "sampling_params": {"max_new_tokens": BUDGET, "ignore_eos": True,
                                                            "stop": stop}})
        assert r["meta_info"]["completion_tokens"] == n
    stats = daemon.get("/health")
    assert stats["status"] == "ok"
