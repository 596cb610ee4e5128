"""Redis over TLS, and where its password comes from: real ``redis-server`` processes
listening on TLS only (``--port 0 --tls-port P``), with certificates made by the test.

The test's PKI: a CA, a server certificate signed by it for ``localhost`` / ``127.0.0.1``,
a client certificate signed by it, a server certificate for another host name, and a
second CA nobody uses (the untrusted one). Servers require a password (``requirepass``).

What must hold: a TLS attach works and pages round-trip (standalone and cluster); a wrong
or missing password is a ``StorageAuthError`` saying "authentication failed"; a certificate
the CA does not vouch for is a ``StorageTLSError`` saying "certificate verify failed"; the
password from a file or an environment variable works; ``check-config`` refuses two
password sources and missing files, naming the key; no secret appears in a message, a log
line, ``stats()`` or ``check-config``'s output; and a real daemon refused by the store at
``PUT /cache/storage`` (a store the config names) says why and goes on serving.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from hicache.bench.local_redis import CLUSTER_BUS_OFFSET, CLUSTER_NODE_ARGS, LOG_NAME, find_redis_server
from hicache.bench.loopback_ports import free_port
from hicache.config import ConfigError, config_from_dict, dump_yaml
from hicache.storage_settings import storage_settings_from_config
from storage_backends import (
    RedisSettings,
    ResilienceSettings,
    StorageConfigError,
    StorageUnavailable,
    create_backend,
)
from storage_backends.errors import StorageAuthError, StorageTLSError
from tests.storage.conftest import LAYOUT, buffers, random_hashes, random_pages

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes as crypto_hashes  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "tls-pw-8d1e5c"  # what the servers require
WRONG = "not-the-pw-41b7"
FAST = ResilienceSettings(timeout_s=2.0, failure_threshold=3, probe_base_s=0.05, probe_cap_s=0.5)


# --------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Pki:
    """PEM files: ``ca`` (trusted), ``other_ca`` (never signed anything we serve),
    ``server`` (localhost, 127.0.0.1), ``wrong_host`` (only ``other.invalid``), ``client``."""

    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    wrong_host_cert: Path
    wrong_host_key: Path
    client_cert: Path
    client_key: Path


def _write_pair(d: Path, name: str, key: Any, cert: Any) -> tuple[Path, Path]:
    crt, pem = d / f"{name}.crt", d / f"{name}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    return crt, pem


def _builder(subject: str, issuer: Any, public_key: Any) -> Any:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer).public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _make_ca(d: Path, name: str) -> tuple[Any, Any, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(name, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, crypto_hashes.SHA256()))
    crt, _ = _write_pair(d, name, key, cert)
    return key, cert, crt


def _make_leaf(d: Path, name: str, ca_key: Any, ca_cert: Any, dns: Sequence[str] = (),
               ips: Sequence[str] = ()) -> tuple[Path, Path]:
    """A certificate for TLS servers and clients (cluster nodes use theirs both ways)."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (_builder(name, ca_cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                              critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    names = [x509.DNSName(n) for n in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return _write_pair(d, name, key, builder.sign(ca_key, crypto_hashes.SHA256()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert, ca = _make_ca(d, "ca")
    _k, _c, other = _make_ca(d, "other-ca")
    server = _make_leaf(d, "server", ca_key, ca_cert, dns=["localhost"], ips=["127.0.0.1"])
    wrong = _make_leaf(d, "wrong-host", ca_key, ca_cert, dns=["other.invalid"])
    client = _make_leaf(d, "client", ca_key, ca_cert)
    return Pki(ca, other, *server, *wrong, *client)


# --------------------------------------------------------------------------- TLS servers


