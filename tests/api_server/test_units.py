"""In-process tests of the pieces: text streaming, validation, response shapes, metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import protos
from hicache.api_server.formats import (
    ChatFormat,
    CompletionFormat,
    GenerateFormat,
    GenerationResult,
    Step,
    sse,
)
from hicache.api_server.textstream import OutputText
from hicache.api_server.validation import (
    ModelLimits,
    RequestError,
    parse_completion,
    parse_generate,
    parse_json,
    parse_storage_choice,
)
from hicache.config import ConfigError, config_from_dict
from hicache.metrics import MULTIPROC_ENV, Metrics, TokenCounts, prepare_multiprocess_dir
from hicache.text import ByteTokenizer

TOK = ByteTokenizer()
LIMITS = ModelLimits("m", vocab_size=512, max_context=64, max_new_tokens_limit=32, default_max_new_tokens=8)

# --------------------------------------------------------------------------- OutputText


def _push_all(out: OutputText, ids: list[int], step: int = 1) -> tuple[str, bool]:
    text = ""
    for i in range(0, len(ids), step):
        piece, stopped = out.push(ids[i:i + step])
        text += piece
        if stopped:
            return text, True
    return text + out.finish(), False


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_string_split_across_tokens(step: int) -> None:
    ids = list(b"hello wor") + list(b"ld and more")
    out = OutputText(TOK, stop=["world"])
    text, stopped = _push_all(out, ids, step)
    assert (text, stopped) == ("hello ", True)
    assert out.text == "hello "


def test_held_back_text_is_never_part_of_a_stop_string() -> None:
    out = OutputText(TOK, stop=["abc"])
    emitted = []
    for ch in "xxab":
        emitted.append(out.push([ord(ch)])[0])
    assert "".join(emitted) == "xx"  # "ab" could start "abc"
    assert out.push([ord("d")]) == ("abd", False)  # no longer a possible start
    assert out.push([ord("a")]) == ("", False)
    assert out.finish() == "a"


def test_earliest_stop_string_wins() -> None:
    out = OutputText(TOK, stop=["cd", "b"])
    assert _push_all(out, list(b"abcd")) == ("a", True)


def test_multibyte_characters_are_emitted_whole() -> None:
    out = OutputText(TOK)
    pieces = [out.push([b])[0] for b in "é€".encode()]
    assert pieces == ["", "é", "", "", "€"]


def test_non_incremental_decodes_once_and_skips_special_tokens() -> None:
    out = OutputText(TOK, incremental=False)
    assert out.push([104, 105, 257]) == ("", False)
    assert out.finish() == "hi"


# --------------------------------------------------------------------------- validation


def test_parse_json_rejects_constants_and_deep_nesting() -> None:
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json(b'{"a": Infinity}')
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json(b"[" * 100_000)
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_json(b"\xff\xfe")


def test_parse_generate_builds_the_message() -> None:
    req = parse_generate({"input_ids": [1, 2], "stream": True, "sampling_params": {"stop": "x"}}, "rid1", TOK, LIMITS)
    msg = req.to_message()
    assert msg == protos.GenerateRequest("rid1", [1, 2], protos.SamplingParams(max_new_tokens=8), True, "")
    assert req.stop == ("x",)
    assert protos.decode(protos.encode(msg)) == msg


def test_parse_generate_checks_salt_length() -> None:
    with pytest.raises(RequestError, match="cache_salt must be at most"):
        parse_generate({"input_ids": [1], "cache_salt": "s" * 1000}, "r", TOK, LIMITS)


def test_storage_is_chosen_by_a_name_the_config_gives() -> None:
    """``PUT /cache/storage`` names a store of the config; a body naming a backend, a URL, a
    directory or a password source is refused, whatever it holds."""
    cfg = config_from_dict({"cache": {"l3": {"file": {"dir": "/tmp/a"}},
                                      "l3_stores": {"backup": {"backend": "file", "file": {"dir": "/tmp/b"}}}}})
    assert parse_storage_choice({"store": "backup"}, cfg)["l3"]["file"]["dir"] == "/tmp/b"
    assert parse_storage_choice({"store": "default"}, cfg)["l3"]["file"]["dir"] == "/tmp/a"
    for body in ({"backend": "file", "file": {"dir": "/tmp/x"}}, {"store": "backup", "file": {"dir": "/x"}},
                 {"backend": "redis", "redis": {"url": "redis://evil:6379", "password_env": "HOME"}},
                 {"store": "nope"}, {"store": 3}, {}):
        with pytest.raises(RequestError) as exc:
            parse_storage_choice(body, cfg)
        assert exc.value.status == 400 and "(default, backup)" in exc.value.message, exc.value.message
    no_l3 = config_from_dict({"cache": {"l3": {"backend": "none"}}})
    with pytest.raises(RequestError, match="cache.l3_stores is empty"):
        parse_storage_choice({"store": "default"}, no_l3)
    no_l2 = config_from_dict({"cache": {"l2": {"enabled": False}, "l3": {"backend": "none"}}})
    with pytest.raises(RequestError) as exc:
        parse_storage_choice({"store": "default"}, no_l2)
    assert exc.value.status == 409


def test_named_stores_are_checked_with_the_config() -> None:
    """``cache.l3_stores`` entries are checked as ``cache.l3`` is, and against the tenants' L3 quotas."""
    keys = {"api_keys": [{"tenant": "a", "key": "k" * 32, "quota": {"l3_gb": 1}}]}
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"cache": {"l3": {"file": {"max_size_gb": 2}}, "l3_stores": {
            "r": {"backend": "redis"}, "small": {"backend": "file", "file": {"max_size_gb": 1}},
            "default": {"backend": "file"}, "empty": {"backend": "file", "file": {"dir": ""}},
            "none": {"backend": "none"}}}, "server": keys})
    problems = {p.path: p.reason for p in exc.value.problems}
    assert "blind to tenants" in problems["cache.l3_stores.r"]
    assert "they reserve L3" in problems["cache.l3_stores.small"]
    assert "not 'default'" in problems["cache.l3_stores.default"]
    assert problems["cache.l3_stores.empty.file.dir"] == "must not be empty"
    assert "DELETE" in problems["cache.l3_stores.none.backend"]
    ok = config_from_dict({"cache": {"l3": {"file": {"max_size_gb": 2}},
                                     "l3_stores": {"big": {"backend": "file", "file": {"max_size_gb": 3}}}},
                           "server": keys})
    assert ok.cache.l3_stores["big"].file.max_size_gb == 3


