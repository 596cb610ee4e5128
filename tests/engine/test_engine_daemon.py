"""An engine-mode daemon on its own (no vLLM): config checks, the engine socket under garbage,
and the connector's session logic (timeouts, backoff, re-registration after a restart)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import yaml
import zmq

import protos
from hicache.cache_server.geometry import geometry_from_config
from hicache.config import ENGINE_MODE_ERROR, config_from_dict
from hicache.connectors.engine_client import CacheSession, EngineClient, RegistrationRefused
from tests.support.daemon import Daemon
from tests.support.vllm_engines import engine_config


def _check_config(tmp: Path, cfg: dict) -> subprocess.CompletedProcess[str]:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "hicache", "check-config", str(path), "--no-block-check"],
                          capture_output=True, text=True, timeout=120)


def test_check_config_validates_engine_mode(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    ok = _check_config(tmp_path, engine_config(checkpoints["llama-bf16"], tmp_path / "run"))
    assert ok.returncode == 0, ok.stderr
    assert "kind: vllm" in ok.stdout
    bad = _check_config(tmp_path, {"engine": {"kind": "vllm"}, "cache": {"l2": {"enabled": False},
                                                                        "l3": {"backend": "none"}}})
    assert bad.returncode == 2
    for key in ("engine.model", "ipc.dir", "cache.l2.enabled"):
        assert key in bad.stderr
    raw = json.loads((checkpoints["llama-bf16"] / "config.json").read_text())
    gdn = {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"],
           "linear_num_key_heads": 1, "linear_num_value_heads": 1, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    variants = {  # sliding-window attention and Qwen3-Next's GDN state are held; other recurrent state is refused,
        # naming what says so
        "sliding": ({"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}, None),
        "mla": ({"kv_lora_rank": 512, "qk_rope_head_dim": 64}, None),
        "qwen3-next": (gdn, None),
        "gdn-elsewhere": ({"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
        "mamba": ({"mamba_d_state": 16}, "mamba_d_state"),
    }
    for name, (change, refusal) in variants.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**raw, **change}))
        for weights in checkpoints["llama-bf16"].glob("*.safetensors"):
            (tmp_path / name / weights.name).symlink_to(weights)
        got = _check_config(tmp_path, engine_config(tmp_path / name, tmp_path / "run"))
        if refusal is None:
            assert got.returncode == 0, got.stderr
        else:
            assert got.returncode == 2 and refusal in got.stderr and "gated delta net state of qwen3_next only" \
                in got.stderr, got.stderr
    huge = _check_config(tmp_path, {**engine_config(checkpoints["llama-bf16"], tmp_path / "run"),
                                    "cache": {"page_size": 32, "l2": {"tokens": 2**40}}})
    assert huge.returncode == 2 and "cache.l2.tokens" in huge.stderr


def _register_msg(cfg: dict, req: int = 1, **change: object) -> protos.EngineRegister:
    """The register message of the engine ``cfg`` serves; ``change`` sets geometry fields
    (the page bytes follow them) or the message's own."""
    g = geometry_from_config(config_from_dict(cfg))
    mine = {f.name for f in dataclasses.fields(g)}
    g = dataclasses.replace(g, **{k: v for k, v in change.items() if k in mine})  # type: ignore[arg-type]
    rest = {k: v for k, v in change.items() if k not in mine}
    return protos.EngineRegister(req, "test", os.getpid(), g, g.page_bytes, "c" * 64, **rest)  # type: ignore[arg-type]


@pytest.fixture
def engine_daemon(tmp_path: Path, short_dir: Path, checkpoints: dict[str, Path]):
    cfg = engine_config(checkpoints["llama-bf16"], short_dir / "run")
    d = Daemon(tmp_path, cfg, "daemon")
    d.start()
    try:
        yield d, cfg
    finally:
        code = d.stop()
        assert code == 0, d.log()


