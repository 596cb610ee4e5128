"""The soak's traffic: one client thread's mix of requests, each checked as it returns.

Request kinds (``Kind``) and what counts as correct:

=============  ===============================================  ==============================
kind           what is sent                                     correct when
=============  ===============================================  ==============================
turn           the next turn of this client's conversation      200 and the reference's ids
               (history + a new question), greedy
shared         one of a few system prompts + a new question     200 and the reference's ids
sampled        a shared prompt, temperature 0.8, a seed         200 and the reference's ids
stream         a conversation turn, streamed (SSE)              every chunk arrives, ``[DONE]``,
                                                                the ids = the reference's
abort          a streamed request closed after its first chunk  the first chunk arrives
disconnect     a request whose connection closes at once         (nothing to read)
bad            an invalid body (NaN, unknown field, ...)        400 with a JSON error
=============  ===============================================  ==============================

The reference (``Reference``) is a second daemon with L1 only, flushed before every request
it serves (one at a time), so its outputs are cold computations; outputs are compared as
token ids. A request of the first four kinds that does not answer correctly is a failure
(``Outcome.FAILED`` for an error, ``Outcome.MISMATCH`` for other ids).
"""

from __future__ import annotations

import enum
import http.client
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

QUESTION_TOKENS = 12
SYSTEM_PROMPT_TOKENS = 160
TURNS_PER_CONVERSATION = 6
MAX_NEW_TOKENS = 12
REQUEST_TIMEOUT_S = 120.0

BAD_BODIES: tuple[bytes, ...] = (
    b'{"input_ids": [1, 2, 3], "sampling_params": {"temperature": NaN}}',
    b'{"input_ids": [1, 2, 3], "colour": "blue"}',
    b'{"input_ids": [1, 2, 999999]}',
    b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": -5}}',
    b'{"input_ids": [1, 2, 3], "sampling_params": {"top_p": 0}}',
    b'{"text": "\\ud800"}',
    b'{"input_ids": ',
    b'[1, 2, 3]',
)


class Kind(enum.Enum):
    TURN = "turn"
    SHARED = "shared"
    SAMPLED = "sampled"
    STREAM = "stream"
    ABORT = "abort"
    DISCONNECT = "disconnect"
    BAD = "bad"


WEIGHTS: dict[Kind, int] = {Kind.TURN: 30, Kind.SHARED: 20, Kind.SAMPLED: 10, Kind.STREAM: 20, Kind.ABORT: 6,
                            Kind.DISCONNECT: 6, Kind.BAD: 8}
CHECKED = frozenset({Kind.TURN, Kind.SHARED, Kind.SAMPLED, Kind.STREAM})
"""The kinds whose output is compared with the reference."""


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    MISMATCH = "mismatch"


