"""End to end: what a tenant, the operator and an unauthenticated client may do to a real
daemon (docs/operations.md "Security"), each attack as a security review made it.

1. ``PUT /cache/storage`` with a tenant's key (or none) naming a Redis URL, a password
   source, a key prefix or a directory: a fake listener on loopback receives nothing (no
   connection, so no ``AUTH`` with another tenant's key or the Redis password), no directory
   is created, ``POST /cache/storage/clear`` deletes nothing; the operator attaches only
   stores the config names, by name.
2. A tenant's ``/cache/flush`` empties its own namespaces only, its ``/cache/stats`` tells
   nothing of other tenants or of the daemon's hits, ``/metrics`` needs the operator's key.
3. Pins are named per tenant: another tenant neither sees, replaces nor deletes a tenant's
   pin, and its refusals name none; a tenant pins within its own budget.
4. KV events: a subscriber without the daemon's CURVE admission receives nothing; an admitted
   one receives a tenant's pages without their tokens or salt.
6. ``hicache serve`` refuses a non-loopback HTTP bind without a key (item 5, the ZAP domains,
   is in ``test_curve_daemon.py``).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq

from hicache.bench.loopback_ports import free_port
from hicache.cli.keygen import write_key_dir, write_key_pair
from hicache.kv_events.format import BlockStored, decode_batch
from hicache.tenants import tenant_salt
from tests.support.daemon import REPO, Daemon, DaemonFactory

KEY_A = "sec-alpha-key-2f7c9a1e5b3d8064"
KEY_B = "sec-beta-key-7d1e3b9a5c2f4086"
KEY_OP = "sec-operator-key-4a8e2c6f0b1d9357"
REDIS_PASSWORD = "sec-redis-password-9b3f1c7e5a2d"
def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


PROMPT = _prompt(3, 100)


def _bearer(key: str | None) -> dict[str, str] | None:
    return None if key is None else {"Authorization": f"Bearer {key}"}


def _generate(d: Daemon, key: str, ids: list[int]) -> dict[str, Any]:
    status, out = d.request("POST", "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}},
                            headers=_bearer(key))
    assert status == 200, (status, out, d.log())
    return out["meta_info"] | {"output_ids": out["output_ids"]}


def _tenants_config(tmp: Path, *, pinned: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Two tenants (alpha's key in a file, as a Secret is mounted), a file L3, and only keys
    every daemon since tenants knows (so the attacks run against one without the fixes too)."""
    key_file = tmp / "alpha.key"
    key_file.write_text(KEY_A + "\n")
    cfg: dict[str, Any] = {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 16, "l1": {"tokens": 2048}, "l2": {"tokens": 4096},
                  "l3": {"backend": "file", "file": {"dir": str(tmp / "l3")}}},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 256},
        "server": {"api_keys": [{"tenant": "alpha", "key_file": str(key_file)}, {"tenant": "beta", "key": KEY_B}]},
        "logging": {"level": "info"},
    }
    if pinned:
        cfg["cache"]["pinned"] = pinned
    return cfg


