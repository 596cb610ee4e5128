"""End to end: daemons whose ZeroMQ sockets run over ``tcp://`` with CURVE.

The attack: a client that can reach the daemon's TCP ports sends a valid encoded message
(a cache flush to the scheduler, a shutdown to the controller) without keys, or with a key
pair the daemon does not admit. The daemon must not act on it; the same messages sent with
the admitted client key pair show that they would have acted.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
import zmq

import protos
from hicache.bench.loopback_ports import free_port
from hicache.cache_server.geometry import geometry_from_config
from hicache.cli.keygen import write_key_dir, write_key_pair
from hicache.config import config_from_dict
from hicache.connectors.engine_client import CacheSession, EngineClient, curve_keys_for
from hicache.runtime.ipc import CurveClientKeys, Endpoints, load_curve_client, load_curve_keys
from tests.support.daemon import REPO, Daemon, DaemonFactory

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")

PROMPT = list(range(1, 65))


def _free_base_port() -> int:
    """A port P with P..P+4 free on loopback (the five endpoints of a tcp daemon)."""
    return free_port(span=5)


def _tcp_ipc(keys: Path | None, base: int) -> dict:
    ipc: dict = {"transport": "tcp", "tcp_host": "127.0.0.1", "tcp_base_port": base}
    if keys is not None:
        ipc["curve_keys_dir"] = str(keys)
    return ipc


def _builtin_config(keys: Path | None, base: int) -> dict:
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 1024}, "l2": {"tokens": 4096}, "l3": {"backend": "none"}},
        "ipc": _tcp_ipc(keys, base),
        "logging": {"level": "warning"},
    }


def _push(ctx: zmq.Context, address: str, curve: CurveClientKeys | None) -> zmq.Socket:
    """A raw PUSH socket, as an attacker (or an admitted client) would make it. A send waits at
    most 10 s (``zmq.Again``): a client whose handshake failed may have no pipe to queue on."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10000)
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.client_public
        sock.curve_secretkey = curve.client_secret
    sock.connect(address)
    return sock


def _cached(d: Daemon) -> int:
    return int(d.generate(PROMPT, n=2)["meta_info"]["cached_tokens"])


def test_tcp_without_keys_is_refused_by_serve_and_check_config(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_builtin_config(None, 7300)))
    for args in (["check-config", str(path)], ["serve", "--config", str(path)]):
        out = subprocess.run([sys.executable, "-m", "hicache", *args], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
        assert out.returncode == 2, (args, out.stderr)
        assert "ipc.transport:" in out.stderr and "hicache keygen" in out.stderr, out.stderr
        assert "ipc.allow_insecure_tcp: true" in out.stderr
        assert "is serving" not in out.stderr


def test_insecure_tcp_when_asked_for_serves_and_warns(daemons: DaemonFactory) -> None:
    cfg = _builtin_config(None, _free_base_port())
    cfg["ipc"]["allow_insecure_tcp"] = True
    d = daemons(cfg)
    assert d.generate(PROMPT, n=2)["meta_info"]["completion_tokens"] == 2
    warning = next((ln for ln in d.log().splitlines() if "WITHOUT CURVE" in ln), None)
    assert warning is not None and "WARNING" in warning, d.log()


def test_curve_daemon_serves_and_ignores_unauthorised_clients(tmp_path: Path, daemons: DaemonFactory) -> None:
    """Also an engine's admitted key (``hicache keygen --client engine1``): it opens the engine
    socket only (``hicache.runtime.ipc``'s ZAP domains), never the scheduler's or the controller's."""
    keys_dir = tmp_path / "keys"
    write_key_dir(keys_dir)
    write_key_pair(keys_dir, "engine1")
    keys = load_curve_keys(keys_dir)
    engine1 = load_curve_client(keys_dir / "server.key", keys_dir / "engine1.key_secret")
    base = _free_base_port()
    d = daemons(_builtin_config(keys_dir, base))
    pids = d.pids()
    ep = Endpoints("tcp", tcp_host="127.0.0.1", tcp_base_port=base)
    scheduler, controller = ep.address("scheduler"), ep.address("controller")

    first = d.generate(PROMPT, n=2)
    assert first["meta_info"]["cached_tokens"] == 0
    assert _cached(d) > 0, "the second request did not hit the cache"

    stranger_public, stranger_secret = zmq.curve_keypair()
    unknown = CurveClientKeys(keys.server_public, stranger_public, stranger_secret)  # knows the server key
    ctx = zmq.Context()
    try:
        # Sockets stay open until the effect is checked: closing one drops what it has not sent.
        attacks: list[tuple[str, protos.Message]] = [(scheduler, protos.AdminRequest("attack", "flush")),
                                                     (controller, protos.Shutdown("attack", 0.0))]
        attackers = []
        for curve in (None, unknown, engine1):
            for address, msg in attacks:
                sock = _push(ctx, address, curve)
                with contextlib.suppress(zmq.Again):  # not even queued: then nothing can act either
                    sock.send(protos.encode(msg))
                attackers.append(sock)
        time.sleep(2.0)
        assert d.proc is not None and d.proc.poll() is None, f"the daemon stopped:\n{d.log()}"
        assert d.pids() == pids, "a process was stopped or restarted"
        assert _cached(d) > 0, "an unauthorised flush emptied the cache"

        # The same messages with the admitted client key pair do act (so the above is meaningful).
        admitted = _push(ctx, scheduler, keys.client())
        for _ in range(5):  # a flush acts on what no running request holds: probe only while idle
            admitted.send(protos.encode(protos.AdminRequest("admitted", "flush")))
            time.sleep(1.0)
            if _cached(d) == 0:
                break
        else:
            raise AssertionError(f"the admitted flush had no effect:\n{d.log()}")
        assert d.proc.poll() is None and d.pids() == pids
        admitted = _push(ctx, controller, keys.client())
        admitted.send(protos.encode(protos.Shutdown("admitted", 0.0)))
        assert d.proc.wait(60) == 0, d.log()  # the controller stopped: the launcher stops the daemon
    finally:
        ctx.destroy(linger=0)
    assert "refused a frame" not in d.log()


def _engine_model(root: Path) -> Path:
    """A checkpoint as the cache server reads it: config.json and one safetensors file."""
    from safetensors.numpy import save_file

    root.mkdir()
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
        "intermediate_size": 128, "vocab_size": 256, "torch_dtype": "float32"}))
    save_file({"w": np.arange(16, dtype=np.float32)}, str(root / "model.safetensors"))
    return root


