"""Validation: the checks that need more than one key's type (ranges, relations between
sections, the machine's RAM, the tenants' quotas against the cache). ``validate(cfg)``
returns every problem; ``loading`` raises them together. What needs the model or the host
is ``hicache.daemon.startup_checks``. See docs/architecture.md §10.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hicache.config.schema import (
    DEFAULT_STORE,
    DEVICES,
    PIN_NAME_RE,
    STORE_NAME_RE,
    ConfigProblem,
    HicacheConfig,
    L3Config,
)
from hicache.config.security import (
    api_key_problems,
    events_endpoint_host,
    has_keys,
    is_loopback_host,
    redis_secret_problems,
    redis_url_problem,
)
from hicache.config.sizing import (
    MIN_L1_STATE_SLOTS,
    STATE_SLOTS_PER_REQUEST,
    kv_bytes_per_token,
    power_of_two,
    swa_min_pages,
)


def _validate_swa_pools(cfg: HicacheConfig, bad: Callable[[str, str], None]) -> None:
    """``cache.l1.swa_tokens`` / ``cache.l2.swa_tokens``: positive page multiples, at most
    the Full pool of their tier; L1's large enough for one prefilling request (reference
    models, whose window is known here; the scheduler refuses a request that needs more)."""
    c, ps = cfg.cache, cfg.cache.page_size
    for tier, value, full in (("l1", c.l1.swa_tokens, c.l1.tokens), ("l2", c.l2.swa_tokens, c.l2.tokens)):
        path = f"cache.{tier}.swa_tokens"
        if value is None or (tier == "l2" and not c.l2.enabled):
            continue
        if value <= 0:
            bad(path, f"must be > 0, got {value}")
        elif ps > 0 and value % ps:
            bad(path, f"must be a multiple of cache.page_size ({ps}), got {value}")
        elif value > full > 0:
            bad(path, f"must be <= cache.{tier}.tokens ({full}): the SWA pool never needs more pages "
                      f"than the Full pool, got {value}")
    ref = cfg.model.reference
    window, value = ref.sliding_window, c.l1.swa_tokens
    if (cfg.model.kind == "reference" and "swa" in (ref.layers or ()) and window and window > 0 and value
            and power_of_two(ps) and value % ps == 0 and value < c.l1.tokens):
        chunk = min(cfg.scheduler.chunked_prefill_tokens, cfg.scheduler.max_prefill_tokens)
        need = swa_min_pages(window, max(chunk, 1), ps) * ps
        if value < need:
            bad("cache.l1.swa_tokens", f"must hold one prefilling request's SWA pages and its match's window "
                                       f"(the sliding window {window} three times + one prefill chunk of "
                                       f"{chunk} + two pages): at least {need} tokens, got {value}")


@dataclass
class _Checks:
    """The problems one ``validate`` call finds, and the checks every section uses."""

    out: list[ConfigProblem] = field(default_factory=list)

    def bad(self, path: str, reason: str) -> None:
        self.out.append(ConfigProblem(path, reason))

    def positive(self, path: str, value: int | float) -> None:
        if value <= 0:
            self.bad(path, f"must be > 0, got {value}")

    def non_negative(self, path: str, value: int | float | None) -> None:
        if value is not None and value < 0:
            self.bad(path, f"must be >= 0, got {value}")


def validate(cfg: HicacheConfig) -> list[ConfigProblem]:
    """Checks that need more than one key's type: ranges, relations, the machine's RAM."""
    ck = _Checks()
    for check in (_check_model, _check_events, _check_cache, _check_l3, _check_scheduler, _check_server,
                  _check_engine):
        check(cfg, ck)
    return ck.out


def _check_model(cfg: HicacheConfig, ck: _Checks) -> None:
    """The checks of the model and the device."""
    m = cfg.model
    if m.kind == "hf" and not m.path:
        ck.bad("model.path", "is required when model.kind is hf")
    ref = m.reference
    for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                 "vocab_size", "sliding_window", "mamba_state_size", "max_context"):
        ck.positive(f"model.reference.{name}", getattr(ref, name))
    if ref.layers is not None and not ref.layers:
        ck.bad("model.reference.layers", "must name at least one layer")
    if ref.num_heads and ref.num_kv_heads and ref.num_heads % ref.num_kv_heads:
        ck.bad("model.reference.num_kv_heads",
               f"must divide num_heads ({ref.num_heads}), got {ref.num_kv_heads}")
    if ref.vocab_size is not None and m.kind == "reference" and not cfg.tokenizer.path and ref.vocab_size < 260:
        ck.bad("model.reference.vocab_size", "must be >= 260 for the built-in byte-level tokenizer")
    ck.non_negative("model.reference.seed", ref.seed)

    dev = cfg.device
    if dev not in DEVICES:
        ck.bad("device", f"must be auto or cpu; got {dev!r} (cuda / cuda:N are not supported by this build: "
               "L1 lives in host memory)")


def _check_events(cfg: HicacheConfig, ck: _Checks) -> None:
    """The checks of ``events``."""
    ev = cfg.events
    if ev.enabled:
        ck.positive("events.replay_batches", ev.replay_batches)
        for key, endpoint in (("events.endpoint", ev.endpoint), ("events.replay_endpoint", ev.replay_endpoint)):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                ck.bad(key, f"must be a ZeroMQ endpoint (tcp://HOST:PORT, tcp://*:PORT or ipc://PATH), got {endpoint!r}")
        if ev.replay_endpoint is not None and ev.replay_endpoint == ev.endpoint:
            ck.bad("events.replay_endpoint", "must differ from events.endpoint")
        if ev.journal is not None and cfg.cache.l3.backend == "none":
            ck.bad("events.journal", "keeps what L3 holds across restarts: it needs an L3 (cache.l3.backend)")
        if ev.journal is not None and not ev.journal.strip():
            ck.bad("events.journal", "must be a file path (or null)")
        curve = bool(cfg.ipc.curve_keys_dir) and not ev.allow_insecure_tcp
        for key, endpoint in (("events.endpoint", ev.endpoint), ("events.replay_endpoint", ev.replay_endpoint)):
            host = None if endpoint is None else events_endpoint_host(endpoint)
            if host is None or is_loopback_host(host) or ev.allow_insecure_tcp:
                continue
            if not (curve and (ev.bind or key == "events.replay_endpoint")):
                ck.bad(key, f"{endpoint!r} reaches beyond this host without CURVE: the events carry page hashes "
                            "(and, with events.tenant_content, prompts). Bind it to loopback, give the daemon CURVE "
                            "keys (ipc.curve_keys_dir; subscribers need keys from `hicache keygen --subscriber`), "
                            "or set events.allow_insecure_tcp: true for a trusted network")


def _check_cache(cfg: HicacheConfig, ck: _Checks) -> None:
    """The checks of ``cache`` (L1, L2, the write and prefetch policies)."""
    c = cfg.cache
    engine = cfg.engine.kind != "builtin"  # the page is the engines' block (a hybrid's need not be a power of two)
    page_ok = c.page_size > 0 and (engine or power_of_two(c.page_size))
    if not page_ok:
        ck.bad("cache.page_size", f"must be {'positive' if engine else 'a power of two'}, got {c.page_size}")
    ck.positive("cache.l1.tokens", c.l1.tokens)
    ck.positive("cache.l2.tokens", c.l2.tokens)
    if page_ok:
        if c.l1.tokens % c.page_size and not engine:
            ck.bad("cache.l1.tokens", f"must be a multiple of cache.page_size ({c.page_size}), got {c.l1.tokens}")
        if c.l2.tokens % c.page_size:
            ck.bad("cache.l2.tokens", f"must be a multiple of cache.page_size ({c.page_size}), got {c.l2.tokens}")
    _validate_swa_pools(cfg, ck.bad)
    if c.l1.state_slots < MIN_L1_STATE_SLOTS:
        ck.bad("cache.l1.state_slots", f"must be >= {MIN_L1_STATE_SLOTS} (a running request of a Mamba model "
               f"holds up to {STATE_SLOTS_PER_REQUEST} besides the cached state it matched), got {c.l1.state_slots}")
    ck.non_negative("cache.l2.state_slots", c.l2.state_slots)
    ck.non_negative("cache.mamba_branch_interval", c.mamba_branch_interval)
    if page_ok and not engine and c.mamba_branch_interval % c.page_size:
        ck.bad("cache.mamba_branch_interval",
               f"must be a multiple of cache.page_size ({c.page_size}), got {c.mamba_branch_interval}")
    if c.l2.enabled and 0 < c.l2.tokens < c.l1.tokens and cfg.engine.kind == "builtin":
        ck.bad("cache.l2.tokens", f"must be >= cache.l1.tokens ({c.l1.tokens}) when L2 is enabled")
    if c.l3.backend != "none" and not c.l2.enabled:
        ck.bad("cache.l3.backend", "an L3 backend needs cache.l2.enabled: true (L3 is read into and written from L2)")
    per_token = kv_bytes_per_token(cfg)
    if c.l2.enabled and per_token is not None and c.l2.tokens > 0:
        import psutil

        need = c.l2.tokens * per_token
        avail = psutil.virtual_memory().available
        if need > avail:
            ck.bad("cache.l2.tokens",
                   f"needs {need / 2**30:.1f} GiB of host memory, but only {avail / 2**30:.1f} GiB is available")
    if c.write_through_threshold < 1:
        ck.bad("cache.write_through_threshold", f"must be >= 1, got {c.write_through_threshold}")
    ck.non_negative("cache.load_back_threshold", c.load_back_threshold)
    _check_pinned(cfg, ck)
    p = c.prefetch
    ck.non_negative("cache.prefetch.threshold_tokens", p.threshold_tokens)
    ck.non_negative("cache.prefetch.timeout_base_s", p.timeout_base_s)
    ck.non_negative("cache.prefetch.timeout_per_ki_token_s", p.timeout_per_ki_token_s)
    if not 0.0 < p.max_reserved_fraction <= 1.0:
        ck.bad("cache.prefetch.max_reserved_fraction", f"must be in (0, 1], got {p.max_reserved_fraction}")


def _check_pinned(cfg: HicacheConfig, ck: _Checks) -> None:
    """``cache.pinned`` and ``cache.pinned_fraction``; the sizes are checked when the
    scheduler takes each pin (they need the tokenizer)."""
    c = cfg.cache
    if not 0.0 < c.pinned_fraction <= 0.9:
        ck.bad("cache.pinned_fraction", f"must be in (0, 0.9] (running requests need the rest), got {c.pinned_fraction}")
    engine = cfg.engine.kind != "builtin"
    tenants = {k.tenant for k in cfg.server.api_keys if k.tenant is not None}
    seen: set[str] = set()
    for i, p in enumerate(c.pinned):
        path = f"cache.pinned[{i}]"
        if not PIN_NAME_RE.match(p.name):
            ck.bad(f"{path}.name", f"must be 1-64 letters, digits, '.', '_' or '-' (first a letter or digit), "
                                   f"got {p.name!r}")
        elif p.name in seen:
            ck.bad(f"{path}.name", f"{p.name!r} is pinned twice")
        seen.add(p.name)
        if engine and (p.text is not None or p.tenant is not None or (p.tiers is not None and list(p.tiers) != ["l2"])):
            ck.bad(path, "in engine mode a pin gives token_ids (this daemon has no tokenizer of the engines' model), "
                         "no tenant, and tiers [l2] or none (the engines keep L1)")
        elif (p.text is None) == (p.token_ids is None):
            ck.bad(path, "give exactly one of text and token_ids")
        elif p.text is not None and not p.text:
            ck.bad(f"{path}.text", "must not be empty")
        elif p.token_ids is not None and (not p.token_ids or any(t < 0 for t in p.token_ids)):
            ck.bad(f"{path}.token_ids", "must be a non-empty list of token ids")
        if p.tiers is None:
            pass
        elif not p.tiers or len(set(p.tiers)) != len(p.tiers) or any(t not in ("l1", "l2") for t in p.tiers):
            ck.bad(f"{path}.tiers", f"must be a non-empty subset of [l1, l2], got {list(p.tiers)}")
        elif "l2" in p.tiers and not c.l2.enabled:
            ck.bad(f"{path}.tiers", "names l2, but cache.l2.enabled is false")
        if p.tenant is not None and p.tenant not in tenants:
            ck.bad(f"{path}.tenant", f"{p.tenant!r} is not a tenant of server.api_keys")
        elif p.tenant is None and tenants:
            ck.bad(f"{path}.tenant", "is required with server.api_keys: every request is then a tenant's, and a "
                                     "pin without one would never be hit")


def _check_l3(cfg: HicacheConfig, ck: _Checks) -> None:
    """The checks of ``cache.l3`` and of each store ``cache.l3_stores`` names (each as
    ``cache.l3`` is checked, its password and TLS files read; and, like it, fit for the
    tenants' L3 quotas)."""
    c = cfg.cache
    _check_l3_section(c.l3, "cache.l3", ck, in_use=c.l3.backend == "redis")
    for name, store in c.l3_stores.items():
        path = f"cache.l3_stores.{name}"
        if not STORE_NAME_RE.match(name) or name == DEFAULT_STORE:
            ck.bad(path, f"a store name is 1-64 letters, digits, '.', '_' or '-' (first a letter or digit), and "
                         f"not {DEFAULT_STORE!r} (the name of cache.l3 itself)")
            continue
        if store.backend == "none":
            ck.bad(f"{path}.backend", "must name a store (DELETE /cache/storage detaches)")
            continue
        if not c.l2.enabled:
            ck.bad(path, "an L3 store needs cache.l2.enabled: true (L3 is read into and written from L2)")
        _check_l3_section(store, path, ck, in_use=store.backend == "redis")
        swapped = dataclasses.replace(cfg, cache=dataclasses.replace(c, l3=store))
        for key, reason in quota_problems(swapped):
            if key.endswith(".l3_gb") or "l3_gb" in reason:
                ck.bad(path, f"{key}: {reason}")


def _check_l3_section(l3: L3Config, path: str, ck: _Checks, in_use: bool) -> None:
    """The checks of one ``cache.l3``-shaped section at ``path``."""
    from hicache.storage_settings import l3_problems

    for key, reason in l3_problems(l3):
        ck.bad(f"{path}.{key}", reason)
    if l3.backend == "file":
        ck.positive(f"{path}.file.max_size_gb", l3.file.max_size_gb)
        ck.positive(f"{path}.file.timeout_s", l3.file.timeout_s)
        if not l3.file.dir:
            ck.bad(f"{path}.file.dir", "must not be empty")
    r = l3.redis
    if l3.backend == "redis":
        problem = redis_url_problem(r.url)
        if problem:
            ck.bad(f"{path}.redis.url", problem)
    ck.positive(f"{path}.redis.timeout_s", r.timeout_s)
    if r.ttl_s is not None:
        ck.positive(f"{path}.redis.ttl_s", r.ttl_s)
    if not r.key_prefix or any(ch.isspace() for ch in r.key_prefix):
        ck.bad(f"{path}.redis.key_prefix", f"must be a non-empty string without spaces, got {r.key_prefix!r}")
    for key, reason in redis_secret_problems(r, check_files=in_use):
        ck.bad(f"{path}.redis.{key}", reason)


def _check_scheduler(cfg: HicacheConfig, ck: _Checks) -> None:
    """The checks of ``scheduler``."""
    c = cfg.cache
    s = cfg.scheduler
    for name in ("max_running_requests", "max_prefill_tokens", "chunked_prefill_tokens",
                 "default_max_new_tokens", "max_new_tokens_limit"):
        ck.positive(f"scheduler.{name}", getattr(s, name))
    if s.default_max_new_tokens > s.max_new_tokens_limit:
        ck.bad("scheduler.default_max_new_tokens",
               f"must be <= scheduler.max_new_tokens_limit ({s.max_new_tokens_limit})")
    if power_of_two(c.page_size) and s.chunked_prefill_tokens % c.page_size:
        ck.bad("scheduler.chunked_prefill_tokens",
               f"must be a multiple of cache.page_size ({c.page_size}), got {s.chunked_prefill_tokens}")


def _check_server(cfg: HicacheConfig, ck: _Checks) -> None:
    """The checks of ``server`` and ``ipc``."""
    if not 0 <= cfg.server.port <= 65535:
        ck.bad("server.port", f"must be in 0..65535, got {cfg.server.port}")
    if not cfg.server.host:
        ck.bad("server.host", "must not be empty")
    if cfg.server.health_stale_s < 1.0:
        ck.bad("server.health_stale_s",
               f"must be >= 1.0 (heartbeats are written every 0.25 s), got {cfg.server.health_stale_s}")
    freeze = cfg.server.controller_freeze_restart_s
    if freeze != 0 and freeze < cfg.server.health_stale_s:
        ck.bad("server.controller_freeze_restart_s",
               f"must be 0 (never) or >= server.health_stale_s ({cfg.server.health_stale_s}), got {freeze}")
    if cfg.server.controller_op_timeout_s < 1.0:
        ck.bad("server.controller_op_timeout_s",
               f"must be >= 1.0 (a slow L3 call is not a hang), got {cfg.server.controller_op_timeout_s}")
    ck.positive("server.header_timeout_s", cfg.server.header_timeout_s)
    ck.positive("server.body_timeout_s", cfg.server.body_timeout_s)
    if not 1 <= cfg.server.max_samples <= 128:
        ck.bad("server.max_samples", f"must be in [1, 128], got {cfg.server.max_samples}")
    if cfg.server.request_log is not None and not cfg.server.request_log.strip():
        ck.bad("server.request_log", "must be a file path (or null for no log)")
    names = cfg.server.served_model_names
    if names is not None:
        if not names:
            ck.bad("server.served_model_names", "must name at least one model (or be null)")
        elif any(not n.strip() for n in names):
            ck.bad("server.served_model_names", "must not hold an empty name")
        elif len(set(names)) != len(names):
            ck.bad("server.served_model_names", "must not repeat a name")
    for key, reason in api_key_problems(cfg.server):
        ck.bad(f"server.{key}", reason)
    for key, reason in quota_problems(cfg):
        ck.bad(key, reason)
    if not has_keys(cfg.server) and not is_loopback_host(cfg.server.host) and not cfg.server.allow_unauthenticated:
        ck.bad("server.host", f"{cfg.server.host!r} is not a loopback address and no key is set: anyone who can "
                              "reach it could act as the operator (flush, attach L3, read every tenant's use). "
                              "Set server.operator or server.api_keys (a key from a file or a Secret), or "
                              "server.allow_unauthenticated: true for a trusted network")
    if cfg.ipc.transport == "tcp" and not 0 <= cfg.ipc.tcp_base_port <= 65535 - 8:
        ck.bad("ipc.tcp_base_port", f"must be in 0..65527, got {cfg.ipc.tcp_base_port}")
    if cfg.ipc.curve_keys_dir is not None and not cfg.ipc.curve_keys_dir.strip():
        ck.bad("ipc.curve_keys_dir", "must not be empty (null = no CURVE)")
    elif cfg.ipc.curve_keys_dir and cfg.ipc.allow_insecure_tcp:
        ck.bad("ipc.allow_insecure_tcp", "must not be true when ipc.curve_keys_dir is set (CURVE is on): drop one")
    elif cfg.ipc.transport == "tcp" and not cfg.ipc.curve_keys_dir and not cfg.ipc.allow_insecure_tcp:
        ck.bad("ipc.transport", "tcp needs CURVE keys, or anyone who can reach ipc.tcp_host can send messages to the "
               "daemon: write a key directory with `hicache keygen --dir DIR` and set ipc.curve_keys_dir: DIR, or set "
               "ipc.allow_insecure_tcp: true to accept plain TCP on a trusted network")


def _check_engine(cfg: HicacheConfig, ck: _Checks) -> None:
    """The checks of ``engine`` (engine mode)."""
    c = cfg.cache
    e = cfg.engine
    ck.positive("engine.lease_ttl_s", e.lease_ttl_s)
    ck.positive("engine.lookup_timeout_ms", e.lookup_timeout_ms)
    ck.non_negative("engine.queue_limit", e.queue_limit)
    ck.non_negative("engine.save_wait_ms", e.save_wait_ms)
    if e.kind == "vllm":
        if not e.model:
            ck.bad("engine.model", "is required when engine.kind is vllm (the checkpoint directory the engines serve)")
        elif not (Path(e.model) / "config.json").is_file():
            ck.bad("engine.model", f"must be a local checkpoint directory with a config.json, got {e.model!r}")
        if not c.l2.enabled:
            ck.bad("cache.l2.enabled", "engine mode keeps the engines' KV in L2: it must be true")
        if cfg.ipc.transport == "ipc" and not cfg.ipc.dir:
            ck.bad("ipc.dir", "engine mode needs a fixed runtime directory: engines find the daemon's socket there")


def quota_problems(cfg: HicacheConfig) -> list[tuple[str, str]]:
    """``server.api_keys[].quota`` against the cache: at least one bound; ``l2_tokens``
    positive page multiples, L2 on, their sum within ``cache.l2.tokens`` (they reserve L2);
    ``l3_gb`` positive, the file store with a size cap, their sum less than that cap (they
    reserve L3: the rest is everyone else's)."""
    out: list[tuple[str, str]] = []
    c = cfg.cache
    total = 0
    total_l3 = 0.0
    for i, entry in enumerate(cfg.server.api_keys):
        q = entry.quota
        if q is None:
            continue
        where = f"server.api_keys[{i}].quota"
        if not q.l2_tokens and not q.l3_gb and not q.pinned_tokens:
            out.append((where, "names no bound: give l2_tokens, l3_gb, pinned_tokens or more"))
            continue
        if cfg.engine.kind != "builtin":
            out.append((where, "quotas apply to the HTTP routes' tenants; engine mode has none"))
            continue
        if q.l2_tokens:
            if q.l2_tokens < 0 or (c.page_size > 0 and q.l2_tokens % c.page_size):
                out.append((f"{where}.l2_tokens", f"must be a positive multiple of cache.page_size ({c.page_size}), "
                                                  f"got {q.l2_tokens}"))
            elif not c.l2.enabled:
                out.append((f"{where}.l2_tokens", "needs cache.l2.enabled: true"))
            total += max(q.l2_tokens, 0)
        if q.l3_gb:
            if not q.l3_gb > 0:
                out.append((f"{where}.l3_gb", f"must be > 0, got {q.l3_gb}"))
            elif c.l3.backend != "file":
                out.append((f"{where}.l3_gb", f"needs cache.l3.backend: file (a {c.l3.backend!r} store evicts by "
                                              "its own policy, blind to tenants)"))
            elif not c.l3.file.max_size_gb > 0:
                out.append((f"{where}.l3_gb", "needs cache.l3.file.max_size_gb > 0 (partitions are carved from it)"))
            total_l3 += max(q.l3_gb, 0.0)
        if q.pinned_tokens and (q.pinned_tokens < 0 or (c.page_size > 0 and q.pinned_tokens % c.page_size)):
            out.append((f"{where}.pinned_tokens", f"must be a positive multiple of cache.page_size ({c.page_size}), "
                                                  f"got {q.pinned_tokens}"))
    if c.l2.enabled and total > c.l2.tokens:
        out.append(("server.api_keys", f"the quotas' l2_tokens add up to {total}, more than cache.l2.tokens "
                                       f"({c.l2.tokens}): they reserve L2"))
    if total_l3 and c.l3.backend == "file" and c.l3.file.max_size_gb > 0 and total_l3 >= c.l3.file.max_size_gb:
        out.append(("server.api_keys", f"the quotas' l3_gb add up to {total_l3:g}, not less than "
                                       f"cache.l3.file.max_size_gb ({c.l3.file.max_size_gb:g}): they reserve L3, "
                                       "and the shared store needs the rest"))
    return out
