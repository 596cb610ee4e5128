"""CURVE over ZeroMQ: ``hicache keygen`` key directories, their checks, and typed sockets that
admit only authorised clients (real sockets on loopback TCP)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
import zmq

import protos
from hicache.bench.loopback_ports import free_port
from hicache.cli.keygen import write_key_dir, write_key_pair
from hicache.config import ConfigError, config_from_dict
from hicache.connectors.engine_client import CLIENT_SECRET_KEY, SERVER_PUBLIC_KEY, curve_keys_for
from hicache.runtime.ipc import (
    AUTHORIZED_DIR,
    SUBSCRIBERS_DIR,
    ZAP_EVENTS,
    CurveKeyError,
    DealerSocket,
    Endpoints,
    PullSocket,
    PushSocket,
    RouterSocket,
    SecureContext,
    curve_server,
    load_curve_client,
    load_curve_keys,
    open_context,
)

REPO = Path(__file__).resolve().parents[2]
KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret", "authorized_clients/client.key")

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicache", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def _tcp_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    root = tmp_path / "keys"
    write_key_dir(root)
    return root


def test_keygen_writes_private_key_files_that_load(tmp_path: Path) -> None:
    root = tmp_path / "curve"
    out = _cli("keygen", "--dir", str(root))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE((root / AUTHORIZED_DIR).stat().st_mode) == 0o700
    for name in KEY_FILES:
        assert stat.S_IMODE((root / name).stat().st_mode) == 0o600, name
    keys = load_curve_keys(root)
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert zmq.curve_public(keys.client_secret) == keys.client_public
    assert keys.server_public != keys.client_public
    secrets = [keys.server_secret.decode(), keys.client_secret.decode()]
    assert not any(s in out.stdout + out.stderr for s in secrets), "keygen printed a secret key"
    assert not any(s in repr(keys) for s in secrets), "a secret key is in the repr"
    assert f"curve_keys_dir: {root}" in out.stdout

    again = _cli("keygen", "--dir", str(root))  # never overwrites without --force
    assert again.returncode == 1 and "--force" in again.stderr
    assert load_curve_keys(root).server_public == keys.server_public
    forced = _cli("keygen", "--dir", str(root), "--force", "--client", "engine-a")
    assert forced.returncode == 0, forced.stderr
    engine = load_curve_client(root / "server.key", root / "engine-a.key_secret")
    admitted = (root / AUTHORIZED_DIR / "engine-a.key").read_text()
    assert engine.client_public.decode() in admitted
    assert stat.S_IMODE((root / "engine-a.key_secret").stat().st_mode) == 0o600


def test_keygen_refuses_clearly_without_curve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.cli import keygen as keygen_cli
    from hicache.cli.main import build_parser

    monkeypatch.setattr(zmq, "has", lambda what: False if what == "curve" else True)
    args = build_parser().parse_args(["keygen", "--dir", str(tmp_path / "k")])
    assert keygen_cli.run(args) == 1
    assert "without CURVE" in capsys.readouterr().err
    assert not (tmp_path / "k").exists()
    with pytest.raises(CurveKeyError, match="without CURVE"):
        load_curve_keys(tmp_path)


def test_bad_key_directories_are_refused_naming_the_file_and_the_fix(keys_dir: Path) -> None:
    os.chmod(keys_dir / "client.key_secret", 0o644)
    with pytest.raises(CurveKeyError, match=r"client.key_secret .*chmod 600"):
        load_curve_keys(keys_dir)
    os.chmod(keys_dir / "client.key_secret", 0o600)
    (keys_dir / AUTHORIZED_DIR / "client.key").unlink()  # engines may not use the daemon's pair: fine
    assert load_curve_keys(keys_dir).engine_clients == frozenset()
    shutil.copy(keys_dir / "client.key", keys_dir / AUTHORIZED_DIR / "client.key")
    for directory in (AUTHORIZED_DIR, SUBSCRIBERS_DIR):
        (keys_dir / directory).mkdir(mode=0o700, exist_ok=True)
        os.chmod(keys_dir / directory, 0o777)
        with pytest.raises(CurveKeyError, match=f"{directory} must be .*writable by no one else"):
            load_curve_keys(keys_dir)
        os.chmod(keys_dir / directory, 0o700)
    load_curve_keys(keys_dir)
    # a secret file whose secret key is not the one of its public key
    text = (keys_dir / "server.key_secret").read_text()
    public = load_curve_keys(keys_dir).client_public.decode()
    lines = [f'    public-key = "{public}"' if "public-key" in ln else ln for ln in text.splitlines()]
    (keys_dir / "server.key_secret").write_text("\n".join(lines) + "\n")
    with pytest.raises(CurveKeyError, match="does not belong"):
        load_curve_keys(keys_dir)
    (keys_dir / "server.key_secret").write_text("not a key\n")
    with pytest.raises(CurveKeyError, match="not a ZeroMQ CURVE key file"):
        load_curve_keys(keys_dir)
    with pytest.raises(CurveKeyError, match="hicache keygen"):
        load_curve_keys(keys_dir / "nowhere")


def test_config_refuses_tcp_without_keys_and_names_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"ipc": {"transport": "tcp", "tcp_base_port": 7000}})
    problem = next(p for p in info.value.problems if p.path == "ipc.transport")
    assert "hicache keygen" in problem.reason and "ipc.curve_keys_dir" in problem.reason
    assert "ipc.allow_insecure_tcp" in problem.reason
    cfg = config_from_dict({"ipc": {"transport": "tcp", "allow_insecure_tcp": True}})
    assert cfg.ipc.allow_insecure_tcp
    assert config_from_dict({"ipc": {"transport": "tcp", "curve_keys_dir": "/k"}}).ipc.curve_keys_dir == "/k"
    with pytest.raises(ConfigError, match="ipc.allow_insecure_tcp"):
        config_from_dict({"ipc": {"transport": "tcp", "curve_keys_dir": "/k", "allow_insecure_tcp": True}})
    assert config_from_dict({}).ipc.transport == "ipc"  # the default needs no keys


def test_check_config_refuses_tcp_without_keys_and_checks_the_key_files(tmp_path: Path, keys_dir: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"ipc": {"transport": "tcp", "tcp_base_port": 7100}}))
    out = _cli("check-config", str(path))
    assert out.returncode == 2 and out.stdout == ""
    line = next(ln for ln in out.stderr.splitlines() if ln.strip().startswith("ipc.transport:"))
    assert "hicache keygen" in line and "allow_insecure_tcp" in line

    from hicache.daemon.startup_checks import startup_problems

    cfg = config_from_dict({"ipc": {"transport": "tcp", "tcp_base_port": 7100, "curve_keys_dir": str(keys_dir)}})
    assert startup_problems(cfg) == []
    os.chmod(keys_dir / "server.key_secret", 0o640)
    problems = startup_problems(cfg)
    assert [p.path for p in problems] == ["ipc.curve_keys_dir"] and "chmod 600" in problems[0].reason


def _raw_push(ctx: zmq.Context, address: str, curve: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    """A PUSH socket outside the wrappers: plain, or a CURVE client with (server public, public, secret).
    A send waits at most 2 s (``zmq.Again``): a client whose handshake failed may have no pipe to
    queue on, and a blocking send would wait for ever."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 2000)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    sock.connect(address)
    return sock


