"""Tokenizer processes of their own: API key, metrics off, start-up failure, SIGTERM under load."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import protos

from .fake_scheduler import FakeScheduler
from .harness import Response, TokenizerProcess, parse_sse


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_api_key_metrics_disabled_and_degraded_health(tmp_path: Path) -> None:
    tp = TokenizerProcess(tmp_path, {"server.api_key": "s3cret", "metrics.enabled": False},
                          pids={"scheduler": _dead_pid()})
    fake = FakeScheduler(tp.endpoints)
    try:
        tp.start()
        for method, path in (("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/cache/stats"),
                             ("POST", "/v1/chat/completions"), ("PUT", "/cache/storage")):
            r = tp.request(method, path, {"text": "hi"})
            assert r.status == 401, (path, r.status)
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"] == "Bearer"
        wrong = tp.post("/generate", {"text": "hi"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401
        ok = tp.post("/generate", {"text": "hi"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status == 200, ok.body
        assert tp.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status == 200
        # the open route
        health = tp.get("/health")
        assert health.status == 503
        assert health.json()["status"] == "degraded" and health.json()["dead"] == ["scheduler"]
        # /metrics needs the key (server.api_key's holder is the operator)
        assert tp.get("/metrics").status == 401
        metrics = tp.get("/metrics", headers={"Authorization": "Bearer s3cret"})
        assert metrics.status == 404 and b"disabled" in metrics.body
    finally:
        code = tp.stop()
        fake.close()
    assert code == 0, tp.log()


def test_startup_failure_exits_nonzero(tmp_path: Path) -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    tp = TokenizerProcess(tmp_path, {"server.port": blocker.getsockname()[1]})
    try:
        with pytest.raises(RuntimeError, match="did not report ready"):
            tp.start(timeout_s=20)
        assert tp.proc is not None
        tp.proc.join(10)
        assert tp.proc.exitcode == 1
        assert "cannot listen" in tp.log()
    finally:
        tp.stop()
        blocker.close()


def test_sigterm_drains_then_aborts_and_exits_zero(tmp_path: Path) -> None:
    tp = TokenizerProcess(tmp_path, grace_s=1.5)
    fake = FakeScheduler(tp.endpoints)
    results: dict[str, Response | BaseException] = {}

    def run(name: str, text: str, n: int) -> None:
        try:
            results[name] = tp.post("/generate", {"text": text, "stream": True,
                                                  "sampling_params": {"max_new_tokens": n}})
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            results[name] = exc

    try:
        tp.start()
        threads = [threading.Thread(target=run, args=("short", "[slow] short", 4)),
                   threading.Thread(target=run, args=("long", "[slow] long", 200))]
        for t in threads:
            t.start()
        assert fake.wait_for(lambda f: len(f.generate_requests()) == 2)
        time.sleep(0.15)
        start = time.monotonic()
        os.kill(tp.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(ConnectionRefusedError):  # no longer listening
            socket.create_connection(("127.0.0.1", tp.port), timeout=2).close()
        tp.proc.join(20)
        elapsed = time.monotonic() - start
        for t in threads:
            t.join(10)
        assert tp.proc.exitcode == 0, tp.log()
        assert elapsed < 10
        short, long_ = results["short"], results["long"]
        assert isinstance(short, Response) and isinstance(long_, Response), results
        short_events, long_events = parse_sse(short.body), parse_sse(long_.body)
        assert short_events[-1] == long_events[-1] == "[DONE]"
        assert short_events[-2]["meta_info"]["finish_reason"] == "length"  # finished within the grace period
        assert long_events[-2]["meta_info"]["finish_reason"] == "abort"  # cut off after it
        long_rid = long_events[0]["meta_info"]["id"]
        assert fake.wait_for(lambda f: long_rid in f.aborts)
        assert "aborted 1 request(s)" in tp.log()
    finally:
        tp.stop()
        fake.close()


def test_shutdown_message_from_the_launcher(tmp_path: Path) -> None:

    tp = TokenizerProcess(tmp_path)
    fake = FakeScheduler(tp.endpoints)
    try:
        tp.start()
        tp.push(protos.Shutdown("test"))
        tp.proc.join(20)
        assert tp.proc.exitcode == 0, tp.log()
    finally:
        tp.stop()
        fake.close()


def _held_until_bound(tp: TokenizerProcess) -> None:
    """Spawn a ``hold_port`` tokenizer and wait until its ZeroMQ address is bound (what it does
    just before it waits for the launcher)."""
    tp.spawn()
    sock = Path(tp.endpoints.address("tokenizer").removeprefix("ipc://"))
    deadline = time.monotonic() + 60
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sock.exists(), tp.log()


def test_a_held_tokenizer_opens_its_port_only_once_the_scheduler_is_ready(tmp_path: Path) -> None:

    tp = TokenizerProcess(tmp_path, pids={"scheduler": os.getpid()}, hold_port=True)
    fake = FakeScheduler(tp.endpoints)
    try:
        _held_until_bound(tp)
        assert tp.ready.recv(1500) is None  # no Ready: it holds
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", tp.port), timeout=2).close()
        tp.push(protos.Ready("scheduler", os.getpid()))
        tp.wait_ready(30)
        assert tp.get("/health").status in (200, 503)  # it answers (the fake's health is its own business)
    finally:
        assert tp.stop() == 0
        fake.close()


def test_a_held_tokenizer_stopped_before_the_scheduler_is_ready_exits_zero(tmp_path: Path) -> None:
    tp = TokenizerProcess(tmp_path, hold_port=True)
    _held_until_bound(tp)
    assert tp.stop() == 0
    assert "stopped before the scheduler was ready" in tp.log()