class FakeListener:
    """A TCP server on loopback that records every byte anyone sends it (a fake Redis that
    never answers: a client that sends ``AUTH`` gives its secret away here)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        with conn:
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(4096)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                self.received += chunk

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[FakeListener]:
    fake = FakeListener()
    try:
        yield fake
    finally:
        fake.close()


# ------------------------------------------------------------------ 1. storage attach


def test_storage_routes_reach_no_host_path_or_secret_a_caller_names(daemons: DaemonFactory, tmp_path: Path,
                                                                     listener: FakeListener) -> None:
    d = daemons(_tenants_config(tmp_path), env={"HICACHE_REDIS_PASSWORD": REDIS_PASSWORD})
    victim = tmp_path / "victim"
    (victim / "ab").mkdir(parents=True)
    for name in ("x.page", "y.tmp"):
        (victim / "ab" / name).write_text("not yours")
    url = f"redis://127.0.0.1:{listener.port}/0"
    attacks = [
        ("PUT", {"backend": "redis", "redis": {"url": url, "password_env": "HICACHE_REDIS_PASSWORD",
                                               "timeout_s": 1.0}}),
        ("PUT", {"backend": "redis", "redis": {"url": url, "password_file": str(tmp_path / "alpha.key"),
                                               "timeout_s": 1.0}}),
        ("PUT", {"backend": "redis", "redis": {"url": url, "key_prefix": "mine", "timeout_s": 1.0}}),
        ("PUT", {"backend": "file", "file": {"dir": f"{victim}/../victim"}}),
        ("PUT", {"backend": "file", "file": {"dir": str(tmp_path / "created-by-a-caller")}}),
    ]
    answers = []
    for key in (KEY_B, None):
        for method, body in attacks:
            answers.append(d.request(method, "/cache/storage", body, headers=_bearer(key)))
    for key in (KEY_B, None):
        answers.append(d.request("POST", "/cache/storage/clear", headers=_bearer(key)))
    time.sleep(1.0)  # anything a store sent on attach has arrived by now
    assert listener.connections == 0 and bytes(listener.received) == b"", bytes(listener.received)
    assert sorted(p.name for p in (victim / "ab").iterdir()) == ["x.page", "y.tmp"]
    assert not (tmp_path / "created-by-a-caller").exists()
    statuses = [status for status, _ in answers]
    assert set(statuses) <= {401, 403}, answers
    assert statuses.count(403) == len(attacks) + 1, answers  # the tenant's: forbidden, not merely failed
    # the daemon still writes to the store its config names
    _generate(d, KEY_A, PROMPT)
    deadline = time.monotonic() + 30
    while not list((tmp_path / "l3").rglob("*.page")):
        assert time.monotonic() < deadline, f"no page reached the configured store\n{d.log()}"
        time.sleep(0.2)
    log = d.log_path.read_text(errors="replace")
    assert REDIS_PASSWORD not in log and KEY_A not in log


# ------------------------------------------------------------------ 2. a tenant's admin calls


def _backed_up(tmp: Path, pages: int) -> None:
    """Until the file L3 holds ``pages`` pages: the writes and backups of what was computed
    are done, so a flush finds no transfer in flight (it skips such nodes)."""
    deadline = time.monotonic() + 30
    while len(list((tmp / "l3").rglob("*.page"))) < pages:
        assert time.monotonic() < deadline, "the backups did not finish"
        time.sleep(0.2)
    time.sleep(0.5)


def test_a_tenants_key_acts_on_its_own_namespace_only(daemons: DaemonFactory, tmp_path: Path) -> None:
    d = daemons(_tenants_config(tmp_path))
    _generate(d, KEY_B, PROMPT)
    assert _generate(d, KEY_B, PROMPT)["cached_tokens"] >= 96
    _backed_up(tmp_path, 6)
    status, body = d.request("POST", "/cache/flush", headers=_bearer(KEY_A))
    assert status == 200, body
    kept = _generate(d, KEY_B, PROMPT)
    assert kept["cached_tokens"] >= 96, ("alpha's flush emptied beta's cache", kept)

    status, stats = d.request("GET", "/cache/stats", headers=_bearer(KEY_A))
    assert status == 200, stats
    shown = str(stats)
    assert "beta" not in shown and "hit_tokens" not in shown and "tenants" not in stats, stats
    assert stats["tenant"] == "alpha"

    mine = _prompt(9, 100)
    _generate(d, KEY_A, mine)
    assert _generate(d, KEY_A, mine)["cached_tokens"] >= 96
    _backed_up(tmp_path, 12)
    status, body = d.request("POST", "/cache/flush", headers=_bearer(KEY_A))
    assert status == 200 and body["flushed_tokens"] >= 96, body  # its own flush did flush
    assert _generate(d, KEY_A, mine)["cached_tokens_details"]["device"] == 0
    assert _generate(d, KEY_B, PROMPT)["cached_tokens_details"]["device"] >= 96

    for key in (None, KEY_A, KEY_B):  # per-tenant series and hit counters: the operator's
        status, body = d.request("GET", "/metrics", headers=_bearer(key))
        assert status in (401, 403) and "hicache_cached_tokens_total" not in str(body), (key, status)


# ------------------------------------------------------------------ 3. pins per tenant


def test_pins_are_named_per_tenant(daemons: DaemonFactory, tmp_path: Path) -> None:
    sys_ids = list(range(3, 3 + 48))
    d = daemons(_tenants_config(tmp_path, pinned=[{"name": "sys", "token_ids": sys_ids, "tenant": "alpha"}]))
    status, listing = d.request("GET", "/cache/pinned", headers=_bearer(KEY_B))
    assert status == 200 and "sys" not in str(listing["pinned"]) and "alpha" not in str(listing), listing
    status, body = d.request("DELETE", "/cache/pinned/sys", headers=_bearer(KEY_B))
    assert status == 404, (status, body)
    status, body = d.request("PUT", "/cache/pinned", {"name": "sys", "input_ids": list(range(100, 132))},
                             headers=_bearer(KEY_B))
    assert status == 400 and "budget" in body["error"]["message"], (status, body)
    assert "alpha" not in body["error"]["message"], body

    status, listing = d.request("GET", "/cache/pinned", headers=_bearer(KEY_A))
    assert status == 200, listing
    [pin] = listing["pinned"]
    assert (pin["name"], pin["tenant"], pin["state"], pin["tokens"]) == ("sys", "alpha", "pinned", 48), pin
    assert _generate(d, KEY_A, sys_ids + [7] * 20)["cached_tokens"] >= 48  # alpha's pin still serves alpha
    assert _generate(d, KEY_B, sys_ids + [7] * 20)["cached_tokens"] == 0


# ------------------------------------------------------------------ the operator


def test_the_operator_administers_everything_and_attaches_stores_by_name(daemons: DaemonFactory,
                                                                         tmp_path: Path) -> None:
    """Bound to every interface with the operator's key (what ``serve`` now requires): the
    operator flushes every tenant, reads every tenant's use and ``/metrics``, attaches a store
    of ``cache.l3_stores`` by name; a tenant pins within its budget and not past it."""
    cfg = _tenants_config(tmp_path)
    cfg["server"]["host"] = "0.0.0.0"
    cfg["server"]["operator"] = {"key_env": "HC_SEC_OPERATOR_KEY"}
    cfg["server"]["api_keys"][0]["quota"] = {"pinned_tokens": 64}
    cfg["cache"]["l3_stores"] = {"backup": {"backend": "file", "file": {"dir": str(tmp_path / "backup")}}}
    d = daemons(cfg, env={"HC_SEC_OPERATOR_KEY": KEY_OP})
    d.bearer = KEY_OP
    _generate(d, KEY_A, PROMPT)
    _generate(d, KEY_B, PROMPT)
    stats = d.get("/cache/stats")
    assert stats["hit_tokens"] is not None and stats["l1"]["full"]["cached_tokens"] >= 192, stats
    assert "hicache_cached_tokens_total" in d.get_text("/metrics")
    d.wait_tiers_idle("writes and backups done")
    status, body = d.request("POST", "/cache/flush")
    assert status == 200 and body["flushed_tokens"] >= 192, body
    assert _generate(d, KEY_A, PROMPT)["cached_tokens_details"]["device"] == 0
    assert _generate(d, KEY_B, PROMPT)["cached_tokens_details"]["device"] == 0

    d.wait_tiers_idle("writes and backups done")
    for key in (KEY_A, KEY_B):
        assert d.request("PUT", "/cache/storage", {"store": "backup"}, headers=_bearer(key))[0] == 403
    status, body = d.request("PUT", "/cache/storage", {"backend": "file", "file": {"dir": str(tmp_path / "x")}})
    assert status == 400 and "(default, backup)" in body["error"]["message"], body
    status, body = d.request("PUT", "/cache/storage", {"store": "backup"})
    assert status == 200, body
    _generate(d, KEY_A, _prompt(4, 64))
    deadline = time.monotonic() + 30
    while not list((tmp_path / "backup").rglob("*.page")):
        assert time.monotonic() < deadline, \
            f"no page reached the attached store: {d.get('/cache/stats')}, {d.get('/cache/storage')}\n{d.log()}"
        time.sleep(0.2)

    # a pin budget: alpha's 64 tokens, beta none
    ok = d.request("PUT", "/cache/pinned", {"name": "p1", "input_ids": list(range(10, 58))}, headers=_bearer(KEY_A))
    assert ok[0] == 200, ok
    status, body = d.request("PUT", "/cache/pinned", {"name": "p2", "input_ids": list(range(60, 92))},
                             headers=_bearer(KEY_A))
    assert status == 400 and "pin budget" in body["error"]["message"] and "48 pinned" in body["error"]["message"]
    status, body = d.request("PUT", "/cache/pinned", {"name": "p1", "input_ids": list(range(10, 42))},
                             headers=_bearer(KEY_B))
    assert status == 400 and "budget" in body["error"]["message"], body
    status, body = d.request("PUT", "/cache/pinned", {"name": "big", "input_ids": list(range(1, 200)),
                                                      "tenant": "beta"})  # the operator is not bound by budgets
    assert status == 200 and body["tenant"] == "beta", body
    listing = d.get("/cache/pinned")
    assert sorted((p["tenant"], p["name"]) for p in listing["pinned"]) == [("alpha", "p1"), ("beta", "big")]
    assert d.request("DELETE", "/cache/pinned/big?tenant=beta")[0] == 200


# ------------------------------------------------------------------ 4. KV events


def _subscriber(ctx: zmq.Context, address: str, curve: tuple[bytes, bytes, bytes] | None) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if curve is not None:
        sub.curve_serverkey, sub.curve_publickey, sub.curve_secretkey = curve
    sub.connect(address)
    return sub


def _events(sub: zmq.Socket, wait_s: float) -> list[Any]:
    out: list[Any] = []
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            _topic, _seq, payload = sub.recv_multipart()
            out.extend(decode_batch(payload).events)
    return out


def test_kv_events_reach_admitted_subscribers_only_without_tenants_prompts(daemons: DaemonFactory,
                                                                           tmp_path: Path) -> None:
    from hicache.runtime.ipc import load_curve_client

    subscribers = "authorized_subscribers"  # hicache.runtime.ipc.SUBSCRIBERS_DIR, spelt out: the layout is the contract
    keys = tmp_path / "curve"
    write_key_dir(keys)
    write_key_pair(keys, "engine1")  # an engine's key: admitted on the engine socket only
    write_key_pair(keys, "router1")
    (keys / subscribers).mkdir(mode=0o700)
    shutil.move(keys / "authorized_clients" / "router1.key", keys / subscribers / "router1.key")
    port = free_port()
    cfg = _tenants_config(tmp_path)
    cfg["ipc"] = {"curve_keys_dir": str(keys)}
    cfg["events"] = {"enabled": True, "endpoint": f"tcp://*:{port}"}
    d = daemons(cfg)
    address = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    try:
        router = load_curve_client(keys / "server.key", keys / "router1.key_secret")
        engine = load_curve_client(keys / "server.key", keys / "engine1.key_secret")
        subs = {"plain": _subscriber(ctx, address, None),
                "engine key": _subscriber(ctx, address, (engine.server_public, engine.client_public,
                                                         engine.client_secret)),
                "subscriber key": _subscriber(ctx, address, (router.server_public, router.client_public,
                                                             router.client_secret))}
        time.sleep(1.0)  # the handshakes
        _generate(d, KEY_A, PROMPT)
        got = {name: _events(sub, 3.0) for name, sub in subs.items()}
    finally:
        ctx.destroy(linger=0)
    assert got["plain"] == [] and got["engine key"] == [], {k: v[:2] for k, v in got.items()}
    stored = [e for e in got["subscriber key"] if isinstance(e, BlockStored)]
    assert stored, got["subscriber key"]
    for e in stored:  # the pages' hashes, not alpha's prompt or salt
        assert e.token_ids == [] and e.extra_keys is None and len(e.block_hashes) >= 1, e
    assert not any(tenant_salt("alpha", "") in str(e) for e in got["subscriber key"])


# ------------------------------------------------------------------ 6. safe as shipped


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hicache", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=None if env is None else {**os.environ, **env})


def test_serve_refuses_a_non_loopback_bind_without_a_key(tmp_path: Path) -> None:
    path = tmp_path / "open.yaml"
    base = {"model": {"reference": {"preset": "tiny"}}, "server": {"host": "0.0.0.0", "port": free_port()}}
    path.write_text(yaml.safe_dump(base))
    for args in (["check-config", str(path)], ["serve", "--config", str(path)]):
        out = _cli(*args)
        assert out.returncode == 2, (args, out.stdout[-2000:], out.stderr[-2000:])
        assert "server.host:" in out.stderr and "server.allow_unauthenticated" in out.stderr, out.stderr
    for extra in ({"allow_unauthenticated": True}, {"operator": {"key": KEY_OP}}, {"host": "127.0.0.1"}):
        path.write_text(yaml.safe_dump({**base, "server": {**base["server"], **extra}}))
        out = _cli("check-config", str(path))
        assert out.returncode == 0, (extra, out.stderr)
        assert KEY_OP not in out.stdout
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