# --------------------------------------------------------------------------- formats


USAGE = protos.Usage(prompt_tokens=10, completion_tokens=3, cached_device=4, cached_host=2, cached_storage=1)


def test_usage_in_every_shape() -> None:
    result = [GenerationResult("r", "abc", [97, 98, 99], "length", USAGE)]
    details = {"device": 4, "host": 2, "storage": 1}
    gen = GenerateFormat("r", "m").full(result)
    assert gen["meta_info"]["cached_tokens"] == 7 and gen["meta_info"]["cached_tokens_details"] == details
    for fmt in (CompletionFormat("r", "m"), ChatFormat("r", "m")):
        usage = fmt.full(result)["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 7}
        assert usage["cached_tokens_details"] == details
        assert usage["total_tokens"] == 13


def test_include_usage_adds_a_usage_only_chunk() -> None:
    fmt = CompletionFormat("r", "m", include_usage=True)
    assert len(fmt.chunks(Step("a", [97]))) == 1
    last = fmt.chunks(Step("", [], "stop", USAGE))
    assert len(last) == 1 and last[0]["usage"] is None and last[0]["choices"][0]["finish_reason"] == "stop"
    tail = fmt.tail(USAGE)
    assert [c["choices"] for c in tail] == [[]] and tail[0]["usage"]["completion_tokens"] == 3


def test_sse_framing() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()


# --------------------------------------------------------------------------- metrics


def _metrics() -> tuple[Metrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return Metrics(registry), registry


def test_request_tracker_records_outcome_latencies_and_tokens() -> None:
    m, reg = _metrics()
    with m.track_request() as t:
        t.tokens(1)
        t.tokens(3)
        t.finish("ok", TokenCounts(prompt=10, completion=4, device=5, host=2, storage=1))
    assert reg.get_sample_value("hicache_requests_total", {"status": "ok"}) == 1
    assert reg.get_sample_value("hicache_ttft_seconds_count") == 1
    assert reg.get_sample_value("hicache_inter_token_latency_seconds_count") == 3
    assert reg.get_sample_value("hicache_e2e_latency_seconds_count") == 1
    assert reg.get_sample_value("hicache_prompt_tokens_total") == 10
    assert reg.get_sample_value("hicache_generation_tokens_total") == 4
    assert reg.get_sample_value("hicache_cached_tokens_total", {"tier": "host"}) == 2


def test_request_tracker_status_from_exceptions() -> None:
    m, reg = _metrics()
    for exc in (asyncio.CancelledError(), ConnectionResetError(), ValueError()):
        with pytest.raises(type(exc)), m.track_request():
            raise exc
    assert reg.get_sample_value("hicache_requests_total", {"status": "aborted"}) == 2
    assert reg.get_sample_value("hicache_requests_total", {"status": "error"}) == 1
    assert reg.get_sample_value("hicache_e2e_latency_seconds_count") == 0


def test_transfer_and_storage_wrappers() -> None:
    m, reg = _metrics()
    with m.transfer("d2h", 100):
        pass
    with pytest.raises(OSError), m.transfer("d2h", 50):
        raise OSError("copy failed")
    assert reg.get_sample_value("hicache_transfer_bytes_total", {"direction": "d2h"}) == 100
    assert reg.get_sample_value("hicache_transfer_seconds_count", {"direction": "d2h"}) == 1
    with m.transfer("s2h") as t:  # a size known only at the end
        t.nbytes = 30
    m.transfer_bytes("s2h", 12)
    assert reg.get_sample_value("hicache_transfer_bytes_total", {"direction": "s2h"}) == 42
    assert reg.get_sample_value("hicache_transfer_seconds_count", {"direction": "s2h"}) == 1
    with pytest.raises(TimeoutError), m.storage_op("get"):
        raise TimeoutError
    assert reg.get_sample_value("hicache_storage_errors_total", {"op": "get"}) == 1
    with pytest.raises(ValueError, match="direction"):
        with m.transfer("sideways", 1):
            pass
    with pytest.raises(ValueError, match="tier"):
        m.evicted("L1", 5)


def test_backup_failures_are_counted_by_outcome() -> None:
    m, reg = _metrics()
    m.backup_failures(3, 0)
    m.backup_failures(1, 1)
    m.backup_failures(0, 0)
    assert reg.get_sample_value("hicache_backup_failures_total", {"outcome": "retried"}) == 4
    assert reg.get_sample_value("hicache_backup_failures_total", {"outcome": "abandoned"}) == 1


def test_disabled_metrics_are_a_no_op() -> None:
    m = Metrics(None)
    assert not m.enabled
    with m.track_request() as t, m.transfer("h2d", 10), m.storage_op("set"):
        t.tokens(2)
        t.finish("ok", TokenCounts(1, 2))
    m.set_pool("device", "full", 1, 2)
    m.set_storage_up(False)
    m.process_restarted("controller")


def test_prepare_multiprocess_dir_wipes_stale_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MULTIPROC_ENV, "")
    d = tmp_path / "prom"
    d.mkdir()
    (d / "counter_123.db").write_bytes(b"stale")
    assert prepare_multiprocess_dir(d) == d
    assert list(d.iterdir()) == []
    import os

    assert os.environ[MULTIPROC_ENV] == str(d)


def _late_multiprocess_child(path: str) -> None:
    """Spawn target: prometheus-client imported before the directory is exported (as a launcher may)."""
    import prometheus_client  # noqa: F401

    from hicache.config import MetricsConfig
    from hicache.metrics import init_process_metrics

    prepare_multiprocess_dir(path)
    init_process_metrics(MetricsConfig(), "launcher").process_restarted("controller")


def test_late_multiprocess_dir_still_shared(tmp_path: Path) -> None:
    import multiprocessing as mp

    from prometheus_client import multiprocess

    d = tmp_path / "late"
    p = mp.get_context("spawn").Process(target=_late_multiprocess_child, args=(str(d),))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, str(d))
    assert registry.get_sample_value("hicache_process_restarts_total", {"process": "controller"}) == 1


def test_the_tokenizer_process_does_not_import_torch() -> None:
    """Importing torch costs the tokenizer about a second at start and ~300 MiB; nothing it
    does needs it (sampling parameters are checked by ``hicache.model.sampling_params``)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import hicache.api_server.process, hicache.api_server.http_api, hicache.api_server.scheduler_link\n"
            "import hicache.api_server.validation, hicache.text, hicache.metrics\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout[:300]


def test_n_is_bounded_by_server_max_samples() -> None:
    import dataclasses

    limits = dataclasses.replace(LIMITS, max_samples=2)
    req = parse_completion({"prompt": "hi", "n": 2, "seed": 5}, "r", ByteTokenizer(), limits)
    assert [s.sampling.seed for s in req.samples()] == [5, 6] and [s.rid for s in req.samples()] == ["r-0", "r-1"]
    with pytest.raises(RequestError) as exc:
        parse_completion({"prompt": "hi", "n": 3}, "r", ByteTokenizer(), limits)
    assert exc.value.param == "n" and "server.max_samples" in exc.value.message
