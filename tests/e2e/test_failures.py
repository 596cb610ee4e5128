"""End to end, failures and shared storage: real daemons, real Redis, real sockets.

Each test starts its own ``redis-server`` (when it needs one) and its own daemons, and
stops them with SIGTERM at the end (exit code 0 asserted by the ``daemons`` fixture, also
when the test fails). The correctness oracle is the model itself: greedy outputs must not
change whether a prompt's prefix came from Redis, from another daemon, or was recomputed.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

import protos
from hicache.bench.local_redis import RedisProcess
from tests.support.daemon import Daemon, DaemonFactory, alive, check_stopped_cleanly, segments_of

PAGE = 4
VOCAB = 512  # the tiny reference model's vocabulary


def _config(tmp: Path, l3: dict[str, Any], *, ipc_dir: Path | None = None, l1_tokens: int = 2048,
            l2_tokens: int = 8192) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": PAGE, "l1": {"tokens": l1_tokens}, "l2": {"tokens": l2_tokens}, "l3": l3},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "logging": {"level": "warning"},
    }
    if ipc_dir is not None:
        cfg["ipc"] = {"dir": str(ipc_dir)}
    return cfg


def _redis_l3(server: RedisProcess, prefix: str = "e2e") -> dict[str, Any]:
    # A short timeout: with Redis gone, an L3 call must not hold a request for long.
    return {"backend": "redis", "redis": {"url": server.url, "key_prefix": prefix, "timeout_s": 0.5}}


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 250) for _ in range(n)]


def _wait_for(cond: Callable[[], bool], timeout_s: float, what: str, d: Daemon) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{d.log()}")
        time.sleep(0.2)


def _wait_backed_up(server: RedisProcess, pages: int, d: Daemon, timeout_s: float = 30.0) -> None:
    """Wait until Redis holds at least ``pages`` pages and the count stopped growing, and
    the daemon has no tier op in flight (a flush skips nodes with a transfer in flight)."""
    last = [-1]

    def settled() -> bool:
        n = server.keys()
        done = n >= pages and n == last[0]
        last[0] = n
        return done

    _wait_for(settled, timeout_s, f"{pages} pages backed up to Redis (has {server.keys()})", d)
    d.wait_tiers_idle(f"{pages} pages backed up to Redis", backed_up=False, timeout_s=timeout_s)


def _metric(d: Daemon, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in ``/metrics`` (None if absent)."""
    for family in text_string_to_metric_families(d.get_text("/metrics")):
        for s in family.samples:
            if s.name == name and not s.labels:
                return float(s.value)
    return None


def _storage(body: dict[str, Any]) -> int:
    return int(body["meta_info"]["cached_tokens_details"]["storage"])


# --------------------------------------------------------------------------- Redis as L3