def test_only_authorised_clients_get_messages_through(keys_dir: Path) -> None:
    keys = load_curve_keys(keys_dir)
    address = _tcp_address()
    server = open_context(Endpoints("tcp", curve_keys_dir=str(keys_dir)))
    client = open_context(keys=keys)
    plain = zmq.Context()
    assert isinstance(server, SecureContext)
    pull: PullSocket[protos.Message] = PullSocket(server, address, (protos.AdminRequest,), bind=True)
    good: PushSocket[protos.Message] = PushSocket(client, address)
    stranger_public, stranger_secret = zmq.curve_keypair()
    attackers = [
        _raw_push(plain, address, None),  # no CURVE at all
        _raw_push(plain, address, (keys.server_public, stranger_public, stranger_secret)),  # unknown key pair
        _raw_push(plain, address, (stranger_public, keys.client_public, keys.client_secret)),  # wrong server key
    ]
    try:
        assert pull.socket.getsockopt(zmq.CURVE_SERVER) == 1
        assert good.socket.getsockopt(zmq.CURVE_SERVER) == 0
        good.send(protos.AdminRequest("first", "stats"))
        assert pull.recv(5000) == protos.AdminRequest("first", "stats")
        for i, sock in enumerate(attackers):
            with contextlib.suppress(zmq.Again):  # not even queued: then nothing can get through either
                sock.send(protos.encode(protos.AdminRequest(f"attack-{i}", "flush")))
        assert pull.recv(1500) is None, "an unauthorised client got a message through"
        good.send(protos.AdminRequest("after", "stats"))  # the authorised client still gets through
        assert pull.recv(5000) == protos.AdminRequest("after", "stats")
        assert pull.recv(300) is None
    finally:
        for sock in attackers:
            sock.close(0)
        good.close()
        pull.close()
        plain.term()
        client.term()
        server.term()


