"""Slow clients are cut off (``server.header_timeout_s`` / ``server.body_timeout_s``), the
daemon keeps serving others meanwhile, and aiohttp's own refusals carry the JSON error object.

Raw sockets against a real tokenizer process with small timeouts; every wait is bounded
(``_closed_within``), none asserts a speed.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .fake_scheduler import FakeScheduler
from .harness import TokenizerProcess

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
BOUND_S = 15.0
"""The longest any test waits for the server to close a connection."""


@pytest.fixture(scope="module")
def slow_tp(tmp_path_factory: pytest.TempPathFactory, metrics_dir: Path) -> Iterator[TokenizerProcess]:
    tp = TokenizerProcess(tmp_path_factory.mktemp("tok-timeouts"), pids={"scheduler": os.getpid()},
                          overrides={"server.header_timeout_s": HEADER_TIMEOUT_S,
                                     "server.body_timeout_s": BODY_TIMEOUT_S})
    fake = FakeScheduler(tp.endpoints)
    tp.start()
    yield tp
    code = tp.stop()
    fake.close()
    assert code == 0, tp.log()


def _connect(tp: TokenizerProcess) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", tp.port), timeout=BOUND_S)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_until_closed(s: socket.socket, deadline: float) -> tuple[bool, bytes]:
    """Read until the server closes (True, what it sent) or ``deadline`` passes (False, ...)."""
    got = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([s], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def _trickle_until_closed(s: socket.socket, data: bytes, interval_s: float, deadline: float) -> tuple[bool, bytes]:
    """Send ``data`` one byte every ``interval_s``; stop when the server closes the
    connection (True, what it sent) or at ``deadline`` (False, ...)."""
    got = b""
    for i in range(len(data)):
        if time.monotonic() >= deadline:
            return False, got
        try:
            s.sendall(data[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return True, got
        ready, _, _ = select.select([s], [], [], interval_s)
        if ready:
            closed, more = _read_until_closed(s, deadline)
            return closed, got + more
    return False, got


def _response(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """Status, headers (lower-case names) and JSON body of one raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, json.loads(body[: int(headers["content-length"])])


def _assert_error_shape(body: dict, status: int) -> None:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status and body["error"]["message"]


def test_half_a_request_line_is_disconnected_after_the_header_timeout(slow_tp: TokenizerProcess) -> None:
    with _connect(slow_tp) as s:
        s.sendall(b"GET /v1/mod")
        closed, got = _read_until_closed(s, time.monotonic() + BOUND_S)
    assert closed and got == b""


def test_headers_trickled_past_the_header_timeout_are_cut_off(slow_tp: TokenizerProcess) -> None:
    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200 + b"\r\n\r\n"
    with _connect(slow_tp) as s:
        closed, got = _trickle_until_closed(s, request, 0.1, time.monotonic() + BOUND_S)
    assert closed and got == b""  # 0.1 s a byte: 20+ s for the whole request; cut off before it


def test_a_body_trickled_past_the_body_timeout_is_cut_off(slow_tp: TokenizerProcess) -> None:
    body = json.dumps({"text": "x" * 200}).encode()
    head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with _connect(slow_tp) as s:
        s.sendall(head)
        closed, got = _trickle_until_closed(s, body, 0.1, time.monotonic() + BOUND_S)
    assert closed
    if got:  # the 408 may be lost to the reset that closing on unread bytes sends
        status, headers, answer = _response(got)
        assert status == 408 and headers["content-type"].startswith("application/json")
        _assert_error_shape(answer, 408)


def test_the_daemon_serves_others_while_slow_clients_hang(slow_tp: TokenizerProcess) -> None:
    stalled = [_connect(slow_tp) for _ in range(20)]
    try:
        for i, s in enumerate(stalled):
            s.sendall(b"POST /generate HTTP/1.1\r\nContent-Length: 10\r\n\r\n1" if i % 2 else b"GET /he")
        r = slow_tp.get("/v1/models")
        assert r.status == 200 and r.json()["object"] == "list"
        deadline = time.monotonic() + BOUND_S
        assert all(_read_until_closed(s, deadline)[0] for s in stalled)
    finally:
        for s in stalled:
            s.close()
    assert slow_tp.get("/v1/models").status == 200


def test_a_keep_alive_connection_serves_requests_within_the_header_timeout(slow_tp: TokenizerProcess) -> None:
    conn = slow_tp.conn()
    try:
        for _ in range(3):
            conn.request("GET", "/v1/models")
            resp = conn.getresponse()
            assert resp.status == 200
            resp.read()
    finally:
        conn.close()


def test_unknown_route_is_a_json_404(slow_tp: TokenizerProcess) -> None:
    r = slow_tp.get("/no/such/route")
    assert r.status == 404 and r.headers["content-type"].startswith("application/json")
    _assert_error_shape(r.json(), 404)
    assert "/no/such/route" in r.json()["error"]["message"]


def test_wrong_method_is_a_json_405_with_allow(slow_tp: TokenizerProcess) -> None:
    r = slow_tp.request("DELETE", "/v1/models")
    assert r.status == 405 and r.headers["content-type"].startswith("application/json")
    _assert_error_shape(r.json(), 405)
    assert "GET" in r.headers["allow"]


def test_a_request_line_that_does_not_parse_is_a_json_400(slow_tp: TokenizerProcess) -> None:
    with _connect(slow_tp) as s:
        s.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
        closed, got = _read_until_closed(s, time.monotonic() + BOUND_S)
    assert closed and got
    status, headers, body = _response(got)
    assert status == 400 and headers["content-type"].startswith("application/json")
    _assert_error_shape(body, 400)
    assert body["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_is_a_json_413(slow_tp: TokenizerProcess) -> None:
    r = slow_tp.post("/cache/flush", raw=b"{" + b" " * (2 * 1024 * 1024) + b"}")
    assert r.status == 413
    _assert_error_shape(r.json(), 413)


def test_fake_scheduler_still_answers(slow_tp: TokenizerProcess) -> None:
    """The slow clients above left the generation path working."""
    r = slow_tp.post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    assert r.status == 200, r.body

