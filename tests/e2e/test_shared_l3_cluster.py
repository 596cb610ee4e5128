"""Many daemons, one L3: real daemons sharing a local 3-master Redis Cluster.

Four small daemons run against the same cluster and key prefix: A and B serve the same
model; C the same preset with another seed (another weights digest, so another model
fingerprint); D the same model in bfloat16 (another KV dtype). Page keys are the chained
page hashes of docs/architecture.md §6, namespaced by fingerprint and KV dtype, so:

- B is served from L3 what only A computed, with A's (cold) greedy outputs;
- C and D never hit pages of A, and their own pages land beside A's under new keys;
- a master SIGKILLed while requests flow costs exactly the hits its slots held: a prompt's
  L3 hit is its leading run of pages whose keys hash (``CLUSTER KEYSLOT``) to a live master,
  and every request still succeeds.

The expected hits are counted from the store itself: the prompt's page keys are recovered
from the keys in the cluster by walking the hash chain (``h_i = SHA-256(h_{i-1} || page
tokens)``), then mapped to masters by key slot, without asking any daemon.
"""

from __future__ import annotations

import hashlib
import random
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from redis.crc import key_slot

from hicache.bench.local_redis import RedisProcess, find_redis_cli, started_cluster
from tests.support.daemon import Daemon, check_stopped_cleanly
from tests.support.redis_servers import REDIS_SERVER

PAGE = 4
PREFIX = "shared"
PROMPT_PAGES = 32
PROMPT_LEN = PROMPT_PAGES * PAGE + 2  # not a multiple of the page: every full page is matchable


def _config(url: str, *, seed: int = 0, dtype: str = "float32") -> dict[str, Any]:
    return {
        "model": {"dtype": dtype, "reference": {"preset": "tiny", "seed": seed}},
        "cache": {
            "page_size": PAGE, "l1": {"tokens": 1024}, "l2": {"tokens": 4096},
            "l3": {"backend": "redis", "redis": {"url": url, "cluster": True, "key_prefix": PREFIX,
                                                 "timeout_s": 0.5}},
            # Hold each request until its L3 prefetch is done, and use a hit of any length
            # (even one page), so a hit count is exact.
            "prefetch": {"policy": "wait_complete", "threshold_tokens": PAGE},
            "load_back_threshold": 0,
        },
        "scheduler": {"chunked_prefill_tokens": 256, "max_prefill_tokens": 512, "max_running_requests": 8},
        "logging": {"level": "warning"},
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProcess]]:
    if REDIS_SERVER is None or find_redis_cli() is None:
        pytest.skip("redis-server / redis-cli not installed (apt-get install redis-server)")
    with started_cluster(tmp_path_factory.mktemp("cluster")) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def fleet(cluster: list[RedisProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Daemon]]:
    """A, B (same model), C (seed 1), D (bfloat16): started together, stopped together;
    each must exit 0 leaving no process or shared memory behind."""
    tmp = tmp_path_factory.mktemp("fleet")
    url = cluster[0].url
    configs = {"a": _config(url), "b": _config(url), "c": _config(url, seed=1), "d": _config(url, dtype="bfloat16")}
    made = {name: Daemon(tmp, cfg, name) for name, cfg in configs.items()}
    pids: dict[str, dict[str, int]] = {}
    try:
        for d in made.values():
            d.launch()  # all at once: the start is most of this file's time
        for name, d in made.items():
            d.wait_healthy()
            pids[name] = d.pids()
        yield made
    finally:
        problems = []
        for name, d in made.items():
            if d.proc is None:
                continue
            try:
                code = d.stop()
                check_stopped_cleanly(d, code, pids.get(name, {}))
            except Exception as exc:  # report every daemon's problem, not just the first
                problems.append(f"{name}: {exc}")
            finally:
                d.kill_all()
        assert not problems, "\n\n".join(problems)


# --------------------------------------------------------------------------- helpers


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 250) for _ in range(PROMPT_LEN)]


