"""A stand-in scheduler for the tokenizer tests: a thread speaking protos over the real sockets.

It binds the scheduler's PULL address and pushes to the tokenizer's, like the real one.
Behaviour, chosen by markers in the prompt text (prompts are byte-level token ids):

- every request generates ``OUTPUT`` (cycled) as byte ids, up to ``max_new_tokens``;
  a token in ``stop_token_ids`` ends it early (``stop``, the token included), else
  ``length``;
- streaming requests get one ``TokenOutput`` per token, every ``TICK_S`` (``[slow]`` in
  the prompt: every ``SLOW_TICK_S``); others get the first token, then the rest with the
  final message;
- ``[fail]``: a finished output with ``finish_reason "error"``; ``[errorreply]``: an
  ``ErrorReply`` naming the rid; ``[silent]``: no answer at all (until aborted);
- the final ``Usage``: ``prompt_tokens`` = prompt length, cached tokens device = n // 2,
  host = n // 4, storage = n // 8 (see ``expected_cached``).

Admin ops answer canned results; ``storage_detach`` answers "busy" while ``busy`` is set;
``admin_mode`` "silent" answers no admin op, "errorreply" answers each with an ``ErrorReply``.
Everything received is kept in ``received``; aborted rids in ``aborts``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import zmq

import protos
from hicache.runtime.ipc import Endpoints, PullSocket, PushSocket

OUTPUT = "The quick brown fox jumps over the lazy dog. "
TICK_S = 0.002
SLOW_TICK_S = 0.1


def expected_cached(prompt_len: int) -> tuple[int, int, int]:
    return prompt_len // 2, prompt_len // 4, prompt_len // 8


def prompt_text(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", "replace")


@dataclass
class _Active:
    req: protos.GenerateRequest
    tokens: list[int]
    finish: str
    tick: float
    pos: int = 0
    due: float = 0.0
    usage: protos.Usage = field(default_factory=protos.Usage)


class FakeScheduler:
    def __init__(self, endpoints: Endpoints) -> None:
        self.ctx = zmq.Context()
        self.pull: PullSocket[protos.Message] = PullSocket(
            self.ctx, endpoints.address("scheduler"), (protos.GenerateRequest, protos.AbortRequest, protos.AdminRequest))
        self.push: PushSocket[protos.Message] = PushSocket(self.ctx, endpoints.address("tokenizer"))
        self.received: list[protos.Message] = []
        self.aborts: set[str] = set()
        self.busy = False
        self.admin_mode = "normal"
        self._active: dict[str, _Active] = {}
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self._thread = threading.Thread(target=self._run, name="fake-scheduler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.push.close()
        self.ctx.term()

    def generate_requests(self) -> list[protos.GenerateRequest]:
        with self._lock:
            return [m for m in self.received if isinstance(m, protos.GenerateRequest)]

    def wait_for(self, predicate, timeout_s: float = 10.0) -> bool:  # noqa: ANN001 - a test helper
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(self):
                    return True
            time.sleep(0.01)
        return False

    # ---- the loop

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    msg = self.pull.recv(timeout_ms=1)
                except protos.ProtocolError:
                    continue
                if msg is not None:
                    with self._lock:
                        self.received.append(msg)
                    self._handle(msg)
                self._step()
        finally:
            self.pull.close()

    def _handle(self, msg: protos.Message) -> None:
        if isinstance(msg, protos.GenerateRequest):
            self._start(msg)
        elif isinstance(msg, protos.AbortRequest):
            with self._lock:
                self.aborts.add(msg.rid)
            self._active.pop(msg.rid, None)
        elif isinstance(msg, protos.AdminRequest):
            self._admin(msg)

    def _start(self, req: protos.GenerateRequest) -> None:
        text = prompt_text(req.input_ids)
        n = len(req.input_ids)
        if "[fail]" in text:
            self.push.send(protos.TokenOutput(req.rid, [], True, "error", None, "the model exploded"))
            return
        if "[errorreply]" in text:
            self.push.send(protos.ErrorReply("cannot schedule this request", req.rid))
            return
        if "[silent]" in text:
            return
        tokens: list[int] = []
        finish = "length"
        out = OUTPUT.encode()
        for i in range(req.sampling.max_new_tokens):
            t = out[i % len(out)]
            tokens.append(t)
            if t in req.sampling.stop_token_ids:
                finish = "stop"
                break
        d, h, s = expected_cached(n)
        usage = protos.Usage(n, len(tokens), d, h, s)
        tick = SLOW_TICK_S if "[slow]" in text else TICK_S
        self._active[req.rid] = _Active(req, tokens, finish, tick, due=time.monotonic(), usage=usage)

    def _step(self) -> None:
        now = time.monotonic()
        for rid, a in list(self._active.items()):
            if a.due > now:
                continue
            if not a.req.stream and a.pos > 0:  # the rest at once
                chunk = a.tokens[a.pos:]
            else:
                chunk = a.tokens[a.pos:a.pos + 1]
            a.pos += len(chunk)
            done = a.pos >= len(a.tokens)
            self.push.send(protos.TokenOutput(rid, chunk, done, a.finish if done else None,
                                              a.usage if done else None))
            if done:
                del self._active[rid]
            else:
                a.due = now + a.tick

    def _admin(self, msg: protos.AdminRequest) -> None:
        results = {
            "stats": {"device": {"full": {"used": 10, "capacity": 100, "hit_tokens": 5}}},
            "flush": {"flushed": True},
            "storage_status": {"backend": "file", "up": True},
            "storage_attach": {"attached": True, "args": msg.args},
            "storage_detach": {"detached": True},
            "storage_clear": {"cleared": 42},
            "pins": {"pinned": []}, "pin": {"pinned": True}, "unpin": {"unpinned": True},
        }
        if self.admin_mode == "silent":
            return
        if self.admin_mode == "errorreply":
            self.push.send(protos.ErrorReply("admin exploded", msg.rid))
        elif msg.op == "storage_detach" and self.busy:
            self.push.send(protos.AdminReply(msg.rid, False, {}, "storage is busy: 2 operations in flight"))
        elif msg.op in results:
            self.push.send(protos.AdminReply(msg.rid, True, {**results[msg.op], "args": msg.args}))
        else:
            self.push.send(protos.AdminReply(msg.rid, False, {}, f"unknown op {msg.op!r}"))