def test_garbage_on_the_engine_socket_is_refused_and_the_daemon_serves_on(engine_daemon) -> None:
    d, cfg = engine_daemon
    address = f"ipc://{cfg['ipc']['dir']}/engine.sock"
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    frames = [
        b"\x00garbage",
        msgpack.packb({"v": protos.PROTOCOL_VERSION + 1, "t": "engine_heartbeat", "session": 1}),
        msgpack.packb({"v": protos.PROTOCOL_VERSION, "t": "no_such_tag"}),
        msgpack.packb({"v": protos.PROTOCOL_VERSION, "t": "engine_lookup", "req": "x"}),
        protos.encode(protos.Ready("scheduler", 1)),  # a valid message, not for this socket
        b"",
    ]
    for frame in frames:
        sock.send(frame)
        assert sock.poll(5000), "no answer to a bad frame"
        answer = protos.decode(sock.recv())
        assert isinstance(answer, protos.EngineError) and answer.code == "bad_request"
    sock.send_multipart([b"two", b"frames"])  # a DEALER frame of two parts
    assert sock.poll(5000)
    assert isinstance(protos.decode(sock.recv()), protos.EngineError)
    sock.send(protos.encode(protos.Lookup(7, 12345, 1, "r", protos.pack_tokens([1] * 64))))
    assert sock.poll(5000)
    answer = protos.decode(sock.recv())
    assert isinstance(answer, protos.EngineError) and answer.code == "stale_run" and answer.req == 7
    sock.send(protos.encode(_register_msg(cfg, req=8, kv_dtype="float32")))
    assert sock.poll(5000)
    answer = protos.decode(sock.recv())
    assert isinstance(answer, protos.EngineError) and answer.code == "refused" and "kv_dtype" in answer.reason
    sock.send(protos.encode(_register_msg(cfg, req=9)))
    assert sock.poll(5000)
    reg = protos.decode(sock.recv())
    assert isinstance(reg, protos.EngineRegistered) and reg.req == 9
    sock.close()
    assert d.get("/health")["status"] == "ok"
    status, body = d.request("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert "engine mode" in json.dumps(body), (status, body)
    assert status == 501 and body["error"]["message"] == ENGINE_MODE_ERROR, (status, body)  # the client's error
    stats = d.get("/cache/stats")
    assert stats["mode"] == "engine" and stats["engine"]["refused"] == 1 and stats["integrity"]["error"] is None


def test_the_session_survives_a_daemon_restart_and_backs_off_while_it_is_down(engine_daemon) -> None:
    d, cfg = engine_daemon
    address = f"ipc://{cfg['ipc']['dir']}/engine.sock"
    session = CacheSession(address, 1000, _register_msg(cfg))
    try:
        first = session.ensure()
        assert first is not None

        def lookup() -> protos.Message | None:
            return session.call(lambda req, reg: protos.Lookup(req, reg.session, reg.run, "r", protos.pack_tokens([3] * 64)))

        assert isinstance(lookup(), protos.LookupResult)
        assert d.stop() == 0
        began = time.monotonic()
        assert lookup() is None  # waits at most the timeout ...
        assert time.monotonic() - began < 3.0
        began = time.monotonic()
        assert lookup() is None  # ... and then not at all while backing off
        assert time.monotonic() - began < 0.1
        d.start()
        # the engine is idle: its heartbeat thread learns of the restart and registers again
        deadline = time.monotonic() + 30
        while not d.get("/cache/stats")["engines"]:
            assert time.monotonic() < deadline, "the idle engine did not register with the restarted daemon"
            time.sleep(0.2)
        assert session.registered is not None and session.registered.pool.instance != first.pool.instance
        answer = lookup()
        while not isinstance(answer, protos.LookupResult) and time.monotonic() < deadline:
            time.sleep(0.2)
            answer = lookup()
        assert isinstance(answer, protos.LookupResult), "no answer after the restart"
        assert [e["session"] for e in d.get("/cache/stats")["engines"]] == [session.registered.session]
        # the heartbeat thread keeps the session open while the engine is idle
        time.sleep(3 * cfg["engine"]["lease_ttl_s"])
        stats = d.get("/cache/stats")
        assert [e["session"] for e in stats["engines"]] == [session.registered.session]
        # one registration in this run: a refusal of a heartbeat sent before it (under the old
        # run) did not open a second session, left to expire
        assert stats["leases"]["expired_sessions"] == 0 and session.registered.session == 1
    finally:
        session.close()


def test_a_refused_registration_raises_with_the_reason(engine_daemon) -> None:
    _d, cfg = engine_daemon
    session = CacheSession(f"ipc://{cfg['ipc']['dir']}/engine.sock", 2000, _register_msg(cfg, block_size=64))
    try:
        with pytest.raises(RegistrationRefused, match="block_size"):
            session.ensure()
    finally:
        session.close()


def test_a_client_without_a_daemon_answers_none_fast(short_dir: Path) -> None:
    client = EngineClient(f"ipc://{short_dir}/nothing.sock", 200)
    try:
        began = time.monotonic()
        assert client.call(protos.Lookup(client.next_req(), 1, 1, "r", protos.pack_tokens([1]))) is None
        assert time.monotonic() - began < 1.0 and client.down
        assert not client.send(protos.Heartbeat(1, 1))
    finally:
        client.close()


def _save(session: CacheSession, tokens: list[int], ranks: int = 1) -> None:
    """Reserve and commit ``tokens``' pages, each rank's commit (the bytes do not matter here)."""
    ans = session.call(lambda req, reg: protos.Reserve(req, reg.session, reg.run, [protos.SaveRange("w", protos.pack_tokens(tokens), 0)]))
    assert isinstance(ans, protos.ReserveResult) and ans.items[0].host_pages, ans
    reg = session.registered
    assert reg is not None
    for rank in range(ranks):
        assert session.send(protos.Commit(reg.session, reg.run, ans.items[0].lease, True, rank))


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_lookup_answer_that_comes_after_the_timeout_is_given_back_at_once(engine_daemon, ranks: int) -> None:
    """Given back for every rank (no rank was given it), also for a tensor-parallel engine."""
    d, cfg = engine_daemon
    session = CacheSession(f"ipc://{cfg['ipc']['dir']}/engine.sock", 300, _register_msg(cfg, tensor_parallel=ranks))
    scheduler = d.pids()["scheduler"]
    try:
        assert session.ensure() is not None
        tokens = [11] * 64
        _save(session, tokens, ranks)
        d.wait_for_stats("the commit", lambda s: s["engine"]["committed_pages"] == 2, 10)
        os.kill(scheduler, signal.SIGSTOP)  # the daemon stalls: the answer comes after the timeout
        try:
            assert session.call(lambda req, reg: protos.Lookup(req, reg.session, reg.run, "r", protos.pack_tokens(tokens))) is None
        finally:
            os.kill(scheduler, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while session.late_leases == 0:  # the next step of the engine reads past the late answer
            assert time.monotonic() < deadline, "the late answer never arrived"
            time.sleep(0.05)
            session.client.drain()
        d.wait_for_stats("the late lease to be released", lambda s: s["leases"]["open"] == 0, 5)
        assert d.get("/cache/stats")["engine"]["lookup_hit_pages"] == 2
    finally:
        session.close()


BACKLOG = 1000
"""More than the cache server serves in one round (``ENGINE_BATCH``)."""


def test_heartbeats_queued_behind_a_backlog_keep_their_session(engine_daemon) -> None:
    """The daemon stalls for longer than the lease TTL while an engine's messages queue up: a
    heartbeat behind a backlog of ``BACKLOG`` messages (more than one round serves) still
    renews its session, since sessions expire only once every queued message is served."""
    d, cfg = engine_daemon
    ttl = cfg["engine"]["lease_ttl_s"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)  # the backlog queues here while the daemon is stopped
    sock.connect(f"ipc://{cfg['ipc']['dir']}/engine.sock")
    scheduler = d.pids()["scheduler"]
    try:
        sock.send(protos.encode(_register_msg(cfg, req=1)))
        assert sock.poll(5000)
        reg = protos.decode(sock.recv())
        assert isinstance(reg, protos.EngineRegistered)
        os.kill(scheduler, signal.SIGSTOP)
        try:
            for _ in range(BACKLOG):  # heartbeats of no session: cheap, unanswered, served in order
                sock.send(protos.encode(protos.Heartbeat(reg.session + 1000, reg.run)), zmq.NOBLOCK)
            sock.send(protos.encode(protos.Heartbeat(reg.session, reg.run)), zmq.NOBLOCK)
            time.sleep(1.5 * ttl)
        finally:
            os.kill(scheduler, signal.SIGCONT)
        time.sleep(0.5)
        sessions = [e["session"] for e in d.get("/cache/stats")["engines"]]
        assert reg.session in sessions, "the session expired with its heartbeat still queued"
    finally:
        sock.close()


def test_an_engine_mode_daemon_with_pins_starts_and_pins_at_the_first_save(tmp_path: Path, short_dir: Path,
                                                                           checkpoints: dict[str, Path]) -> None:
    cfg = engine_config(checkpoints["llama-bf16"], short_dir / "run")
    prefix = [5] * 64 + [6] * 32  # 3 blocks of 32
    cfg["cache"]["pinned"] = [{"name": "sys", "token_ids": prefix}]
    d = Daemon(tmp_path, cfg, "daemon")
    d.start()  # the tokenizer leaves engine-mode pins to the cache server
    session = CacheSession(f"ipc://{cfg['ipc']['dir']}/engine.sock", 1000, _register_msg(cfg))
    try:
        assert session.ensure() is not None
        assert [p["state"] for p in d.get("/cache/pinned")["pinned"]] == ["waiting"]
        _save(session, prefix + [9] * 32)
        d.wait_for_stats("the pin", lambda st: [p["state"] for p in st["pinned"]] == ["pinned"])
        status, err = d.request("PUT", "/cache/pinned", {"name": "x", "input_ids": [1] * 64})
        assert status == 400 and "cache.pinned" in err["error"]["message"]
    finally:
        session.close()
        assert d.stop() == 0, d.log()


class FakeDaemon:
    """A daemon played by a ROUTER socket in a thread: it answers registrations (after
    ``register_delay_s``, each with the next session number, in run ``run``; the identity of
    each session is in ``identities``) and, ``refusal_delay_s`` late, refuses the heartbeats
    of another run than ``run`` (as a restarted daemon does)."""

    GEOMETRY = protos.EngineKVGeometry("a" * 64, "bfloat16", 16, 2, 2, 32, "LBHNC")

    def __init__(self, address: str, ttl_s: float, refusal_delay_s: float = 0.0) -> None:
        self.pool = protos.L2PoolInfo("inst", "inst-full-l2-0", "/dev/shm", 64, self.GEOMETRY.page_bytes)
        self.ttl_s, self.refusal_delay_s = ttl_s, refusal_delay_s
        self.run = 1
        self.register_delay_s = 0.0
        self.registrations: list[int] = []  # the run of each registration received, in order
        self.identities: dict[int, str] = {}  # session -> the runtime identity it registered
        self.answered = 0  # registrations answered
        self._router = zmq.Context.instance().socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def register_msg(self, identity: str = "c" * 64) -> protos.EngineRegister:
        return protos.EngineRegister(0, "test", os.getpid(), self.GEOMETRY, self.GEOMETRY.page_bytes, identity)

    def _serve(self) -> None:
        later: list[tuple[float, list[bytes], bool]] = []  # (when, frames, a registration's answer)
        while not self._stop.is_set():
            if self._router.poll(5):
                ident, frame = self._router.recv_multipart()
                msg = protos.decode(frame)
                if isinstance(msg, protos.EngineRegister):
                    self.registrations.append(self.run)
                    session = len(self.registrations)
                    self.identities[session] = msg.runtime_identity
                    later.append((time.monotonic() + self.register_delay_s, [ident, protos.encode(
                        protos.EngineRegistered(msg.req, session, self.run, self.pool, self.ttl_s))], True))
                elif isinstance(msg, protos.Heartbeat) and msg.run != self.run:
                    later.append((time.monotonic() + self.refusal_delay_s, [ident, protos.encode(
                        protos.EngineError(msg.req, "stale_run", "another run"))], False))
                later.sort(key=lambda x: x[0])
            while later and later[0][0] <= time.monotonic():
                _, frames, registration = later.pop(0)
                self._router.send_multipart(frames)
                self.answered += registration

    def wait(self, what: str, cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._router.close()


def test_a_late_refusal_of_a_heartbeat_of_the_old_run_does_not_open_a_second_session(short_dir: Path) -> None:
    """A daemon restarts and answers the engine's heartbeats of the old run late, 2.5
    heartbeats after each: the heartbeat thread registers once, on the first refusal; the
    refusals of heartbeats it sent before that, arriving after it, leave the new session alone."""
    daemon = FakeDaemon(f"ipc://{short_dir}/fake-daemon.sock", ttl_s=0.4, refusal_delay_s=0.25)  # beats every 0.1 s
    session = CacheSession(f"ipc://{short_dir}/fake-daemon.sock", 1000, daemon.register_msg())
    try:
        assert session.ensure() is not None and daemon.registrations == [1]
        daemon.run = 2  # "restarted"
        daemon.wait("the idle session to register with the new run", lambda: len(daemon.registrations) >= 2)
        time.sleep(1.5)  # 15 heartbeats: every late refusal of the old run has arrived
        assert daemon.registrations == [1, 2]
        assert session.registered is not None and (session.registered.session, session.registered.run) == (2, 2)
    finally:
        session.close()
        daemon.close()


def test_a_registration_answered_after_a_cache_reset_is_dropped_and_the_new_identity_registers(
        short_dir: Path) -> None:
    """After a daemon restart the heartbeat thread registers again; the cache reset
    (``reregister``: a new runtime identity) comes while the daemon's answer to that
    registration is still on its way. That answer is of the old identity: it is dropped, and
    the session registers with the new one (its namespace), never staying in the old."""
    daemon = FakeDaemon(f"ipc://{short_dir}/fake-daemon.sock", ttl_s=0.4)
    old, new = "c" * 64, "d" * 64
    session = CacheSession(f"ipc://{short_dir}/fake-daemon.sock", 2000, daemon.register_msg(old))
    try:
        assert session.ensure() is not None
        daemon.register_delay_s = 0.6  # a slow answer
        daemon.run = 2
        daemon.wait("the heartbeat thread's registration", lambda: len(daemon.registrations) == 2)
        session.reregister(daemon.register_msg(new))  # the cache reset, while that answer is on its way
        daemon.wait("the slow answer", lambda: daemon.answered == 2)
        daemon.register_delay_s = 0.0
        daemon.wait("a registration of the new identity", lambda: session.registered is not None
                    and daemon.identities[session.registered.session] == new)
        time.sleep(0.3)
        assert session.registered is not None and daemon.identities[session.registered.session] == new
        assert daemon.identities[2] == old and session.dropped_registrations == 1
    finally:
        session.close()
        daemon.close()


def test_the_engines_thread_never_waits_for_the_heartbeat_threads_registration(short_dir: Path) -> None:
    """While the heartbeat thread waits for a slow daemon to answer its registration (after a
    restart), the engine's calls come back at once (misses), not after that answer."""
    daemon = FakeDaemon(f"ipc://{short_dir}/fake-daemon.sock", ttl_s=0.4)
    session = CacheSession(f"ipc://{short_dir}/fake-daemon.sock", 2000, daemon.register_msg())
    try:
        assert session.ensure() is not None
        daemon.register_delay_s = 1.5
        daemon.run = 2
        daemon.wait("the heartbeat thread's registration", lambda: len(daemon.registrations) == 2)
        began = time.monotonic()
        for _ in range(5):
            assert session.call(lambda req, reg: protos.Lookup(req, reg.session, reg.run, "r",
                                                               protos.pack_tokens([1] * 16))) is None
        assert time.monotonic() - began < 0.5, "the engine's thread waited for the other thread's registration"
        daemon.wait("the registration of the new run", lambda: session.registered is not None
                    and session.registered.run == 2)
    finally:
        session.close()
        daemon.close()