@dataclass
class Tally:
    """Counts shared by every client thread (under ``lock``) and the first failures' details."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0

    def record(self, kind: Kind, outcome: Outcome, detail: dict[str, Any] | None = None) -> None:
        with self.lock:
            self.counts[(kind.value, outcome.value)] += 1
            if outcome is not Outcome.OK and len(self.failures) < 50:
                self.failures.append({"kind": kind.value, "outcome": outcome.value, "t": time.time(),
                                      **(detail or {})})

    def total(self, outcome: Outcome | None = None) -> int:
        with self.lock:
            return sum(n for (_k, o), n in self.counts.items() if outcome is None or o == outcome.value)


def post(port: int, path: str, body: bytes, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
    """One POST on a fresh connection: (status, parsed JSON or the raw text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw.decode(errors="replace")


def _body(ids: list[int], temperature: float = 0.0, seed: int | None = None, stream: bool = False) -> bytes:
    sampling: dict[str, Any] = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": temperature}
    if seed is not None:
        sampling["seed"] = seed
    return json.dumps({"input_ids": ids, "sampling_params": sampling, "stream": stream}).encode()


class Reference:
    """Cold outputs from the reference daemon, memoised by request (thread-safe)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._lock = threading.Lock()
        self._memo: dict[tuple[tuple[int, ...], float, int | None], list[int]] = {}
        self.computed = 0

    def ids(self, ids: list[int], temperature: float = 0.0, seed: int | None = None) -> list[int]:
        key = (tuple(ids), temperature, seed)
        with self._lock:
            cached = self._memo.get(key)
            if cached is not None:
                return cached
            status, body = post(self.port, "/cache/flush", b"")
            if status != 200:
                raise RuntimeError(f"the reference daemon did not flush: {status} {body}")
            status, body = post(self.port, "/generate", _body(ids, temperature, seed))
            if status != 200:
                raise RuntimeError(f"the reference daemon failed: {status} {body}")
            self._memo[key] = out = list(body["output_ids"])
            self.computed += 1
            return out


class Client:
    """One client thread's traffic: ``run_once`` sends one request of a random kind."""

    def __init__(self, index: int, port: int, reference: Reference, tally: Tally, system_prompts: list[list[int]],
                 vocab: int, seed: int) -> None:
        self.index = index
        self.port = port
        self.reference = reference
        self.tally = tally
        self.system_prompts = system_prompts
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.history: list[int] = []
        self.turns = 0

    def _question(self) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(QUESTION_TOKENS)]

    def _next_turn(self) -> list[int]:
        if self.turns >= TURNS_PER_CONVERSATION:
            self.history, self.turns = [], 0
        return self.history + self._question()

    def _answered(self, prompt: list[int], output: list[int]) -> None:
        self.history = prompt + output
        self.turns += 1

    def run_once(self) -> None:
        kind = self.rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        handlers: dict[Kind, Callable[[], None]] = {
            Kind.TURN: self._turn, Kind.SHARED: self._shared, Kind.SAMPLED: self._sampled, Kind.STREAM: self._stream,
            Kind.ABORT: self._abort, Kind.DISCONNECT: self._disconnect, Kind.BAD: self._bad}
        try:
            handlers[kind]()
        except Exception as exc:  # a client-side error is that request's failure, never the thread's end
            self.tally.record(kind, Outcome.FAILED, {"error": f"{type(exc).__name__}: {exc}"})

    def _check(self, kind: Kind, prompt: list[int], status: int, body: Any, temperature: float = 0.0,
               seed: int | None = None) -> list[int] | None:
        if status != 200 or not isinstance(body, dict):
            self.tally.record(kind, Outcome.FAILED, {"status": status, "body": str(body)[:300]})
            return None
        got = list(body["output_ids"])
        want = self.reference.ids(prompt, temperature, seed)
        if got != want:
            self.tally.record(kind, Outcome.MISMATCH, {"prompt_len": len(prompt), "got": got, "want": want})
            return None
        meta = body.get("meta_info", {})
        with self.tally.lock:
            self.tally.cached_tokens += int(meta.get("cached_tokens", 0))
            self.tally.prompt_tokens += len(prompt)
        self.tally.record(kind, Outcome.OK)
        return got

    def _turn(self) -> None:
        prompt = self._next_turn()
        status, body = post(self.port, "/generate", _body(prompt))
        out = self._check(Kind.TURN, prompt, status, body)
        if out is not None:
            self._answered(prompt, out)

    def _shared(self) -> None:
        prompt = self.rng.choice(self.system_prompts) + self._question()
        status, body = post(self.port, "/generate", _body(prompt))
        self._check(Kind.SHARED, prompt, status, body)

    def _sampled(self) -> None:
        prompt = self.rng.choice(self.system_prompts) + self._question()
        seed = self.rng.randrange(1 << 30)
        status, body = post(self.port, "/generate", _body(prompt, 0.8, seed))
        self._check(Kind.SAMPLED, prompt, status, body, 0.8, seed)

    def _stream(self) -> None:
        prompt = self._next_turn()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", "/generate", _body(prompt, stream=True), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self.tally.record(Kind.STREAM, Outcome.FAILED, {"status": resp.status, "body": resp.read()[:300]})
                return
            ids: list[int] = []
            done = False
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    self.tally.record(Kind.STREAM, Outcome.FAILED, {"error": chunk["error"]})
                    return
                ids.extend(chunk["output_ids"])
        finally:
            conn.close()
        if not done:
            self.tally.record(Kind.STREAM, Outcome.FAILED, {"error": "the stream ended without [DONE]"})
            return
        out = self._check(Kind.STREAM, prompt, 200, {"output_ids": ids})
        if out is not None:
            self._answered(prompt, out)

    def _abort(self) -> None:
        prompt = self.rng.choice(self.system_prompts) + self._question()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", "/generate", _body(prompt, stream=True), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            first = resp.readline() if resp.status == 200 else b""
        finally:
            conn.close()  # gone after the first chunk: the daemon must abort the request
        ok = resp.status == 200 and first.startswith(b"data: ")
        self.tally.record(Kind.ABORT, Outcome.OK if ok else Outcome.FAILED,
                          None if ok else {"status": resp.status, "first": first[:200].decode(errors="replace")})

    def _disconnect(self) -> None:
        prompt = self.rng.choice(self.system_prompts) + self._question()
        body = _body(prompt)
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        self.tally.record(Kind.DISCONNECT, Outcome.OK)  # closed at once: nothing to check but the daemon

    def _bad(self) -> None:
        raw = self.rng.choice(BAD_BODIES)
        status, body = post(self.port, "/generate", raw)
        ok = status == 400 and isinstance(body, dict) and "error" in body
        self.tally.record(Kind.BAD, Outcome.OK if ok else Outcome.FAILED,
                          None if ok else {"status": status, "body": str(body)[:300], "sent": raw.decode()})