def test_redis_l3_round_trip_after_flush(daemons: DaemonFactory, redis_server: RedisProcess, tmp_path: Path) -> None:
    rng = random.Random(11)
    prompt = _prompt(rng, 768)
    d = daemons(_config(tmp_path, _redis_l3(redis_server)))
    first = d.generate(prompt, 6)
    _wait_backed_up(redis_server, len(prompt) // PAGE, d)
    for i in range(3):
        d.generate(_prompt(rng, 100 + i), 2)
    status, body = d.request("POST", "/cache/flush")
    assert status == 200, f"/cache/flush: {status} {body}\n{d.log()}"
    again = d.generate(prompt, 6)
    assert again["output_ids"] == first["output_ids"], f"output changed when served from Redis\n{d.log()}"
    assert _storage(again) >= 700, f"expected >= 700 tokens from storage: {again['meta_info']}\n{d.log()}"


def test_two_daemons_share_one_redis(daemons: DaemonFactory, redis_server: RedisProcess, tmp_path: Path) -> None:
    rng = random.Random(12)
    prompt = _prompt(rng, 768)
    a = daemons(_config(tmp_path / "a", _redis_l3(redis_server)), "a", start=False)
    b = daemons(_config(tmp_path / "b", _redis_l3(redis_server)), "b", start=False)
    a.launch()
    b.launch()  # both start at once: the start is most of this test's time
    a.wait_healthy()
    b.wait_healthy()
    computed = a.generate(prompt, 6)
    assert computed["meta_info"]["cached_tokens"] == 0, computed["meta_info"]
    _wait_backed_up(redis_server, len(prompt) // PAGE, a)
    served = b.generate(prompt, 6)
    assert served["output_ids"] == computed["output_ids"], f"outputs differ\nA:\n{a.log()}\nB:\n{b.log()}"
    assert _storage(served) >= 700, f"B should be served from storage: {served['meta_info']}\n{b.log()}"


def test_redis_stopped_during_traffic(daemons: DaemonFactory, redis_server: RedisProcess, tmp_path: Path) -> None:
    rng = random.Random(13)
    d = daemons(_config(tmp_path, _redis_l3(redis_server)))
    prompts = [_prompt(rng, 300) for _ in range(4)]
    expected = [d.generate(p, 6)["output_ids"] for p in prompts]
    _wait_for(lambda: _metric(d, "hicache_storage_up") == 1, 10, "hicache_storage_up 1 at start", d)

    redis_server.kill()
    d.request("POST", "/cache/flush")
    # Traffic while Redis is gone: every request succeeds, as a miss, with unchanged output.
    deadline = time.monotonic() + 30
    sent = 0
    while True:
        for p, e in zip(prompts, expected, strict=True):
            out = d.generate(p, 6)
            assert out["output_ids"] == e, f"output changed while Redis was down\n{d.log()}"
            assert _storage(out) == 0, f"a storage hit with Redis down: {out['meta_info']}"
            d.generate(_prompt(rng, 64), 2)  # new pages: backups and prefetch queries that fail
            sent += 2
        d.request("POST", "/cache/flush")
        if _metric(d, "hicache_storage_up") == 0:
            break
        assert time.monotonic() < deadline, f"hicache_storage_up still 1 after {sent} requests\n{d.log()}"

    redis_server.start()  # same port, empty
    _wait_for(lambda: _metric(d, "hicache_storage_up") == 1, 30, "hicache_storage_up back to 1", d)
    # Really back: a new prompt is backed up again and served from Redis after a flush.
    fresh = _prompt(rng, 384)
    first = d.generate(fresh, 6)
    _wait_backed_up(redis_server, len(fresh) // PAGE, d)
    d.request("POST", "/cache/flush")
    again = d.generate(fresh, 6)
    assert again["output_ids"] == first["output_ids"], d.log()
    assert _storage(again) >= 300, f"L3 not used again after Redis came back: {again['meta_info']}\n{d.log()}"


# --------------------------------------------------------------------------- bad input


def _post_raw(port: int, path: str, body: bytes, chunked: bool = False) -> tuple[int, bytes]:
    """POST ``body`` with http.client; the server may answer (413) before it read the body,
    so a failed send is tolerated as long as an answer arrives."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", path)
        conn.putheader("Content-Type", "application/json")
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
        else:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        try:
            if chunked:
                for i in range(0, len(body), 64 * 1024):
                    part = body[i:i + 64 * 1024]
                    conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                conn.send(b"0\r\n\r\n")
            else:
                conn.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _garbage_frames() -> list[list[bytes]]:
    """Frames that no endpoint accepts: not msgpack, wrong shapes, wrong version or tag,
    wrong field types, too big, and multipart messages."""
    v = protos.PROTOCOL_VERSION
    pack = msgpack.packb
    rng = random.Random(14)
    return [
        [b""],
        [b"\xc1"],  # never valid msgpack
        [bytes(rng.randrange(256) for _ in range(512))],
        [pack([1, 2, 3])],
        [pack({"v": v})],
        [pack({"v": v + 99, "t": "generate"})],
        [pack({"v": v, "t": "no-such-message"})],
        [pack({"v": v, "t": "generate", "rid": 7, "input_ids": "abc"})],
        [pack({"v": v, "t": "op_done", "op_id": "x", "status": None})],
        [pack({"v": v, "t": "write_to_host", "op_id": 1, "device_pages": [1], "host_pages": {"full": "x"}})],
        [pack({"v": v, "t": "token_output", "rid": None})],
        [pack({"v": v, "t": "ready", "process": 1, "pid": "x"})],
        [b"\x00" * (protos.MAX_FRAME_BYTES + 1)],
        [b"a", b"b", pack({"v": v, "t": "shutdown", "reason": 5})],
    ]


def _misdirected_frames(endpoint: str) -> list[bytes]:
    """Well-formed messages this endpoint does not accept, or refers to nothing it knows."""
    unknown_op = 2**40
    rid = "f" * 32
    foreign = {
        "scheduler": [protos.WriteToHost(unknown_op, {"full": [0]}, {"full": [0]}), protos.Ready("x", 1),
                      protos.OpDone(unknown_op, "ok", 3), protos.PrefetchHits(unknown_op, 9),
                      protos.AbortRequest(rid), protos.AdminRequest(rid, "no-such-op")],
        "tokenizer": [protos.GenerateRequest(rid, [1, 2]), protos.TokenOutput(rid, [1], True, "stop"),
                      protos.AdminReply(rid, True, {})],
        "controller": [protos.GenerateRequest(rid, [1, 2]), protos.Cancel(unknown_op),
                       protos.WriteToHost(unknown_op, {"full": [10**9]}, {"full": [-1]}),
                       protos.LoadToDevice(unknown_op + 1, {"nope": [0]}, {"nope": [0]}),
                       protos.BackupToStorage(unknown_op + 2, [0], ["not-a-hash"]),
                       protos.PrefetchFetch(unknown_op + 3, ["0" * 64], [10**9])],
        "launcher": [protos.GenerateRequest(rid, [1, 2]), protos.Ready("nobody", 1)],
    }
    return [protos.encode(m) for m in foreign[endpoint]]


def test_bad_input_keeps_the_daemon_serving(daemons: DaemonFactory, short_dir: Path, tmp_path: Path) -> None:
    ipc = short_dir / "ipc"
    d = daemons(_config(tmp_path, {"backend": "file", "file": {"dir": str(tmp_path / "l3")}}, ipc_dir=ipc))
    assert d.proc is not None
    pids = d.pids()
    prompt = _prompt(random.Random(15), 40)
    expected = d.generate(prompt, 8)["output_ids"]

    bad_bodies: list[tuple[str, bytes | dict[str, Any]]] = [
        ("/generate", b"{not json"),
        ("/generate", b"[1, 2, 3]"),
        ("/generate", {"input_ids": [1, 2, 3], "bogus": 1}),
        ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "bogus": 1}}),
        ("/generate", {"input_ids": [1, VOCAB]}),
        ("/generate", {"input_ids": [1, -1]}),
        ("/generate", {"input_ids": [1, 10**30]}),
        ("/generate", {"input_ids": []}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**9}}),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}),
        ("/generate", {"input_ids": [1] * 5000}),  # longer than the model's context
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
        ("/v1/completions", b"\xff\xfe garbage"),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "unknown": True}),
    ]
    for path, body in bad_bodies:
        status, answer = d.request("POST", path, body, timeout=30)
        assert status == 400, f"POST {path} {body!r:.80}: expected 400, got {status} {answer}\n{d.log()}"
        assert isinstance(answer, dict) and answer.get("error", {}).get("message"), (path, body, answer)

    garbage = os.urandom(2 * 1024 * 1024)
    for chunked in (False, True):
        status, raw = _post_raw(d.port, "/generate", garbage, chunked=chunked)
        assert status == 413, f"2 MiB body (chunked={chunked}): expected 413, got {status} {raw[:200]!r}\n{d.log()}"
    with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:  # not HTTP at all
        s.sendall(b"\x16\x03\x01\x02\x00" + os.urandom(4096) + b"\r\n\r\n")
        s.settimeout(10)
        try:
            s.recv(4096)
        except (ConnectionResetError, TimeoutError):
            pass

    endpoints = ("scheduler", "tokenizer", "controller", "launcher")
    ctx = zmq.Context()
    try:
        for name in endpoints:
            path = ipc / f"{name}.sock"
            assert path.exists(), f"no {path}: {sorted(os.listdir(ipc))}"
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 5000)
            push.connect(f"ipc://{path}")
            for frames in _garbage_frames():
                push.send_multipart(frames)
            for frame in _misdirected_frames(name):
                push.send(frame)
            push.close(linger=5000)  # returns once everything was handed over
    finally:
        ctx.term()
    time.sleep(1.5)  # let every process read what it was sent

    assert d.proc.poll() is None, f"the launcher exited with {d.proc.returncode}\n{d.log()}"
    dead = {n: p for n, p in pids.items() if not alive(p)}
    assert not dead, f"processes died after garbage frames: {dead}\n{d.log()}"
    assert d.pids() == pids, f"a process was replaced: {pids} -> {d.pids()}\n{d.log()}"
    health = d.get("/health")
    assert health["status"] == "ok", health
    assert d.generate(prompt, 8)["output_ids"] == expected, f"output changed after bad input\n{d.log()}"
    restarts = [s for f in text_string_to_metric_families(d.get_text("/metrics")) for s in f.samples
                if s.name == "hicache_process_restarts_total" and s.value > 0]
    assert not restarts, f"restarts after bad input: {restarts}\n{d.log()}"
    status, stats = d.request("GET", "/cache/stats")
    assert status == 200, stats


# --------------------------------------------------------------------------- SIGTERM


def _stream(d: Daemon, body: dict[str, Any], started: threading.Event, out: dict[str, Any]) -> None:
    """POST a streaming /v1/completions; record the status, the events and whether it ended."""
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        events: list[str] = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if line.startswith(b"data: "):
                events.append(line[6:].decode())
                started.set()
                if line == b"data: [DONE]":
                    break
        out["events"] = events
    except Exception as exc:  # recorded; the test asserts on it
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        started.set()
        conn.close()


def _plain(d: Daemon, ids: list[int], n: int, out: dict[str, Any]) -> None:
    try:
        out["status"], out["body"] = d.request(
            "POST", "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}},
            timeout=60)
    except Exception as exc:  # recorded; the test asserts on it
        out["error"] = f"{type(exc).__name__}: {exc}"


def test_sigterm_during_traffic(daemons: DaemonFactory, short_dir: Path, tmp_path: Path) -> None:
    runtime_parent = short_dir / "run"
    runtime_parent.mkdir(mode=0o700)
    cfg = _config(tmp_path, {"backend": "file", "file": {"dir": str(tmp_path / "l3")}}, l1_tokens=16384,
                  l2_tokens=32768)
    d = daemons(cfg, env={"XDG_RUNTIME_DIR": str(runtime_parent)})
    assert d.proc is not None
    runtime = [p for p in runtime_parent.iterdir() if p.name.startswith("hicache-")]
    assert len(runtime) == 1, f"expected one runtime directory, found {runtime}"
    assert sorted(p.name for p in runtime[0].glob("*.sock")) == [
        "controller.sock", "launcher.sock", "scheduler.sock", "tokenizer.sock"], sorted(os.listdir(runtime[0]))
    pids = d.pids()
    rng = random.Random(16)

    results: list[dict[str, Any]] = []
    threads: list[threading.Thread] = []
    for i in range(3):  # long generations: still running when SIGTERM arrives
        out: dict[str, Any] = {"kind": "plain"}
        results.append(out)
        threads.append(threading.Thread(target=_plain, args=(d, _prompt(rng, 200 + i), 3000, out), daemon=True))
    started = [threading.Event() for _ in range(2)]
    for ev in started:
        out = {"kind": "stream"}
        results.append(out)
        body = {"prompt": _prompt(rng, 100), "max_tokens": 3000, "stream": True, "temperature": 0,
                "ignore_eos": True}
        threads.append(threading.Thread(target=_stream, args=(d, body, ev, out), daemon=True))
    for t in threads:
        t.start()
    for ev in started:
        assert ev.wait(60), f"a stream did not start\n{d.log()}"

    def all_running() -> bool:
        _status, stats = d.request("GET", "/cache/stats")
        reqs = stats.get("requests", {}) if isinstance(stats, dict) else {}
        return reqs.get("running", 0) >= len(threads)

    deadline = time.monotonic() + 30
    while not all_running():
        assert time.monotonic() < deadline, f"requests did not all start running\n{d.log()}"
        time.sleep(0.05)

    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(90)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), f"a request got no answer (hangs)\n{d.log()}"
    check_stopped_cleanly(d, code, pids)
    for r in results:
        assert "error" not in r, f"a {r['kind']} request failed without an HTTP answer: {r['error']}\n{d.log()}"
        assert r["status"] == 200, f"{r}\n{d.log()}"
        if r["kind"] == "plain":
            meta = r["body"]["meta_info"]
            assert meta["finish_reason"] in ("length", "abort"), f"unexpected finish_reason: {r['body']}"
            # It was decoding: at least the first token (sent at once, for the TTFT) came back.
            assert meta["completion_tokens"] >= 1 and len(r["body"]["output_ids"]) == meta["completion_tokens"], meta
        else:
            assert r["events"] and r["events"][-1] == "[DONE]", f"stream did not end with [DONE]: {r['events'][-3:]}"
            last = json.loads(r["events"][-2])
            reason = last["choices"][0]["finish_reason"] if last.get("choices") else None
            assert reason in ("length", "abort") or "error" in last, f"unexpected last chunk {last}"
    left = sorted(str(p) for p in runtime_parent.rglob("*"))
    assert not left, f"runtime directory not removed: {left}"
    assert not segments_of(d.proc.pid)


@pytest.mark.parametrize("delay_s", [0.0, 0.5])
def test_sigterm_to_the_whole_process_group(daemons: DaemonFactory, tmp_path: Path, delay_s: float) -> None:
    """systemd (``KillMode=control-group``), ``timeout`` and a terminal's Ctrl-C signal every
    process of the group at once: the children start stopping on their own, with the
    launcher. That is an orderly stop (exit 0, nothing left), not a crash, and a controller
    that stopped is not restarted. ``delay_s``: the launcher gets the signal that much after
    its children (a child already gone when it looks)."""
    cfg = _config(tmp_path, {"backend": "file", "file": {"dir": str(tmp_path / "l3")}})
    d = daemons(cfg)
    assert d.proc is not None
    status, body = d.request("POST", "/generate", {"input_ids": _prompt(random.Random(3), 64),
                                                     "sampling_params": {"max_new_tokens": 4}})
    assert status == 200, body
    pids = d.pids()
    for pid in pids.values():
        os.kill(pid, signal.SIGTERM)
    time.sleep(delay_s)
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(90)
    check_stopped_cleanly(d, code, pids)
    log = d.log()
    assert "exited unexpectedly" not in log and "restarting it" not in log, log