def _complete(d: Daemon, ids: list[int], n: int = 6) -> dict[str, Any]:
    status, body = d.request("POST", "/v1/completions", {"prompt": ids, "max_tokens": n, "temperature": 0})
    assert status == 200, f"/v1/completions: {status} {body}\n{d.log()}"
    return body


def _text(body: dict[str, Any]) -> str:
    return body["choices"][0]["text"]


def _storage(body: dict[str, Any]) -> int:
    return int(body["usage"]["cached_tokens_details"]["storage"])


def _cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def _storage_metric(d: Daemon) -> float:
    for family in text_string_to_metric_families(d.get_text("/metrics")):
        for s in family.samples:
            if s.name == "hicache_cached_tokens_total" and s.labels.get("tier") == "storage":
                return float(s.value)
    raise AssertionError(f"no hicache_cached_tokens_total{{tier=storage}} in /metrics of {d.dir.name}")


def _keys(nodes: list[RedisProcess]) -> set[str]:
    """Every page hash under ``PREFIX`` on the live masters."""
    out: set[str] = set()
    for n in nodes:
        if n.proc is None:
            continue
        with n.client() as c:
            out.update(k.decode()[len(PREFIX) + 1:] for k in c.scan_iter(match=f"{PREFIX}:*", count=1000))
    return out


def _chain(tokens: list[int], keys: set[str]) -> list[str] | None:
    """The page hashes of ``tokens`` as found in ``keys``, in prompt order; None until all
    its full pages are there. The chain's start is the one key whose successor (with the
    second page's tokens) is also a key: the namespace seed is not needed."""
    pages = [struct.pack(f"<{PAGE}I", *tokens[i:i + PAGE]) for i in range(0, len(tokens) - PAGE + 1, PAGE)]

    def step(h: str, page: bytes) -> str:
        return hashlib.sha256(bytes.fromhex(h) + page).hexdigest()

    heads = [h for h in keys if step(h, pages[1]) in keys]
    for head in heads:
        chain = [head]
        while len(chain) < len(pages) and step(chain[-1], pages[len(chain)]) in keys:
            chain.append(step(chain[-1], pages[len(chain)]))
        if len(chain) == len(pages):
            return chain
    return None


