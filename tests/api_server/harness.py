"""Start a real tokenizer process (spawn) on a free loopback port and talk HTTP to it."""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

import protos
from hicache.api_server import TokenizerArgs, tokenizer_main
from hicache.bench.loopback_ports import free_port
from hicache.config import HicacheConfig, config_from_dict
from hicache.runtime.ipc import Endpoints, PullSocket, make_runtime_dir


def _run_with_log(args: TokenizerArgs, log_path: str) -> None:
    """Spawn target: the tokenizer with its stderr (the log) in a file the test can read."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    tokenizer_main(args)


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class TokenizerProcess:
    """The process, its endpoints, its log file, and a small HTTP client."""

    def __init__(self, tmp: Path, overrides: dict[str, Any] | None = None, pids: dict[str, int] | None = None,
                 grace_s: float = 5.0, admin_timeout_s: float = 10.0, hold_port: bool = False) -> None:
        raw: dict[str, Any] = {"server": {"port": free_port()}, "logging": {"level": "info"},
                               "model": {"reference": {"preset": "tiny", "max_context": 512}},
                               "scheduler": {"max_new_tokens_limit": 256, "default_max_new_tokens": 16}}
        for key, value in (overrides or {}).items():
            section, _, name = key.partition(".")
            raw.setdefault(section, {})[name] = value
        self.config: HicacheConfig = config_from_dict(raw)
        self.port = self.config.server.port
        self.endpoints = Endpoints("ipc", str(make_runtime_dir(str(tmp))))
        self.log_path = tmp / f"tokenizer-{self.port}.log"
        self.ctx = zmq.Context()
        self.ready: PullSocket[protos.Message] = PullSocket(self.ctx, self.endpoints.address("launcher"), (protos.Ready,))
        self.args = TokenizerArgs(self.config, self.endpoints, self.endpoints.address("launcher"),
                                  dict(pids or {}), grace_s=grace_s, admin_timeout_s=admin_timeout_s,
                                  hold_port=hold_port)
        self.proc: mp.process.BaseProcess | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        self.spawn()
        self.wait_ready(timeout_s)

    def spawn(self) -> None:
        self.proc = mp.get_context("spawn").Process(target=_run_with_log, args=(self.args, str(self.log_path)),
                                                    daemon=True)
        self.proc.start()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        msg = None
        while msg is None and self.proc.is_alive() and time.monotonic() < deadline:
            msg = self.ready.recv(200)
        if not (isinstance(msg, protos.Ready) and msg.process == "tokenizer" and msg.pid == self.proc.pid):
            raise RuntimeError(f"the tokenizer did not report ready: {msg!r}\n{self.log()}")

    def push(self, msg: protos.Message) -> None:
        """Send ``msg`` to the process's own address, as the launcher does."""
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(self.endpoints.address("tokenizer"))
        push.send(protos.encode(msg))
        push.close(linger=2000)
        ctx.term()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait, return the exit code (None if it did not exit; it is then killed)."""
        if self.proc is None:
            return None
        if self.proc.exitcode is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        self.proc.join(timeout_s)
        code = self.proc.exitcode
        if code is None:
            self.proc.kill()
            self.proc.join(5)
        self.ready.close()
        self.ctx.term()
        return code

    # ---- HTTP

    def conn(self, timeout_s: float = 20.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None) -> Response:
        conn = self.conn()
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def post(self, path: str, body: Any = None, **kw: Any) -> Response:
        return self.request("POST", path, body, **kw)

    def get(self, path: str, **kw: Any) -> Response:
        return self.request("GET", path, **kw)

    def stream(self, path: str, body: Any, headers: dict[str, str] | None = None) -> list[Any]:
        """POST a streaming request; the parsed ``data:`` events (``"[DONE]"`` kept as a string)."""
        resp = self.post(path, body, headers=headers)
        assert resp.status == 200, (resp.status, resp.body)
        assert resp.headers["content-type"].startswith("text/event-stream")
        return parse_sse(resp.body)


def parse_sse(body: bytes) -> list[Any]:
    events = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