def test_engine_client_talks_to_a_curve_cache_server_only_with_admitted_keys(
        tmp_path: Path, daemons: DaemonFactory) -> None:
    keys_dir = tmp_path / "keys"
    write_key_dir(keys_dir)
    write_key_pair(tmp_path, "stranger")  # a valid pair the daemon does not admit
    write_key_pair(keys_dir, "engine1")  # an engine's own pair (keygen --client): admitted here
    base = _free_base_port()
    cfg = {"engine": {"kind": "vllm", "model": str(_engine_model(tmp_path / "model")), "lookup_timeout_ms": 3000},
           "cache": {"page_size": 32, "l2": {"tokens": 1024}, "l3": {"backend": "none"}},
           "ipc": _tcp_ipc(keys_dir, base), "logging": {"level": "warning"}}
    daemons(cfg)
    g = geometry_from_config(config_from_dict(cfg))
    register = protos.EngineRegister(1, "test", os.getpid(), g, g.page_bytes, "c" * 64)
    address = Endpoints("tcp", tcp_host="127.0.0.1", tcp_base_port=base).address("engine")

    wrong = curve_keys_for({"curve_client_secret_file": str(tmp_path / "stranger.key_secret")}, str(keys_dir))
    for curve in (wrong, None):
        client = EngineClient(address, 300, curve=curve)
        try:
            t0 = time.monotonic()
            assert client.call(replace_req(register, client.next_req())) is None
            assert time.monotonic() - t0 < 2.0
            assert client.down and client.timeouts == 1  # backing off, not waiting again
            assert client.call(replace_req(register, client.next_req())) is None
            assert client.timeouts == 1
        finally:
            client.close()

    for extra in ({}, {"curve_client_secret_file": str(keys_dir / "engine1.key_secret")}):
        session = CacheSession(address, 3000, register, curve=curve_keys_for(extra, str(keys_dir)))
        try:
            reg = session.ensure()
            assert isinstance(reg, protos.EngineRegistered), (extra, reg)
            answer = session.call(lambda req, r: protos.Lookup(req, r.session, r.run, "r",
                                                               protos.pack_tokens(range(64))))
            assert isinstance(answer, protos.LookupResult) and answer.host_pages == []
        finally:
            session.close()


def replace_req(msg: protos.EngineRegister, req: int) -> protos.EngineRegister:
    from dataclasses import replace

    return replace(msg, req=req)
