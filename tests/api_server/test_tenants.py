"""Tenant API keys (``server.api_keys``): config validation, loading, the effective cache salt,
and a real tokenizer process that authenticates each request and namespaces it by tenant.

The cache itself (hits within a tenant, none across tenants, in L1/L2 and L3) is checked end
to end in ``tests/e2e/test_tenants.py``.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from hicache.api_server.validation import ModelLimits, parse_chat, parse_completion, parse_generate
from hicache.config import ConfigError, config_from_dict, dump_yaml
from hicache.config.security import BearerKey, load_api_keys
from hicache.daemon.startup_checks import startup_problems
from hicache.hashing import HashNamespace, PageHasher
from hicache.tenants import TENANT_SALT_TAG, split_tenant_salt, tenant_salt
from hicache.text import ByteTokenizer

from .fake_scheduler import FakeScheduler
from .harness import TokenizerProcess

REPO = Path(__file__).resolve().parents[2]
KEY_A = "alpha-key-0123456789abcdef"
KEY_A2 = "alpha-rotated-key-fedcba9876543210"
KEY_B = "beta-key-00112233445566778899"
KEY_OP = "operator-key-5a6b7c8d9e0f1a2b"
SECRETS = (KEY_A, KEY_A2, KEY_B, KEY_OP)
TOK = ByteTokenizer()
LIMITS = ModelLimits("m", 512, 512, 256, 16)


def _problems(server: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        config_from_dict({"server": server})
    return {p.path: p.reason for p in info.value.problems}


def _assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text


# --------------------------------------------------------------------------- config


def test_a_valid_api_keys_config_loads_and_hides_its_keys() -> None:
    cfg = config_from_dict({"server": {"api_keys": [
        {"tenant": "alpha", "key": KEY_A}, {"tenant": "alpha", "key_file": "/run/k"},
        {"tenant": "beta", "key_env": "HC_B"}]}})
    entries = cfg.server.api_keys
    assert [e.tenant for e in entries] == ["alpha", "alpha", "beta"]
    assert entries[0].key == KEY_A and entries[1].key_file == "/run/k" and entries[2].key_env == "HC_B"
    _assert_no_secret(repr(cfg))
    dumped = dump_yaml(cfg)
    _assert_no_secret(dumped)
    server = yaml.safe_load(dumped)["server"]
    assert server["api_keys"][0]["key"] == "***" and server["api_keys"][1]["key_file"] == "/run/k"
    assert server["api_keys"][2] == {"tenant": "beta", "key": None, "key_file": None, "key_env": "HC_B",
                                     "quota": None}
    assert config_from_dict({}).server.api_keys == ()


@pytest.mark.parametrize(("server", "path", "needle"), [
    ({"api_key": KEY_A, "api_keys": [{"tenant": "a", "key": KEY_B}]}, "server.api_keys", "not both"),
    ({"api_key": ""}, "server.api_key", "must not be empty"),
    ({"api_keys": [{"key": KEY_A}]}, "server.api_keys[0].tenant", "is required"),
    ({"api_keys": [{"tenant": "", "key": KEY_A}]}, "server.api_keys[0].tenant", "is required"),
    ({"api_keys": [{"tenant": "a b", "key": KEY_A}]}, "server.api_keys[0].tenant", "letters, digits"),
    ({"api_keys": [{"tenant": "-a", "key": KEY_A}]}, "server.api_keys[0].tenant", "starting with"),
    ({"api_keys": [{"tenant": "t" * 65, "key": KEY_A}]}, "server.api_keys[0].tenant", "1 to 64"),
    ({"api_keys": [{"tenant": "Acme", "key": KEY_A}, {"tenant": "acme", "key": KEY_B}]},
     "server.api_keys[1].tenant", "differs only in case"),
    ({"api_keys": [{"tenant": "a"}]}, "server.api_keys[0]", "got none"),
    ({"api_keys": [{"tenant": "a", "key": KEY_A, "key_env": "X"}]}, "server.api_keys[0]", "key and key_env"),
    ({"api_keys": [{"tenant": "a", "key": ""}]}, "server.api_keys[0].key", "must not be empty"),
    ({"api_keys": [{"tenant": "a", "key": KEY_A + " x"}]}, "server.api_keys[0].key", "printable ASCII"),
    ({"api_keys": [{"tenant": "a", "key": KEY_A + "é"}]}, "server.api_keys[0].key", "printable ASCII"),
    ({"api_keys": [{"tenant": "a", "key_file": " "}]}, "server.api_keys[0].key_file", "must not be empty"),
    ({"api_keys": [{"tenant": "a", "key_env": ""}]}, "server.api_keys[0].key_env", "must not be empty"),
    ({"api_keys": [{"tenant": "a", "key": KEY_A}, {"tenant": "b", "key": KEY_A}]},
     "server.api_keys[1].key", "same key as api_keys[0]"),
    ({"api_keys": [{"tenant": "a", "key": 12345}]}, "server.api_keys[0].key", "must be a string"),
    ({"api_keys": [{"tenant": "a", "kee": KEY_A}]}, "server.api_keys[0].kee", "unknown key"),
    ({"api_keys": [KEY_A]}, "server.api_keys[0]", "must be a mapping"),
    ({"api_keys": [{}]}, "server.api_keys[0]", "must give a tenant"),
    ({"api_keys": KEY_A}, "server.api_keys", "must be a list"),
])
def test_bad_api_keys_are_refused_by_path_without_quoting_a_key(server: dict[str, Any], path: str,
                                                                 needle: str) -> None:
    problems = _problems(server)
    assert path in problems, problems
    assert needle in problems[path], problems
    _assert_no_secret("\n".join(problems.values()))


def test_one_tenant_may_have_several_keys() -> None:
    cfg = config_from_dict({"server": {"api_keys": [{"tenant": "a", "key": KEY_A}, {"tenant": "a", "key": KEY_A2}]}})
    keys, problems = load_api_keys(cfg.server)
    assert problems == []
    assert [k.tenant for k in keys] == ["a", "a"]
    assert [k.digest for k in keys] == [hashlib.sha256(s.encode()).digest() for s in (KEY_A, KEY_A2)]
    _assert_no_secret(repr(keys))


def test_the_single_api_key_has_no_tenant() -> None:
    keys, problems = load_api_keys(config_from_dict({"server": {"api_key": KEY_A}}).server)
    assert problems == [] and keys == (BearerKey(None, hashlib.sha256(KEY_A.encode()).digest()),)
    assert load_api_keys(config_from_dict({}).server) == ((), [])


# --------------------------------------------------------------------------- key files and variables


def test_key_files_and_variables_are_read_at_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a2").write_text(KEY_A2 + "\n")
    (tmp_path / "crlf").write_bytes(b"crlf-key-0123456789\r\n")
    monkeypatch.setenv("HC_TEST_KEY_B", KEY_B)
    cfg = config_from_dict({"server": {"api_keys": [
        {"tenant": "alpha", "key": KEY_A}, {"tenant": "alpha", "key_file": str(tmp_path / "a2")},
        {"tenant": "beta", "key_env": "HC_TEST_KEY_B"}, {"tenant": "gamma", "key_file": str(tmp_path / "crlf")}]}})
    keys, problems = load_api_keys(cfg.server)
    assert problems == []
    expected = [("alpha", KEY_A), ("alpha", KEY_A2), ("beta", KEY_B), ("gamma", "crlf-key-0123456789")]
    assert [(k.tenant, k.digest) for k in keys] == [(t, hashlib.sha256(s.encode()).digest()) for t, s in expected]


def test_key_file_and_variable_problems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"empty": "", "newline-only": "\n", "two-lines": f"{KEY_A}\n{KEY_B}\n", "spaces": f"{KEY_B} x\n",
             "dup": KEY_A + "\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "latin1").write_bytes(b"k\xe9y\n")
    monkeypatch.setenv("HC_TEST_EMPTY", "")
    monkeypatch.delenv("HC_TEST_UNSET", raising=False)
    monkeypatch.setenv("HC_TEST_DUP", KEY_A)
    entries = [{"tenant": "a", "key": KEY_A}, *({"tenant": "a", "key_file": str(tmp_path / n)} for n in files),
               {"tenant": "a", "key_file": str(tmp_path / "latin1")},
               {"tenant": "b", "key_file": str(tmp_path / "missing")},
               {"tenant": "b", "key_env": "HC_TEST_EMPTY"}, {"tenant": "b", "key_env": "HC_TEST_UNSET"},
               {"tenant": "b", "key_env": "HC_TEST_DUP"}]
    cfg = config_from_dict({"server": {"api_keys": entries}})
    keys, problems = load_api_keys(cfg.server)
    got = {p.path: p.reason for p in problems}
    assert got == {
        "server.api_keys[1].key_file": f"{tmp_path / 'empty'} is empty (it must hold the key)",
        "server.api_keys[2].key_file": f"{tmp_path / 'newline-only'} is empty (it must hold the key)",
        "server.api_keys[3].key_file": f"{tmp_path / 'two-lines'} holds more than one line (it must hold only the key)",
        "server.api_keys[4].key_file": "the key it holds must be printable ASCII without spaces or control "
                                       "characters (a bearer token)",
        "server.api_keys[5].key_file": "gives the same key as server.api_keys[0]: each key must be given once",
        "server.api_keys[6].key_file": f"{tmp_path / 'latin1'} is not UTF-8 text",
        "server.api_keys[7].key_file": f"cannot read {tmp_path / 'missing'}: No such file or directory",
        "server.api_keys[8].key_env": "environment variable HC_TEST_EMPTY is empty",
        "server.api_keys[9].key_env": "environment variable HC_TEST_UNSET is not set",
        "server.api_keys[10].key_env": "gives the same key as server.api_keys[0]: each key must be given once",
    }
    assert [k.tenant for k in keys] == ["a"]
    # the start checks (check-config and serve) report the same problems
    assert {p.path: p.reason for p in startup_problems(cfg) if p.path.startswith("server.")} == got


def _cli(tmp: Path, command: str, cfg: dict[str, Any], env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = [str(path)] if command == "check-config" else ["--config", str(path)]
    return subprocess.run([sys.executable, "-m", "hicache", command, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env={**os.environ, **(env or {})})


def test_check_config_and_serve_refuse_a_missing_file_and_an_unset_variable(tmp_path: Path) -> None:
    cfg = {"server": {"api_keys": [{"tenant": "a", "key": KEY_A},
                                   {"tenant": "a", "key_file": str(tmp_path / "nowhere")},
                                   {"tenant": "b", "key_env": "HC_TEST_NEVER_SET"}]}}
    for command in ("check-config", "serve"):
        r = _cli(tmp_path, command, cfg)
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert "server.api_keys[1].key_file: cannot read" in r.stderr
        assert "server.api_keys[2].key_env: environment variable HC_TEST_NEVER_SET is not set" in r.stderr
        _assert_no_secret(r.stdout + r.stderr)


def test_check_config_accepts_and_masks(tmp_path: Path) -> None:
    (tmp_path / "a2").write_text(KEY_A2 + "\n")
    cfg = {"server": {"api_keys": [{"tenant": "a", "key": KEY_A}, {"tenant": "a", "key_file": str(tmp_path / "a2")},
                                   {"tenant": "b", "key_env": "HC_TEST_KEY_B"}]}}
    r = _cli(tmp_path, "check-config", cfg, {"HC_TEST_KEY_B": KEY_B})
    assert r.returncode == 0, r.stderr
    _assert_no_secret(r.stdout + r.stderr)
    shown = yaml.safe_load(r.stdout)["server"]["api_keys"]
    assert [e["key"] for e in shown] == ["***", None, None]
    assert shown[2]["key_env"] == "HC_TEST_KEY_B"


# --------------------------------------------------------------------------- the effective salt

ADVERSARIAL_TENANTS = ("alpha", "alph", "a", "alpha2", "beta", "1", "12", "a:b", "a.b", "A")


def _adversarial_salts() -> list[str]:
    """Salts a client could pick to land in another tenant's namespace: empty, other tenants'
    effective salts (whole, or the part after a tag), tags, separators and lengths."""
    out = ["", ":", "::", "\x00", TENANT_SALT_TAG, "5:alpha:", ":alpha:", "alpha", "x\x00extra_key=y"]
    for t in ADVERSARIAL_TENANTS:
        for inner in ("", "x", ":x", "5:alpha:"):
            eff = tenant_salt(t, inner)
            out += [eff, eff[len(TENANT_SALT_TAG):], eff[1:], eff.split(":", 2)[-1], f"{len(t)}:{t}:{inner}"]
    return sorted(set(out))


def test_no_tenant_keeps_todays_salt_and_page_hashes() -> None:
    ns = HashNamespace("model-x", "float32", 4)
    for salt in ("", "tenant-a", TENANT_SALT_TAG + "5:alpha:"):
        assert tenant_salt(None, salt) == salt
    req = parse_generate({"input_ids": list(range(1, 9)), "cache_salt": "s", "extra_key": "k"}, "r", TOK, LIMITS)
    assert req.for_tenant(None) is req
    today = PageHasher(ns.with_salt("s\x00extra_key=k")).hash_pages(list(range(1, 9)))
    assert PageHasher(ns.with_salt(req.for_tenant(None).cache_salt)).hash_pages(list(range(1, 9))) == today


def test_no_client_salt_reaches_another_tenants_namespace() -> None:
    """Over every (tenant, adversarial salt) pair: the effective salts, and so the page-hash
    seeds, are pairwise distinct, and each one names its own tenant and salt."""
    salts = _adversarial_salts()
    pairs = list(itertools.product(ADVERSARIAL_TENANTS, salts))
    effective = {tenant_salt(t, s): (t, s) for t, s in pairs}
    assert len(effective) == len(pairs)
    for eff, pair in effective.items():
        assert split_tenant_salt(eff) == pair
    ns = HashNamespace("model-x", "float32", 4)
    seeds = {ns.with_salt(e).seed() for e in effective}
    assert len(seeds) == len(pairs)


@given(st.text(min_size=1, max_size=12), st.text(max_size=40), st.text(min_size=1, max_size=12),
       st.text(max_size=40))
def test_tenant_salt_is_injective(t1: str, s1: str, t2: str, s2: str) -> None:
    assert split_tenant_salt(tenant_salt(t1, s1)) == (t1, s1)
    if (t1, s1) != (t2, s2):
        assert tenant_salt(t1, s1) != tenant_salt(t2, s2)


def test_every_route_and_every_sample_gets_the_tenant_salt() -> None:
    reqs = [
        parse_generate({"text": "hi", "cache_salt": "c", "extra_key": "k"}, "r", TOK, LIMITS),
        parse_completion({"prompt": "hi", "cache_salt": "c", "n": 3}, "r", TOK, LIMITS),
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "cache_salt": "c"}, "r", TOK, LIMITS),
    ]
    for req in reqs:
        mine = req.for_tenant("beta")
        assert split_tenant_salt(mine.cache_salt) == ("beta", req.cache_salt)
        assert {s.cache_salt for s in mine.samples()} == {mine.cache_salt}
        assert mine.to_message().cache_salt == mine.cache_salt
    assert len(reqs[1].for_tenant("beta").samples()) == 3
    with pytest.raises(ValueError):
        tenant_salt("", "x")


# --------------------------------------------------------------------------- a real tokenizer process


@pytest.fixture
def tenants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, metrics_dir: Path) -> Any:
    (tmp_path / "a2.key").write_text(KEY_A2 + "\n")
    monkeypatch.setenv("HC_TEST_TENANT_KEY_B", KEY_B)  # the spawned process inherits it
    tp = TokenizerProcess(tmp_path, {"server.api_keys": [
        {"tenant": "alpha", "key": KEY_A}, {"tenant": "alpha", "key_file": str(tmp_path / "a2.key")},
        {"tenant": "beta", "key_env": "HC_TEST_TENANT_KEY_B"}], "server.operator": {"key": KEY_OP},
        "logging.level": "debug"})
    fake = FakeScheduler(tp.endpoints)
    try:
        tp.start()
        yield tp, fake
    finally:
        code = tp.stop()
        fake.close()
    assert code == 0, tp.log()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_tokenizer_authenticates_and_namespaces_by_tenant(tenants: Any) -> None:
    tp, fake = tenants
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    refused = [
        tp.post("/generate", body),
        tp.post("/generate", body, headers=_bearer("nope")),
        tp.post("/generate", body, headers=_bearer(KEY_A[:-1])),
        tp.post("/generate", body, headers=_bearer(KEY_A + "x")),
        tp.post("/generate", body, headers={"Authorization": f"Basic {KEY_A}"}),
        tp.post("/generate", body, headers={"Authorization": KEY_A}),
        tp.post("/generate", body, headers={"Authorization": "Bearer \xff\xfe"}),
        tp.get("/v1/models"), tp.get("/cache/stats"), tp.get("/openapi.json"),
    ]
    for r in refused:
        assert r.status == 401, (r.status, r.body)
        assert r.json()["error"]["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
        _assert_no_secret(r.body.decode())
    assert tp.get("/health").status == 200
    assert tp.get("/metrics").status == 401  # per-tenant series: behind the operator's key
    assert tp.get("/metrics", headers=_bearer(KEY_OP)).status == 200
    assert fake.generate_requests() == []

    sent: list[tuple[str, str, dict[str, Any]]] = [
        ("alpha", KEY_A, body),
        ("alpha", KEY_A2, body),  # the rotated key (key_file): the same tenant
        ("beta", KEY_B, body),  # key_env
        ("beta", KEY_B, {**body, "cache_salt": tenant_salt("alpha", "")}),  # imitating alpha's namespace
        ("beta", KEY_B, {**body, "cache_salt": "", "extra_key": "x"}),
    ]
    for _tenant, key, b in sent:
        r = tp.post("/generate", b, headers=_bearer(key))
        assert r.status == 200, r.body
    r = tp.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2},
                headers={"Authorization": f"bearer  {KEY_A} "})
    assert r.status == 200, r.body
    assert tp.get("/v1/models", headers=_bearer(KEY_B)).status == 200
    assert fake.wait_for(lambda f: len(f.generate_requests()) == len(sent) + 2)
    salts = [m.cache_salt for m in fake.generate_requests()]
    assert salts[:len(sent)] == [tenant_salt("alpha", ""), tenant_salt("alpha", ""), tenant_salt("beta", ""),
                                 tenant_salt("beta", tenant_salt("alpha", "")),
                                 tenant_salt("beta", "\x00extra_key=x")]
    assert salts[len(sent):] == [tenant_salt("alpha", "")] * 2  # both samples of the chat request
    assert tenant_salt("alpha", "") not in salts[2:len(sent)]
    log = tp.log()
    assert "for 2 tenant(s): alpha, beta" in log, log
    _assert_no_secret(log)


def test_a_tenant_acts_on_its_own_namespace_and_the_operator_on_everything(tenants: Any) -> None:
    """The role table of ``hicache.api_server.access``: a tenant's ``/cache`` calls reach the
    scheduler scoped to it (``args["tenant"]``), the operator-only routes answer it 403 before
    any reaches the scheduler, and the operator's calls go unscoped."""
    tp, fake = tenants
    admin = [("GET", "/cache/stats", None), ("POST", "/cache/flush", None), ("GET", "/cache/pinned", None),
             ("DELETE", "/cache/pinned/sys", None), ("PUT", "/cache/pinned", {"name": "sys", "input_ids": [1] * 8})]
    for method, path, body in admin:
        r = tp.request(method, path, body, headers=_bearer(KEY_B))
        assert r.status == 200, (path, r.body)
        assert r.json()["args"].get("tenant") == "beta", (path, r.json())
        r = tp.request(method, path, body, headers=_bearer(KEY_OP))
        assert r.status == 200 and "tenant" not in r.json()["args"], (path, r.json())
    pinned = tp.request("PUT", "/cache/pinned", {"name": "sys", "input_ids": [1] * 8}, headers=_bearer(KEY_B)).json()
    assert pinned["args"]["cache_salt"] == tenant_salt("beta", "")
    for_alpha = tp.request("PUT", "/cache/pinned", {"name": "sys", "input_ids": [1] * 8, "tenant": "alpha"},
                           headers=_bearer(KEY_OP)).json()
    assert for_alpha["args"]["cache_salt"] == tenant_salt("alpha", "") and "tenant" not in for_alpha["args"]
    gone = tp.request("DELETE", "/cache/pinned/sys?tenant=alpha", headers=_bearer(KEY_OP)).json()
    assert gone["args"] == {"name": "sys", "owner": "alpha"}

    before = len(fake.received)
    forbidden = [("GET", "/metrics", None), ("GET", "/cache/storage", None), ("DELETE", "/cache/storage", None),
                 ("PUT", "/cache/storage", {"store": "default"}), ("POST", "/cache/storage/clear", None),
                 ("PUT", "/cache/pinned", {"name": "x", "input_ids": [1] * 8, "tenant": "beta"}),
                 ("DELETE", "/cache/pinned/sys?tenant=beta", None)]
    for method, path, body in forbidden:
        r = tp.request(method, path, body, headers=_bearer(KEY_A))
        assert r.status == 403 and r.json()["error"]["type"] == "permission_error", (path, r.status, r.body)
    assert len(fake.received) == before, "a refused call reached the scheduler"
    for method, path, body in forbidden[:5]:
        assert tp.request(method, path, body, headers=_bearer(KEY_OP)).status == 200, path