def _wait_chains(prompts: list[list[int]], nodes: list[RedisProcess], d: Daemon,
                 timeout_s: float = 40.0) -> list[list[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        keys = _keys(nodes)
        chains = [_chain(p, keys) for p in prompts]
        if all(c is not None for c in chains):
            return chains  # type: ignore[return-value]
        assert time.monotonic() < deadline, f"pages not all backed up to the cluster\n{d.log()}"
        time.sleep(0.3)


def _slot_owners(nodes: list[RedisProcess]) -> list[int]:
    """The port of the master owning each of the 16384 slots."""
    owner = [0] * 16384
    with nodes[0].client() as c:
        for lo, hi, master, *_replicas in c.execute_command("CLUSTER", "SLOTS"):
            for slot in range(int(lo), int(hi) + 1):
                owner[slot] = int(master[1])
    return owner


def _owner(h: str, owners: list[int]) -> int:
    return owners[key_slot(f"{PREFIX}:{h}".encode())]


# --------------------------------------------------------------------------- tests


def test_same_model_shares_pages_across_daemons(fleet: dict[str, Daemon], cluster: list[RedisProcess]) -> None:
    a, b = fleet["a"], fleet["b"]
    rng = random.Random(21)
    prompts = [_prompt(rng) for _ in range(3)]
    cold = [_complete(a, p) for p in prompts]
    assert all(_cached(c) == 0 for c in cold), [c["usage"] for c in cold]
    chains = _wait_chains(prompts, cluster, a)
    masters = {_owner(h, _slot_owners(cluster)) for chain in chains for h in chain}
    assert len(masters) == 3, f"pages on {len(masters)} masters only"  # really spread over the cluster
    before = _storage_metric(b)
    for p, c in zip(prompts, cold, strict=True):
        served = _complete(b, p)
        assert _text(served) == _text(c), f"B's output differs from A's cold one\n{b.log()}"
        assert _storage(served) == PROMPT_PAGES * PAGE, served["usage"]  # every full page, from L3
        assert _cached(served) == PROMPT_PAGES * PAGE, served["usage"]
    assert _storage_metric(b) - before == 3 * PROMPT_PAGES * PAGE


@pytest.mark.parametrize("name", ["c", "d"], ids=["other-seed", "bfloat16-kv"])
def test_other_model_or_kv_dtype_never_shares(fleet: dict[str, Daemon], cluster: list[RedisProcess],
                                              name: str) -> None:
    a, other = fleet["a"], fleet[name]
    rng = random.Random(22 if name == "c" else 23)
    prompt = _prompt(rng)
    _complete(a, prompt)
    _wait_chains([prompt], cluster, a)
    keys_before = _keys(cluster)
    before = _storage_metric(other)
    out = _complete(other, prompt)
    assert _cached(out) == 0 and _storage(out) == 0, f"{name} hit pages of another model: {out['usage']}"
    assert _storage_metric(other) == before
    # Same store, own keys: its pages of the same prompt arrive beside A's, under other hashes.
    deadline = time.monotonic() + 30
    while len(_keys(cluster) - keys_before) < PROMPT_PAGES:
        assert time.monotonic() < deadline, f"{name}'s pages did not reach the cluster\n{other.log()}"
        time.sleep(0.3)
    assert _chain(prompt, keys_before) is not None  # A's chain untouched


def test_a_master_killed_mid_traffic_costs_only_its_slots(fleet: dict[str, Daemon],
                                                          cluster: list[RedisProcess]) -> None:
    a, b = fleet["a"], fleet["b"]
    rng = random.Random(24)
    prompts = [_prompt(rng) for _ in range(6)]
    cold = [_complete(a, p) for p in prompts]
    chains = _wait_chains(prompts, cluster, a)
    owners = _slot_owners(cluster)
    homes = [[_owner(h, owners) for h in chain] for chain in chains]

    def leading_run(home: list[int], dead: int) -> int:
        return next((i for i, port in enumerate(home) if port == dead), len(home))

    # The victim: the master whose loss leaves the most hits (so there is something left to see).
    victim = max((n for n in cluster), key=lambda n: sum(leading_run(h, n.port) for h in homes))
    expected = [leading_run(h, victim.port) * PAGE for h in homes]
    assert sum(expected) > 0 and min(expected) < PROMPT_PAGES * PAGE, expected

    failures: list[str] = []
    stop = threading.Event()
    sent = [0]

    def traffic() -> None:  # fresh prompts through B: new pages to back up, some to the victim
        local = random.Random(25)
        while not stop.is_set():
            ids = [local.randrange(1, 250) for _ in range(40)]
            status, body = b.request("POST", "/v1/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0})
            sent[0] += 1
            if status != 200:
                failures.append(f"{status} {body}")

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        time.sleep(1.0)
        victim.kill()
        time.sleep(2.0)
    finally:
        stop.set()
        worker.join(60)
    assert not worker.is_alive(), "traffic did not finish"
    assert not failures and sent[0] >= 2, (sent[0], failures[:3], b.log())

    with redis.Redis(port=next(n.port for n in cluster if n is not victim)) as c:
        for chain in chains:  # the slot map used above is the cluster's: CLUSTER KEYSLOT agrees
            assert c.execute_command("CLUSTER", "KEYSLOT", f"{PREFIX}:{chain[0]}") == key_slot(
                f"{PREFIX}:{chain[0]}".encode())
    for p, c, want in zip(prompts, cold, expected, strict=True):
        served = _complete(b, p)
        assert _text(served) == _text(c), f"output changed with a master down\n{b.log()}"
        assert _storage(served) == want, (f"expected the {want // PAGE} leading pages on live masters from L3, "
                                          f"got {served['usage']}\n{b.log()}")