def test_each_socket_admits_only_the_keys_of_its_zap_domain(tmp_path: Path, keys_dir: Path) -> None:
    """An engine's key (``keygen --client``) opens the engine socket and no internal socket; a
    subscriber's key (``keygen --subscriber``) opens the events socket only; the daemon's own
    client key opens the internal sockets. Each socket's refusals are real handshakes failing."""
    assert _cli("keygen", "--dir", str(keys_dir), "--client", "engine1").returncode == 0
    out = _cli("keygen", "--dir", str(keys_dir), "--subscriber", "router1")
    assert out.returncode == 0, out.stderr
    assert (keys_dir / SUBSCRIBERS_DIR / "router1.key").is_file() and not (keys_dir / AUTHORIZED_DIR / "router1.key").exists()
    keys = load_curve_keys(keys_dir)
    engine = load_curve_client(keys_dir / "server.key", keys_dir / "engine1.key_secret")
    router = load_curve_client(keys_dir / "server.key", keys_dir / "router1.key_secret")
    own = keys.client()
    endpoints = Endpoints("tcp", tcp_host="127.0.0.1", tcp_base_port=free_port(span=5), curve_keys_dir=str(keys_dir))
    server = open_context(endpoints)
    plain = zmq.Context()
    internal: PullSocket[protos.Message] = PullSocket(server, endpoints.address("scheduler"), (protos.AdminRequest,))
    engine_sock: PullSocket[protos.Message] = PullSocket(server, endpoints.address("engine"), (protos.AdminRequest,))
    events = server.socket(zmq.PULL)
    events.setsockopt(zmq.LINGER, 0)
    curve_server(events, keys, ZAP_EVENTS)
    events_address = _tcp_address()
    events.bind(events_address)
    admitted = {"internal": own, "engine": engine, "events": router}
    socks = {"internal": (internal.socket, endpoints.address("scheduler")),
             "engine": (engine_sock.socket, endpoints.address("engine")), "events": (events, events_address)}
    pushes = []
    try:
        for name, (sock, address) in socks.items():
            for who, curve in admitted.items():
                push = _raw_push(plain, address, (curve.server_public, curve.client_public, curve.client_secret))
                pushes.append(push)
                with contextlib.suppress(zmq.Again):
                    push.send(protos.encode(protos.AdminRequest(f"{who}->{name}", "flush")))
            got = set()
            while sock.poll(1500):
                got.add(protos.decode(sock.recv()).rid)  # type: ignore[attr-defined]
            # the engine socket also admits the daemon's own pair: keygen lists client.key in
            # authorized_clients, for engines that use it (delete it there to stop that)
            expected = {f"{name}->{name}"} | ({"internal->engine"} if name == "engine" else set())
            assert got == expected, (name, got)
    finally:
        for push in pushes:
            push.close(0)
        internal.close()
        engine_sock.close()
        events.close(0)
        plain.term()
        server.term()


def test_router_and_dealer_use_curve(keys_dir: Path) -> None:
    keys = load_curve_keys(keys_dir)
    address = _tcp_address()
    server = open_context(keys=keys)
    plain = zmq.Context()
    router: RouterSocket[protos.Message] = RouterSocket(server, address, (protos.Cancel,))
    dealer: DealerSocket[protos.Message] = DealerSocket(server, address, (protos.OpDone,), identity=b"d1")
    stranger: DealerSocket[protos.Message] = DealerSocket(plain, address, (protos.OpDone,), identity=b"d2")
    try:
        dealer.send(protos.Cancel(1))
        stranger.send(protos.Cancel(2))
        assert router.recv(5000) == (b"d1", protos.Cancel(1))
        router.send(b"d1", protos.OpDone(1, "cancelled"))
        assert dealer.recv(5000) == protos.OpDone(1, "cancelled")
        assert router.recv(800) is None, "a client without CURVE reached the router"
    finally:
        stranger.close()
        dealer.close()
        router.close()
        plain.term()
        server.term()


def test_engine_connector_keys_from_the_daemon_dir_or_the_extra_config(keys_dir: Path, tmp_path: Path) -> None:
    assert curve_keys_for({}, None) is None
    with pytest.raises(ValueError, match="does not use CURVE"):
        curve_keys_for({CLIENT_SECRET_KEY: str(keys_dir / "client.key_secret")}, None)
    keys = load_curve_keys(keys_dir)
    default = curve_keys_for({}, str(keys_dir))
    assert default == keys.client()
    other = tmp_path / "engine"
    other.mkdir()
    shutil.copy(keys_dir / "server.key", other / "server.key")
    write_key_pair(other, "engine-b")
    chosen = curve_keys_for({SERVER_PUBLIC_KEY: str(other / "server.key"),
                             CLIENT_SECRET_KEY: str(other / "engine-b.key_secret")}, "/elsewhere")
    assert chosen is not None and chosen.server_public == keys.server_public
    assert chosen.client_public != keys.client_public
    os.chmod(other / "engine-b.key_secret", 0o644)
    with pytest.raises(ValueError, match=r"curve_client_secret_file.*chmod 600"):
        curve_keys_for({CLIENT_SECRET_KEY: str(other / "engine-b.key_secret")}, str(keys_dir))
    with pytest.raises(ValueError, match="must be a file path"):
        curve_keys_for({SERVER_PUBLIC_KEY: 3}, str(keys_dir))