def test_the_operators_key_is_checked_and_loaded_like_the_tenants(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``server.operator``: one source, never beside ``server.api_key``, never a tenant's key;
    loaded as a key without a tenant (the operator's), from a file or a variable."""
    def problems(server: dict[str, Any]) -> dict[str, str]:
        with pytest.raises(ConfigError) as exc:
            config_from_dict({"server": server})
        return {p.path: p.reason for p in exc.value.problems}

    assert "already the operator's key" in problems({"api_key": KEY_A, "operator": {"key": KEY_OP}})["server.operator"]
    assert "its own" in problems({"api_keys": [{"tenant": "a", "key": KEY_A}], "operator": {"key": KEY_A}})[
        "server.operator.key"]
    assert "exactly one" in problems({"operator": {"key": KEY_OP, "key_env": "X"}})["server.operator"]
    assert problems({"operator": {"key_file": " "}})["server.operator.key_file"] == "must not be empty"
    key_file = tmp_path / "op.key"
    key_file.write_text(KEY_OP + "\n")
    monkeypatch.setenv("HC_TEST_OP", KEY_A)
    cfg = config_from_dict({"server": {"api_keys": [{"tenant": "a", "key": KEY_A}],
                                       "operator": {"key_file": str(key_file)}}})
    keys, errors = load_api_keys(cfg.server)
    assert errors == [] and keys == (BearerKey("a", hashlib.sha256(KEY_A.encode()).digest()),
                                     BearerKey(None, hashlib.sha256(KEY_OP.encode()).digest()))
    same = config_from_dict({"server": {"api_keys": [{"tenant": "a", "key": KEY_A}], "operator": {"key_env": "HC_TEST_OP"}}})
    _keys, errors = load_api_keys(same.server)
    assert [(p.path, p.reason) for p in errors] == [
        ("server.operator.key_env", "gives the same key as server.api_keys[0]: each key must be given once")]
    assert KEY_OP not in dump_yaml(config_from_dict({"server": {"operator": {"key": KEY_OP}}}))