class TlsRedis:
    """One TLS-only ``redis-server`` we started (no plain TCP port); ``kill`` ends it."""

    def __init__(self, workdir: Path, pki: Pki, *, cert: tuple[Path, Path] | None = None,
                 auth_clients: bool = False, cluster: bool = False) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.pki = pki
        self.port = free_port(also=CLUSTER_BUS_OFFSET if cluster else None)
        crt, key = cert or (pki.server_cert, pki.server_key)
        self.args = [
            "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", str(workdir), "--logfile", str(workdir / LOG_NAME),
            "--tls-cert-file", str(crt), "--tls-key-file", str(key), "--tls-ca-cert-file", str(pki.ca),
            "--tls-auth-clients", "yes" if auth_clients else "no",
            *((*CLUSTER_NODE_ARGS, "--tls-cluster", "yes") if cluster else ()),
        ]  # fmt: skip
        self.auth_clients = auth_clients
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, host: str = "127.0.0.1") -> str:
        return f"rediss://{host}:{self.port}/0"

    def client(self, password: str | None = PASSWORD) -> redis.Redis:
        """An admin client over TLS (with the client certificate, which every server accepts)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=password, ssl=True,
                           ssl_ca_certs=str(self.pki.ca), ssl_check_hostname=False,
                           ssl_certfile=str(self.pki.client_cert), ssl_keyfile=str(self.pki.client_key),
                           socket_timeout=5, socket_connect_timeout=1)

    def start(self, timeout: float = 10.0, require_password: bool = True) -> None:
        """Start, wait until it answers over TLS, then (``require_password``) require
        ``PASSWORD``."""
        exe = find_redis_server()
        assert exe is not None
        self.proc = subprocess.Popen([exe, *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        with self.client(password=None) as c:
            while True:
                try:
                    if c.info("server").get("process_id") == self.proc.pid:
                        break
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self.log_tail()
                    self.kill()
                    if "tls-port" in log and ("Bad directive" in log or "not supported" in log.lower()):
                        pytest.skip(f"this redis-server was built without TLS: {log[-300:]}")
                    raise RuntimeError(f"TLS redis-server on port {self.port} did not start:\n{log}")
                time.sleep(0.02)
            if require_password:
                c.config_set("requirepass", PASSWORD)

    def log_tail(self) -> str:
        try:
            return (self.workdir / LOG_NAME).read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


def _need_redis() -> None:
    if find_redis_server() is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    _need_redis()
    server = TlsRedis(tmp_path_factory.mktemp("tls-redis"), pki)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def _form_cluster(nodes: Sequence[TlsRedis], timeout: float = 30.0) -> None:
    """What ``redis-cli --cluster create`` does, over TLS: one slot range per node, distinct
    config epochs, MEET; then wait until every node knows all and all slots are assigned."""
    bounds = [16384 * i // len(nodes) for i in range(len(nodes) + 1)]
    clients = [n.client(password=None) for n in nodes]
    try:
        for i, c in enumerate(clients):
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", bounds[i], bounds[i + 1] - 1)
            c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        for n in nodes[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", n.port)
        deadline = time.monotonic() + timeout
        while True:
            infos = [c.cluster("info") for c in clients]
            if all(i["cluster_state"] == "ok" and int(i["cluster_known_nodes"]) == len(nodes)
                   and int(i["cluster_slots_assigned"]) == 16384 for i in infos):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"TLS cluster did not form: {infos}")
            time.sleep(0.05)
        for c in clients:
            c.config_set("requirepass", PASSWORD)
    finally:
        for c in clients:
            c.close()


@pytest.fixture(scope="module")
def tls_cluster(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TlsRedis]]:
    """Three TLS-only masters (client and bus traffic both over TLS), password required."""
    _need_redis()
    base = tmp_path_factory.mktemp("tls-cluster")
    nodes: list[TlsRedis] = []
    try:
        for i in range(3):
            node = TlsRedis(base / f"node{i}", pki, cluster=True)
            nodes.append(node)
            node.start(require_password=False)  # _form_cluster sets it once the cluster formed
        _form_cluster(nodes)
        yield nodes
    finally:
        for n in nodes:
            n.kill()


def _settings(url: str, **kw: Any) -> RedisSettings:
    kw.setdefault("resilience", FAST)
    return RedisSettings(url=url, key_prefix=kw.pop("key_prefix", f"tls{os.urandom(4).hex()}"), **kw)


def _round_trip(settings: RedisSettings, n: int = 24) -> None:
    be = create_backend(settings, LAYOUT)
    try:
        hashes, pages = random_hashes(n), random_pages(n)
        assert be.batch_set(hashes, pages) == [True] * n
        assert be.batch_exists(hashes) == n
        out = buffers(n)
        assert be.batch_get(hashes, out) == [True] * n
        assert [bytes(b) for b in out] == pages
        stats = be.stats()
        assert stats.up and stats.hits == n and stats.errors == 0, stats
    finally:
        be.clear()
        be.close()


# --------------------------------------------------------------------------- attach over TLS


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_tls_attach_round_trips_pages(tls_server: TlsRedis, pki: Pki, host: str) -> None:
    settings = _settings(tls_server.url(host), password=PASSWORD, tls_ca_file=str(pki.ca))
    assert PASSWORD not in repr(settings)
    be = create_backend(settings, LAYOUT)
    try:
        hashes, pages = random_hashes(16), random_pages(16)
        assert be.batch_set(hashes, pages) == [True] * 16
        with tls_server.client() as admin:  # the pages are really on that server, under the prefix
            assert len(list(admin.scan_iter(match=f"{settings.key_prefix}:*"))) == 16
        out = buffers(16)
        assert be.batch_get(hashes, out) == [True] * 16 and [bytes(b) for b in out] == pages
        assert PASSWORD not in be.name and PASSWORD not in repr(be.stats())
    finally:
        be.clear()
        be.close()


def test_tls_cluster_attach_spreads_pages_over_every_node(tls_cluster: list[TlsRedis], pki: Pki) -> None:
    settings = _settings(tls_cluster[0].url(), cluster=True, password=PASSWORD, tls_ca_file=str(pki.ca))
    be = create_backend(settings, LAYOUT)
    try:
        n = 48
        hashes, pages = random_hashes(n), random_pages(n)
        assert be.batch_set(hashes, pages) == [True] * n
        per_node = []
        for node in tls_cluster:
            with node.client() as admin:
                per_node.append(len(list(admin.scan_iter(match=f"{settings.key_prefix}:*"))))
        assert sum(per_node) == n and all(per_node), f"pages per node: {per_node}"
        out = buffers(n)
        assert be.batch_get(hashes, out) == [True] * n and [bytes(b) for b in out] == pages
        assert be.stats().up
    finally:
        be.clear()
        be.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
def test_wrong_password_is_an_authentication_error(request: pytest.FixtureRequest, pki: Pki, cluster: bool,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    url = request.getfixturevalue("tls_cluster")[0].url() if cluster else request.getfixturevalue("tls_server").url()
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StorageAuthError) as info:
        create_backend(_settings(url, cluster=cluster, password=WRONG, tls_ca_file=str(pki.ca)), LAYOUT)
    message = str(info.value)
    assert "authentication failed" in message and "refused the password" in message, message
    assert url.removeprefix("rediss://").split("/")[0] in message, message  # names the store
    assert WRONG not in message and WRONG not in caplog.text


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
def test_untrusted_certificate_is_a_tls_error(request: pytest.FixtureRequest, pki: Pki, cluster: bool) -> None:
    url = request.getfixturevalue("tls_cluster")[0].url() if cluster else request.getfixturevalue("tls_server").url()
    with pytest.raises(StorageTLSError) as info:
        create_backend(_settings(url, cluster=cluster, password=PASSWORD, tls_ca_file=str(pki.other_ca)), LAYOUT)
    assert "certificate verify failed" in str(info.value), info.value
    assert PASSWORD not in str(info.value)


def test_missing_password_says_the_server_requires_one(tls_server: TlsRedis, pki: Pki) -> None:
    with pytest.raises(StorageAuthError, match="authentication failed: the server requires a password"):
        create_backend(_settings(tls_server.url(), tls_ca_file=str(pki.ca)), LAYOUT)


def test_plain_url_to_the_tls_port_cannot_connect(tls_server: TlsRedis) -> None:
    with pytest.raises(StorageUnavailable, match="cannot connect"):
        create_backend(_settings(f"redis://127.0.0.1:{tls_server.port}/0", password=PASSWORD,
                                 resilience=ResilienceSettings(timeout_s=1.0)), LAYOUT)


def test_tls_cluster_round_trip_with_the_password_from_a_file(tls_cluster: list[TlsRedis], pki: Pki,
                                                              tmp_path: Path) -> None:
    secret = tmp_path / "redis.pw"
    secret.write_text(PASSWORD + "\n")
    _round_trip(_settings(tls_cluster[1].url(), cluster=True, password_file=str(secret), tls_ca_file=str(pki.ca)))


def test_hostname_is_checked_unless_turned_off(pki: Pki, tmp_path: Path) -> None:
    _need_redis()
    server = TlsRedis(tmp_path / "wrong-host", pki, cert=(pki.wrong_host_cert, pki.wrong_host_key))
    server.start()
    try:
        with pytest.raises(StorageTLSError, match="certificate verify failed"):
            create_backend(_settings(server.url(), password=PASSWORD, tls_ca_file=str(pki.ca)), LAYOUT)
        # the chain is still verified: only the name check is off
        with pytest.raises(StorageTLSError, match="certificate verify failed"):
            create_backend(_settings(server.url(), password=PASSWORD, tls_ca_file=str(pki.other_ca),
                                     tls_verify_hostname=False), LAYOUT)
        _round_trip(_settings(server.url(), password=PASSWORD, tls_ca_file=str(pki.ca), tls_verify_hostname=False))
    finally:
        server.kill()


def test_client_certificate_for_a_server_that_requires_one(pki: Pki, tmp_path: Path) -> None:
    _need_redis()
    server = TlsRedis(tmp_path / "mtls", pki, auth_clients=True)
    server.start()
    try:
        with pytest.raises(StorageTLSError):
            create_backend(_settings(server.url(), password=PASSWORD, tls_ca_file=str(pki.ca)), LAYOUT)
        _round_trip(_settings(server.url(), password=PASSWORD, tls_ca_file=str(pki.ca),
                              tls_cert_file=str(pki.client_cert), tls_key_file=str(pki.client_key)))
    finally:
        server.kill()


# --------------------------------------------------------------------------- password sources


def test_password_from_a_file_and_from_the_environment(tls_server: TlsRedis, pki: Pki, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "redis.pw"
    secret.write_text(PASSWORD + "\r\n")
    _round_trip(_settings(tls_server.url(), password_file=str(secret), tls_ca_file=str(pki.ca)))
    monkeypatch.setenv("HICACHE_TEST_REDIS_PW", PASSWORD)
    _round_trip(_settings(tls_server.url(), password_env="HICACHE_TEST_REDIS_PW", tls_ca_file=str(pki.ca)))
    monkeypatch.setenv("HICACHE_TEST_REDIS_PW", WRONG)
    with pytest.raises(StorageAuthError, match="authentication failed"):
        create_backend(_settings(tls_server.url(), password_env="HICACHE_TEST_REDIS_PW",
                                 tls_ca_file=str(pki.ca)), LAYOUT)


def test_unreadable_password_sources_are_config_errors_at_attach(tls_server: TlsRedis, pki: Pki, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HICACHE_TEST_NO_SUCH_VAR", raising=False)
    cases = [
        ({"password_file": str(tmp_path / "missing.pw")}, "redis.password_file: cannot read"),
        ({"password_env": "HICACHE_TEST_NO_SUCH_VAR"}, "redis.password_env: environment variable "
                                                        "HICACHE_TEST_NO_SUCH_VAR is not set"),
        ({"tls_ca_file": str(tmp_path / "missing.crt")}, "redis.tls_ca_file: cannot read"),
    ]
    empty = tmp_path / "empty.pw"
    empty.write_text("\n")
    cases.append(({"password_file": str(empty)}, "is empty"))
    for extra, needle in cases:
        kw: dict[str, Any] = {"tls_ca_file": str(pki.ca), **extra}
        with pytest.raises(StorageConfigError) as info:
            create_backend(_settings(tls_server.url(), **kw), LAYOUT)
        assert needle in str(info.value), (extra, str(info.value))


def test_settings_refuse_two_password_sources_and_tls_without_rediss(pki: Pki, tmp_path: Path) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"url": "rediss://h:1/0", "password": "a", "password_file": "/x"}, "password and password_file"),
        ({"url": "rediss://h:1/0", "password_env": "V", "password_file": "/x"}, "password_file and password_env"),
        ({"url": "rediss://u:pw@h:1/0", "password_env": "V"}, "password_env and a password in url"),
        ({"url": "redis://h:1/0", "tls_ca_file": str(pki.ca)}, "needs a rediss:// url"),
        ({"url": "rediss://h:1/0", "tls_key_file": str(pki.client_key)}, "needs redis.tls_cert_file"),
        ({"url": "rediss://h:1/0", "password_file": " "}, "must not be empty"),
    ]
    for kw, needle in cases:
        with pytest.raises(StorageConfigError) as info:
            RedisSettings(**kw)
        assert needle in str(info.value), (kw, str(info.value))
        assert "pw@" not in str(info.value)


def test_config_carries_the_tls_and_password_keys_to_the_backend(pki: Pki, tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD)
    section = {"url": "rediss://127.0.0.1:6380/0", "cluster": True, "password_file": str(secret),
               "tls_ca_file": str(pki.ca), "tls_cert_file": str(pki.client_cert),
               "tls_key_file": str(pki.client_key), "tls_verify_hostname": False}
    cfg = config_from_dict({"cache": {"l3": {"backend": "redis", "redis": section}}})
    s = storage_settings_from_config(cfg.cache.l3)
    assert isinstance(s, RedisSettings)
    assert (s.url, s.cluster, s.password, s.password_file, s.tls_ca_file, s.tls_cert_file, s.tls_key_file,
            s.tls_verify_hostname) == (section["url"], True, None, str(secret), str(pki.ca), str(pki.client_cert),
                                       str(pki.client_key), False)
    assert s.resolve_password() == PASSWORD  # read when the backend attaches, not before


# --------------------------------------------------------------------------- check-config


def _check_config(tmp: Path, redis_section: dict[str, Any],
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump({"cache": {"l3": {"backend": "redis", "redis": redis_section}}}))
    return subprocess.run([sys.executable, "-m", "hicache", "check-config", str(path)], capture_output=True,
                          text=True, cwd=REPO, timeout=120, env={**os.environ, **(env or {})})


def test_check_config_refuses_bad_password_and_tls_keys(pki: Pki, tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD)
    encrypted = tmp_path / "encrypted.key"
    key = ec.generate_private_key(ec.SECP256R1())
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"passphrase")))
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    tls = "rediss://127.0.0.1:6380/0"
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"url": tls, "password": "x", "password_file": str(secret)}, "password_file", "one place only"),
        ({"url": tls, "password_file": str(secret), "password_env": "HICACHE_TEST_PW"}, "password_env",
         "got password_file and password_env"),
        ({"url": tls, "password_file": str(tmp_path / "nope.pw")}, "password_file", "No such file"),
        ({"url": tls, "password_env": "HICACHE_TEST_UNSET_VAR"}, "password_env", "is not set"),
        ({"url": tls, "tls_ca_file": str(tmp_path / "nope.crt")}, "tls_ca_file", "cannot read"),
        ({"url": tls, "tls_ca_file": str(not_pem)}, "tls_ca_file", "no PEM CA certificate"),
        ({"url": "redis://127.0.0.1:6379/0", "tls_ca_file": str(pki.ca)}, "tls_ca_file", "needs a rediss:// url"),
        ({"url": tls, "tls_key_file": str(pki.client_key)}, "tls_key_file", "needs tls_cert_file"),
        ({"url": tls, "tls_cert_file": str(pki.client_cert), "tls_key_file": str(encrypted)}, "tls_key_file",
         "encrypted"),
        ({"url": tls, "tls_cert_file": str(pki.client_cert), "tls_key_file": str(pki.server_key)},
         "tls_cert_file", "do not hold a PEM certificate and its private key"),
    ]
    for section, key, needle in cases:
        out = _check_config(tmp_path, section)
        assert out.returncode == 2, (section, out.stdout, out.stderr)
        line = next((ln for ln in out.stderr.splitlines() if ln.strip().startswith(f"cache.l3.redis.{key}:")), None)
        assert line is not None and needle in line, (section, out.stderr)
        assert PASSWORD not in out.stderr


def test_check_config_accepts_a_tls_config_and_never_prints_the_password(pki: Pki, tmp_path: Path) -> None:
    section = {"url": "rediss://127.0.0.1:6380/0", "password": PASSWORD, "tls_ca_file": str(pki.ca),
               "tls_cert_file": str(pki.client_cert), "tls_key_file": str(pki.client_key)}
    out = _check_config(tmp_path, section)
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)["cache"]["l3"]["redis"]
    assert printed["password"] == "***" and printed["tls_ca_file"] == str(pki.ca)
    assert PASSWORD not in out.stdout + out.stderr
    out = _check_config(tmp_path, {"url": f"rediss://app:{PASSWORD}@127.0.0.1:6380/0"})
    assert out.returncode == 0, out.stderr
    assert PASSWORD not in out.stdout and "rediss://app:***@127.0.0.1:6380/0" in out.stdout
    out = _check_config(tmp_path, {"url": "rediss://127.0.0.1:6380/0", "password_env": "HICACHE_TEST_PW"},
                        env={"HICACHE_TEST_PW": PASSWORD})
    assert out.returncode == 0 and PASSWORD not in out.stdout, out.stderr
    # in-process: the same, and repr never shows it either
    cfg = config_from_dict({"cache": {"l3": {"backend": "redis", "redis": section}}})
    assert PASSWORD not in dump_yaml(cfg) and PASSWORD not in repr(cfg)
    with pytest.raises(ConfigError) as info:
        config_from_dict({"cache": {"l3": {"backend": "redis", "redis": {**section, "password_env": "X"}}}})
    assert PASSWORD not in str(info.value)
    with pytest.raises(ConfigError) as info:  # an unquoted numeric password: refused without quoting it
        config_from_dict({"cache": {"l3": {"backend": "redis", "redis": {"password": 987654}}}})
    assert "cache.l3.redis.password: must be a string" in str(info.value) and "987654" not in str(info.value)
    with pytest.raises(ConfigError) as info:  # a bad URL is quoted without its password
        config_from_dict({"cache": {"l3": {"backend": "redis", "redis": {"url": f"http://u:{PASSWORD}@h/0"}}}})
    assert "http://u:***@h/0" in str(info.value) and PASSWORD not in str(info.value)


# --------------------------------------------------------------------------- a real daemon


def _daemon_config(l3: dict[str, Any], stores: dict[str, Any] | None = None) -> dict[str, Any]:
    """``stores``: ``cache.l3_stores``, what ``PUT /cache/storage`` may attach by name."""
    return {
        "model": {"reference": {"preset": "tiny"}},
        "cache": {"page_size": 4, "l1": {"tokens": 1024}, "l2": {"tokens": 4096}, "l3": l3,
                  "l3_stores": stores or {},
                  "prefetch": {"policy": "wait_complete", "threshold_tokens": 4}},
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512},
        "logging": {"level": "debug"},  # the most a log says: still no secret
    }


def _attach(d: Any, store: str) -> tuple[int, Any]:
    """``PUT /cache/storage`` of ``store``, again while the daemon answers 409 (the last
    request's writes or backups still in flight) for up to 30 s."""
    deadline = time.monotonic() + 30
    while True:
        status, body = d.request("PUT", "/cache/storage", {"store": store})
        if status != 409 or time.monotonic() > deadline:
            return status, body
        time.sleep(0.2)


def test_daemon_refused_by_the_store_at_attach_says_why_and_keeps_serving(tls_server: TlsRedis, pki: Pki,
                                                                         tmp_path: Path) -> None:
    from tests.support.daemon import Daemon

    secret = tmp_path / "redis.pw"
    secret.write_text(PASSWORD + "\n")
    prefix = f"d{os.urandom(4).hex()}"
    base = {"url": tls_server.url(), "key_prefix": prefix, "timeout_s": 1.0}
    stores = {
        "wrong-password": {"backend": "redis", "redis": {**base, "password": WRONG, "tls_ca_file": str(pki.ca)}},
        "other-ca": {"backend": "redis", "redis": {**base, "password_file": str(secret),
                                                   "tls_ca_file": str(pki.other_ca)}},
        "good": {"backend": "redis", "redis": {**base, "password_env": "HICACHE_TEST_REDIS_PW",
                                               "tls_ca_file": str(pki.ca)}},
    }
    d = Daemon(tmp_path, _daemon_config({"backend": "none"}, stores), env={"HICACHE_TEST_REDIS_PW": PASSWORD})
    d.start()
    try:
        prompt = [(i * 7) % 250 + 1 for i in range(130)]
        cold = d.generate(prompt, 6)["output_ids"]
        refusals = [("wrong-password", "authentication failed"), ("other-ca", "certificate verify failed")]
        for store, needle in refusals:
            status, body = _attach(d, store)
            assert status == 500 and needle in body["error"]["message"], (status, body)
            assert WRONG not in str(body) and PASSWORD not in str(body)
            status, body = d.request("GET", "/cache/storage")
            assert status == 200 and body["backend"] == "none", body  # still without L3
            assert d.generate(prompt, 6)["output_ids"] == cold  # and serving

        status, body = _attach(d, "good")
        assert status == 200, body
        fresh = [(i * 11) % 250 + 1 for i in range(130)]
        first = d.generate(fresh, 6)
        with tls_server.client() as admin:
            deadline = time.monotonic() + 30
            while len(list(admin.scan_iter(match=f"{prefix}:*"))) < len(fresh) // 4:
                assert time.monotonic() < deadline, f"pages did not reach the TLS store\n{d.log()}"
                time.sleep(0.2)
        # L2 also holds the first prompt, written before the store was attached (never backed
        # up): wait only for the tier layer's writes and backups to finish (a flush skips
        # nodes with a transfer in flight)
        d.wait_tiers_idle("the fresh prompt's backups done", backed_up=False)
        assert d.request("POST", "/cache/flush")[0] == 200
        again = d.generate(fresh, 6)
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens_details"]["storage"] >= 120, again["meta_info"]
    finally:
        assert d.stop() == 0, d.log()
    log = d.log_path.read_text(errors="replace")
    assert WRONG not in log and PASSWORD not in log


@pytest.mark.parametrize("refusal", ["wrong password", "untrusted certificate"])
def test_daemon_started_with_refused_credentials_serves_without_l3_and_says_why(
        tls_server: TlsRedis, pki: Pki, tmp_path: Path, refusal: str) -> None:
    """At start a store that refuses our credentials does not stop the daemon: it serves
    without L3 (no L3 op is issued), ``GET /cache/storage`` names the cause, the secret is
    in no log line; a later ``PUT /cache/storage`` with the right settings attaches the store."""
    from tests.support.daemon import Daemon

    section = {"url": tls_server.url(), "password": WRONG, "tls_ca_file": str(pki.ca), "timeout_s": 1.0}
    needle = "authentication failed"
    if refusal == "untrusted certificate":
        section = {**section, "password": PASSWORD, "tls_ca_file": str(pki.other_ca)}
        needle = "certificate verify failed"
    good = {**section, "password": PASSWORD, "tls_ca_file": str(pki.ca)}
    d = Daemon(tmp_path, _daemon_config({"backend": "redis", "redis": section},
                                        {"good": {"backend": "redis", "redis": good}}))
    d.start()
    try:
        prompt = [(i * 5) % 250 + 1 for i in range(130)]
        first = d.generate(prompt, 6)
        assert d.request("POST", "/cache/flush")[0] == 200
        again = d.generate(prompt, 6)
        assert again["output_ids"] == first["output_ids"]
        assert again["meta_info"]["cached_tokens_details"]["storage"] == 0  # no L3
        status, body = d.request("GET", "/cache/storage")
        assert status == 200 and body["backend"] == "none" and needle in body["stats"]["attach_error"], body
        status, body = _attach(d, "good")
        assert status == 200 and body["backend"] == "redis" and "attach_error" not in body["stats"], body
    finally:
        assert d.stop() == 0, d.log()
    log = d.log_path.read_text(errors="replace")
    assert needle in log and "serving without L3" in log, log
    assert WRONG not in log and PASSWORD not in log
