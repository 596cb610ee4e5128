"""The YAML configuration (docs/architecture.md §10): typed, frozen, validated, with a default for every key.

``load_config(path, overrides)`` reads one YAML file (or none: every key has a default, so
an empty file is a valid config), applies ``--set dotted.key=value`` overrides, checks
every key and value, and returns a frozen ``HicacheConfig``. All problems are collected
and raised together as one ``ConfigError`` whose ``problems`` name each key's dotted path
and the reason; the CLI prints them and exits with code 2.

The dataclasses below are the one source of truth for key names and defaults: the loader
walks their type hints, so adding a key means adding a field.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlparse

import yaml

from storage_backends.settings import RedisConnection

CONFIG_ENV = "HICACHE_CONFIG"

ModelKind = Literal["reference", "hf"]
DType = Literal["float32", "bfloat16", "float16"]
LayerKind = Literal["full", "swa", "mamba"]
Preset = Literal["tiny", "small", "bench"]
WritePolicy = Literal["write_through", "write_through_selective", "write_through_filtered", "write_back"]
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
EvictionPolicy = Literal["lru", "lfu", "slru", "sieve", "arc"]
SchedulePolicy = Literal["lpm", "fcfs", "dfs-weight", "random"]
Transport = Literal["ipc", "tcp"]
LogLevel = Literal["debug", "info", "warning", "error"]
EngineKind = Literal["builtin", "vllm"]
KVDType = Literal["auto", "float32", "bfloat16", "float16"]
KVLayout = Literal["LBHNC"]

DEVICES = ("auto", "cpu")
"""The ``device`` values this build runs: L1 lives in host memory, so no CUDA device yet."""

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

STATE_SLOTS_PER_REQUEST = 3
"""A running request of a Mamba model holds up to three L1 state slots: its own state, the
prompt-boundary snapshot and the latest page-boundary snapshot."""

def swa_request_pages(sliding_window: int, tokens: int, page_size: int) -> int:
    """The most SWA L1 pages a running request is charged for while its forward passes
    compute up to ``tokens`` tokens each (a prefill chunk; 1 while decoding).

    ``ceil(tokens / ps) + 2 * ceil(window / ps) + 1``: the pages of the tokens being
    computed, the window before them (kept down to the window before the last page
    boundary, so that the tokens cached at finish end on a valid SWA boundary; one page
    more for the partial page), and the window before the prompt's last page boundary,
    which the request hands to the tree (so a repeat of the prompt matches it) and which
    stays charged to it until it finishes. Pages wholly before that are freed as the
    request's computed position advances (the runner never reads them again).
    """
    def cdiv(a: int) -> int:
        return -(-a // page_size)

    return cdiv(tokens) + 2 * cdiv(sliding_window) + 1


def swa_min_pages(sliding_window: int, tokens: int, page_size: int) -> int:
    """The smallest SWA L1 pool that serves any request: one request's
    ``swa_request_pages`` and the window of SWA pages its match keeps locked."""
    return swa_request_pages(sliding_window, tokens, page_size) + -(-sliding_window // page_size) + 1


ENGINE_WINDOW_SHARE = 4
"""Engine mode, a model with window layers, ``cache.l2.swa_tokens`` unset: the window pool
gets 1 / this of the full pool's pages (a cached prefix keeps its window part for the pages
of its last window only)."""


def engine_window_pages(cfg: HicacheConfig) -> int:
    """Pages of the engine-mode window pool: ``cache.l2.swa_tokens``, or
    ``ENGINE_WINDOW_SHARE``'s share of ``cache.l2.tokens`` (at least one page)."""
    ps = cfg.cache.page_size
    if cfg.cache.l2.swa_tokens is not None:
        return cfg.cache.l2.swa_tokens // ps
    return max(1, cfg.cache.l2.tokens // ps // ENGINE_WINDOW_SHARE)


def swa_pool_tokens(cfg: HicacheConfig, sliding_window: int) -> tuple[int, int]:
    """``(L1, L2)`` SWA pool sizes in tokens for a model with swa layers (L2 0 when off).

    Set by ``cache.l1.swa_tokens`` / ``cache.l2.swa_tokens``; unset, L1 gets::

        2 * max_running_requests * swa_request_pages(window, 1)
          + ceil((max_prefill_tokens + chunk) / page_size)          (pages)

    (chunk = ``min(chunked_prefill_tokens, max_prefill_tokens)``): every running request's
    decode windows, the prefill chunks one forward pass computes (the admission step stops
    once ``max_prefill_tokens`` are taken, overshooting by at most one chunk), and as much
    again for the windows the tree keeps cached; never less than one prefilling request's
    ``swa_min_pages``, never more than the Full pool. L2 gets the same
    share of ``cache.l2.tokens``.
    """
    c, s = cfg.cache, cfg.scheduler
    ps = c.page_size
    full1 = c.l1.tokens // ps
    chunk = min(s.chunked_prefill_tokens, s.max_prefill_tokens)
    if c.l1.swa_tokens is not None:
        l1 = c.l1.swa_tokens // ps
    else:
        derived = (2 * s.max_running_requests * swa_request_pages(sliding_window, 1, ps)
                   + -(-(s.max_prefill_tokens + chunk) // ps))
        l1 = min(full1, max(derived, swa_min_pages(sliding_window, chunk, ps)))
    if not c.l2.enabled:
        return l1 * ps, 0
    full2 = c.l2.tokens // ps
    if c.l2.swa_tokens is not None:
        l2 = c.l2.swa_tokens // ps
    else:
        l2 = min(full2, -(-full2 * l1 // full1)) if full1 else full2
    return l1 * ps, l2 * ps


MIN_L1_STATE_SLOTS = STATE_SLOTS_PER_REQUEST + 1
"""One more than a request holds: the cached state it matched stays locked while it runs,
so a request can always be admitted once nothing else runs."""


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ReferenceModelConfig:
    """The built-in reference decoder (docs/architecture.md §9). Unset (None) fields come from ``preset``."""

    preset: Preset = "tiny"
    layers: tuple[LayerKind, ...] | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    sliding_window: int | None = None
    mamba_state_size: int | None = None
    max_context: int | None = None
    seed: int = 0


# Named sizes of the reference model. ``tiny`` keeps the test suite fast on two CPU
# cores; ``bench`` has a prefill cost that is realistic relative to a cache load.
REFERENCE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        layers=("full", "full"), hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=512, sliding_window=64, mamba_state_size=16,
        max_context=4096,
    ),
    "small": dict(
        layers=("full", "full", "full", "full"), hidden_size=256, num_heads=8, num_kv_heads=4,
        head_dim=32, intermediate_size=688, vocab_size=4096, sliding_window=256,
        mamba_state_size=16, max_context=8192,
    ),
    "bench": dict(
        layers=("full",) * 4, hidden_size=768, num_heads=12, num_kv_heads=4, head_dim=64,
        intermediate_size=2048, vocab_size=32000, sliding_window=1024, mamba_state_size=16,
        max_context=16384,
    ),
}


@dataclass(frozen=True)
class ModelConfig:
    kind: ModelKind = "reference"
    path: str | None = None
    dtype: DType = "float32"
    reference: ReferenceModelConfig = field(default_factory=ReferenceModelConfig)


@dataclass(frozen=True)
class TokenizerConfig:
    """``path`` names a local tokenizer.json (or a directory holding one); None = byte-level."""

    path: str | None = None


# --------------------------------------------------------------------------- cache


@dataclass(frozen=True)
class L1Config:
    """L1 (device) pools. ``tokens``: Full-attention KV capacity; ``swa_tokens``: the
    sliding-window KV pool (models with swa layers only; unset: ``swa_pool_tokens``'
    default, far below ``tokens``, since a request keeps only its windows; at most
    ``tokens``); ``state_slots``: Mamba state slots (models with mamba layers only; each
    running request holds up to three: its own state and two snapshots; at least four)."""

    tokens: int = 65536
    swa_tokens: int | None = None
    state_slots: int = 256


@dataclass(frozen=True)
class L2Config:
    """L2 (host) pools. ``swa_tokens``: the sliding-window KV pool in L2 (unset: the same
    share of ``tokens`` as L1's SWA pool has of L1's; at most ``tokens``); ``state_slots``:
    Mamba state slots in L2; 0 keeps Mamba states L1-only (a node evicted from L1 then
    loses its state and is no match boundary)."""

    enabled: bool = True
    tokens: int = 262144
    swa_tokens: int | None = None
    state_slots: int = 1024


def default_l3_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hicache", "l3")


@dataclass(frozen=True)
class FileStoreConfig:
    dir: str = field(default_factory=default_l3_dir)
    max_size_gb: float = 10.0
    fsync: bool = False


@dataclass(frozen=True)
class RedisStoreConfig(RedisConnection):
    """``cache.l3.redis`` (README "L3 storage"): the fields of
    ``storage_backends.settings.RedisConnection``, shared with the Redis backend's own
    ``RedisSettings`` (which documents them: the password's one source, TLS), and
    ``timeout_s``. The password is never shown: not in ``repr``, not in ``hicache
    check-config``'s output. Files and variables named for the password are read when the
    store is attached."""

    timeout_s: float = 2.0


@dataclass(frozen=True)
class L3Config:
    """``cache.l3``: ``backend`` is ``none``, ``file``, ``redis`` (each with its section) or
    the kind of an installed plug-in (``storage_backends.plugins``), whose settings are
    ``options``: a mapping whose keys, checks and secrets the plug-in defines."""

    backend: str = "file"
    file: FileStoreConfig = field(default_factory=FileStoreConfig)
    redis: RedisStoreConfig = field(default_factory=RedisStoreConfig)
    options: dict[str, Any] = field(default_factory=dict)


DEFAULT_STORE = "default"
"""The name ``PUT /cache/storage`` attaches ``cache.l3`` by (``cache.l3_stores`` names the others)."""
STORE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""A ``cache.l3_stores`` name."""


@dataclass(frozen=True)
class PrefetchConfig:
    """L3 -> L2 prefetch for waiting requests (docs/architecture.md §5).

    ``timeout`` (the default) holds a request until its prefetch completes or
    ``timeout_base_s + timeout_per_ki_token_s * tokens / 1024`` passes; ``wait_complete``
    holds it until the prefetch completes; ``best_effort`` never holds it, so only later
    requests for the same prefix profit from what the prefetch brings.
    """
    policy: PrefetchPolicy = "timeout"
    threshold_tokens: int = 256
    timeout_base_s: float = 1.0
    timeout_per_ki_token_s: float = 0.25
    max_reserved_fraction: float = 0.5


@dataclass(frozen=True)
class PinnedPrefixConfig:
    """One entry of ``cache.pinned`` (README "Pinned prefixes"): a prefix the cache computes
    (or loads from L3) at start and never evicts from ``tiers`` (``l1``, ``l2``). Exactly one
    of ``text`` (tokenized as a completion prompt is, without a chat template) and
    ``token_ids``. ``cache_salt`` and ``tenant`` name its namespace as a request's do (a
    tenant's pin is that tenant's requests' hit). ``tiers`` None: every tier that is on."""

    name: str = ""
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    cache_salt: str = ""
    tenant: str | None = None
    tiers: tuple[str, ...] | None = None


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    l1: L1Config = field(default_factory=L1Config)
    l2: L2Config = field(default_factory=L2Config)
    l3: L3Config = field(default_factory=L3Config)
    write_policy: WritePolicy = "write_through"
    write_through_threshold: int = 2
    load_back_threshold: int = 16
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    eviction: EvictionPolicy = "lru"
    mamba_branch_interval: int = 512
    """Models with Mamba layers: a prefill also caches the state after every this many
    tokens (a multiple of ``page_size``; 0: only at the prompt's end and where the prompt
    forks from a cached path), so that later prompts sharing a prefix find a state in it."""
    pinned: tuple[PinnedPrefixConfig, ...] = ()
    pinned_fraction: float = 0.5
    """The most of each tier (L1, L2) that pinned prefixes may hold together."""
    l3_stores: dict[str, L3Config] = field(default_factory=dict)
    """Other L3 stores the operator may attach at run time, by name (``PUT /cache/storage``
    with ``{"store": NAME}``); each a ``cache.l3`` section, checked as ``cache.l3`` is.
    ``DEFAULT_STORE`` names ``cache.l3`` itself. An HTTP caller never names a URL, a host,
    a path or a secret source: only these names (README "Security")."""


# --------------------------------------------------------------------------- the rest


@dataclass(frozen=True)
class SchedulerConfig:
    policy: SchedulePolicy = "lpm"
    max_running_requests: int = 32
    max_prefill_tokens: int = 8192
    chunked_prefill_tokens: int = 2048
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 4096


TENANT_NAME_RE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
"""What a ``server.api_keys`` tenant name may be: 1 to 64 ASCII letters, digits, ``.``,
``_`` and ``-``, starting with a letter or digit."""
PIN_NAME_RE = re.compile(f"^{TENANT_NAME_RE}$")
"""A pinned prefix's name (``cache.pinned[].name``, ``PUT /cache/pinned``): a tenant name's form."""


@dataclass(frozen=True)
class TenantQuotaConfig:
    """``server.api_keys[].quota`` (README "Tenants"); at least one of:

    ``l2_tokens`` bounds the tenant's Full L2 pages (a multiple of ``cache.page_size``) and
    reserves them: a write past it evicts the tenant's own L2 pages first, and no other
    tenant's need evicts them (``hicache.tree.quotas``). The quotas together may hold at most
    ``cache.l2.tokens``.

    ``l3_gb`` gives the tenant an L3 partition of its own, of that many GB (the file store
    only: ``hicache.storage_settings.tenant_partitions``): its pages go there and are evicted
    only by its own writes; the shared store keeps ``cache.l3.file.max_size_gb`` less the
    partitions.

    ``pinned_tokens`` is the tenant's pin budget: the most its pinned prefixes may hold in
    each tier (L1, L2) together. A tenant pins with its own key (``PUT /cache/pinned``) only
    within it; without one it cannot pin. Pins the operator makes for the tenant
    (``cache.pinned``, or the operator's key) count towards it but are not refused by it."""

    l2_tokens: int = 0
    l3_gb: float = 0.0
    pinned_tokens: int = 0


@dataclass(frozen=True)
class ApiKeyConfig:
    """One entry of ``server.api_keys``: a bearer key and the tenant it authenticates.

    The key comes from exactly one of ``key`` (inline), ``key_file`` (a file holding only
    it; one trailing newline dropped) or ``key_env`` (the name of an environment variable
    holding it); files and variables are read when the daemon starts (and by ``hicache
    check-config``). A key is printable ASCII without spaces. The key is never shown: not
    in ``repr``, not in ``hicache check-config``'s output, not in an error message."""

    tenant: str = ""
    key: str | None = field(default=None, repr=False, metadata={"secret": True})
    key_file: str | None = None
    key_env: str | None = None
    quota: TenantQuotaConfig | None = None
    """The tenant's quota, given on one of its entries (``TenantQuotaConfig``)."""


@dataclass(frozen=True)
class OperatorKeyConfig:
    """``server.operator``: the operator's bearer key, from exactly one of ``key`` (inline),
    ``key_file`` or ``key_env`` (read as ``ApiKeyConfig``'s are). Its holder administers the
    whole daemon (README "Security"): every tenant's pins and stats, flush of everything,
    L3 attach / detach / clear, ``/metrics``. Never shown, like every key."""

    key: str | None = field(default=None, repr=False, metadata={"secret": True})
    key_file: str | None = None
    key_env: str | None = None


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server. ``served_model_names``: the names the OpenAI routes answer to (their
    ``model`` field, ``GET /v1/models``); the first is the one responses carry when a
    request names none. None (the default) = the model's own name only (the checkpoint
    directory's name, or ``hicache-reference-<preset>``). Names must be non-empty and
    distinct.

    ``header_timeout_s``: a connection must deliver a request's line and headers within
    this many seconds of opening (or of the previous response on a keep-alive connection),
    or it is closed; an idle keep-alive connection is closed after it too.
    ``body_timeout_s``: a handler reads the whole request body within this many seconds of
    the headers, or the client gets a 408 and the connection is closed.
    ``max_samples``: the largest OpenAI ``n`` (each sample is a scheduler request that may
    compute the prompt again: README "HTTP API"); at most 128, the OpenAI API's own bound.

    Bearer keys (every route but ``/health`` and ``/metrics`` needs one when any is set):
    ``api_key`` is one key without a tenant (every client shares the cache namespaces, as
    when no key is set); ``api_keys`` lists keys with their tenants (``ApiKeyConfig``), and
    each request's tenant then namespaces its cached pages (README "Tenants"). Set at most
    one of the two. Tenant names match ``TENANT_NAME_RE``; several entries may name one
    tenant (key rotation), but two tenant names must not differ only in case, and no key
    may appear twice.

    Roles (README "Security"): ``operator`` (``OperatorKeyConfig``) is the operator's key;
    ``api_key``'s holder is the operator too (a daemon without tenants); a tenant's key acts
    on that tenant's namespaces only. With no key at all, every caller is the operator, so
    a ``host`` other than a loopback address is refused unless ``allow_unauthenticated``
    says so explicitly."""

    host: str = "127.0.0.1"
    port: int = 30080
    api_key: str | None = field(default=None, repr=False, metadata={"secret": True})
    api_keys: tuple[ApiKeyConfig, ...] = ()
    operator: OperatorKeyConfig | None = None
    allow_unauthenticated: bool = False
    served_model_names: tuple[str, ...] | None = None
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_samples: int = 128
    # A scheduler or controller whose heartbeat is older than ``health_stale_s`` makes
    # ``/health`` degraded, naming it (keep it above the model's longest forward pass). The
    # launcher kills and restarts a controller whose heartbeat is older than
    # ``controller_freeze_restart_s`` (0 = never); a frozen scheduler is never restarted.
    health_stale_s: float = 5.0
    controller_freeze_restart_s: float = 30.0
    controller_op_timeout_s: float = 60.0
    """A controller op unanswered for this long makes the scheduler ask the launcher to
    restart the controller (a controller that still beats but hangs on a copy or an L3 call)."""
    request_log: str | None = None
    """A file the tokenizer process appends one line per finished request to: the page
    hashes of its prompt (no text), its lengths and cached tokens, as a Mooncake-format
    trace for ``hicache advise`` (``hicache.api_server.request_log``). None: no log."""


@dataclass(frozen=True)
class IpcConfig:
    """``dir`` None = a fresh private directory (mode 0700) under the runtime dir.

    ``transport: tcp`` needs CURVE: ``curve_keys_dir`` names a key directory written by
    ``hicache keygen --dir DIR``; every socket then encrypts, the internal sockets admit only
    the daemon's own client key and the engine socket the keys in ``DIR/authorized_clients``
    (``hicache.runtime.ipc``'s ZAP domains; CURVE applies on ``ipc`` too when set).
    ``allow_insecure_tcp: true`` instead accepts plain, unauthenticated TCP (logged as a
    warning at start): anyone who can reach ``tcp_host`` can then send to the daemon."""

    dir: str | None = None
    transport: Transport = "ipc"
    tcp_host: str = "127.0.0.1"
    tcp_base_port: int = 0
    curve_keys_dir: str | None = None
    allow_insecure_tcp: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """Who computes the KV (README "Engine mode").

    ``builtin``: the scheduler runs its own model worker (``model``). ``vllm``: the daemon is
    the L2 + L3 tier beside vLLM engines, which load ``hicache.connectors.vllm``; the
    scheduler process runs the cache server (no model) and engines reach it on
    ``{ipc.dir}/engine.sock`` (ipc) or ``tcp_base_port + 4`` (tcp). ``model``: the local
    checkpoint directory the engines serve (its ``config.json`` gives the page geometry, its
    weights the identity that namespaces page hashes); ``kv_dtype``: the engines' KV dtype
    (``auto``: the checkpoint's dtype); ``kv_layout``: the engines' per-block byte order
    (vLLM's CPU backend: ``LBHNC``). A session whose engine sends nothing for ``lease_ttl_s``
    expires (its leases are held as orphans until the engine's late messages arrive or its
    process is seen gone). ``lookup_timeout_ms``: how long a connector waits for any answer
    of the daemon (none waits for L3) before it counts the call as a miss (and backs off).
    ``queue_limit``: engine messages the daemon queues per engine (session) at most; a
    ``Lookup`` or ``Reserve`` past it is answered ``busy`` at once (the engine goes on without
    the cache for that request or step). 0: every lookup and reserve is answered ``busy``.
    """

    kind: EngineKind = "builtin"
    model: str | None = None
    kv_dtype: KVDType = "auto"
    kv_layout: KVLayout = "LBHNC"
    lease_ttl_s: float = 10.0
    lookup_timeout_ms: int = 200
    queue_limit: int = 64


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True


@dataclass(frozen=True)
class EventsConfig:
    """KV events (docs/architecture.md §14): every change of what a tier holds, published in
    vLLM's event format on a ZeroMQ PUB socket for KV-aware routers.

    ``endpoint``: bound (``bind``, the default) or connected to. ``replay_endpoint``: a ROUTER socket from which a subscriber
    that missed batches gets them again (the last ``replay_batches``). ``topic``: None gives
    ``kv@<host name>@<model>``. A round's batch is sent without waiting: a subscriber that
    falls behind loses batches at the socket, sees the gap in the sequence numbers and gets
    them from the replay socket. ``journal``: a local file where the daemon keeps what it
    announced as stored in L3, so that after a restart it announces again what L3 still holds
    (``hicache.kv_events.journal``); None announces L3 only as pages are backed up.

    Who may subscribe (README "Security"): the endpoint is on loopback by default. When the
    daemon has CURVE keys (``ipc.curve_keys_dir``), the bound sockets are CURVE servers that
    admit only the subscriber keys in ``{keys dir}/authorized_subscribers`` (``hicache keygen
    --subscriber NAME``). An endpoint on another host or interface without CURVE needs
    ``allow_insecure_tcp: true`` (which also turns CURVE off, for subscribers without it).
    ``tenant_content``: the tokens and the ``cache_salt`` of pages in a tenant's namespace
    are published only when true; otherwise their ``BlockStored`` carries the page hashes
    with no tokens and no ``extra_keys``."""

    enabled: bool = False
    endpoint: str = "tcp://127.0.0.1:5557"
    bind: bool = True
    """True: the daemon binds ``endpoint`` and subscribers connect to it; false: the daemon
    connects to ``endpoint``, where a subscriber has bound (vLLM connects to an endpoint that
    names a host)."""
    replay_endpoint: str | None = None
    topic: str | None = None
    replay_batches: int = 10_000
    journal: str | None = None
    allow_insecure_tcp: bool = False
    tenant_content: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    level: LogLevel = "info"
    json: bool = False


@dataclass(frozen=True)
class HicacheConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    device: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    ipc: IpcConfig = field(default_factory=IpcConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class ConfigProblem:
    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path or '<root>'}: {self.reason}"


class ConfigError(ValueError):
    """One or more problems in a config; ``problems`` lists every one with its key path."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"invalid configuration ({len(problems)} problem(s)):\n{lines}")


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None) -> HicacheConfig:
    """Read, override, validate. ``path`` None falls back to ``$HICACHE_CONFIG``, then to defaults.

    Raises ``ConfigError`` (every problem at once) for a bad file, key or value.
    """
    if path is None:
        path = os.environ.get(CONFIG_ENV) or None
    raw: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError([ConfigProblem("", f"cannot read {path}: {exc.strerror or exc}")]) from exc
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError([ConfigProblem("", f"{path} is not valid YAML: {exc}")]) from exc
        if raw is None:
            raw = {}
    return config_from_dict(raw, overrides)


def config_from_dict(raw: Any, overrides: list[str] | None = None) -> HicacheConfig:
    problems: list[ConfigProblem] = []
    if not isinstance(raw, dict):
        raise ConfigError([ConfigProblem("", f"the top level must be a mapping, got {_type_name(raw)}")])
    raw = _deep_copy(raw)
    for item in overrides or []:
        _apply_override(raw, item, problems)
    cfg = _resolve(_build(HicacheConfig, raw, "", problems))
    # Keys with a type problem fell back to their defaults above; check the relations of the
    # rest too, so that one run reports every problem, but once per key.
    reported = {p.path for p in problems}
    problems.extend(p for p in validate(cfg) if p.path not in reported)
    if problems:
        raise ConfigError(problems)
    return cfg


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"cache.page_size=32"`` -> (["cache", "page_size"], 32); values are parsed as YAML."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {item!r} is not of the form key.path=value")
    parts = [p.strip() for p in key.split(".")]
    if any(not p for p in parts):
        raise ValueError(f"override {item!r} has an empty key segment")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return parts, parsed


def _apply_override(raw: dict[str, Any], item: str, problems: list[ConfigProblem]) -> None:
    try:
        parts, value = parse_override(item)
    except ValueError as exc:
        problems.append(ConfigProblem("--set", str(exc)))
        return
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            problems.append(ConfigProblem(".".join(parts[: i + 1]), "is not a section; cannot set a key below it"))
            return
        node = child
    node[parts[-1]] = value


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def _type_name(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


_MISSING = object()


def _build(cls: type, data: Any, path: str, problems: list[ConfigProblem]) -> Any:
    """Build dataclass ``cls`` from a mapping, appending a problem for each bad key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(ConfigProblem(path, f"must be a mapping, got {_type_name(data)}"))
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            known = ", ".join(sorted(names))
            problems.append(ConfigProblem(_join(path, str(key)), f"unknown key (known keys here: {known})"))
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        if f.metadata.get("secret"):  # a problem must not quote the value
            found: list[ConfigProblem] = []
            value = _convert(hints[f.name], data[f.name], _join(path, f.name), found)
            problems.extend(ConfigProblem(p.path, f"must be a string (quote it in YAML), got "
                                                  f"{_type_name(data[f.name])}") for p in found)
        else:
            value = _convert(hints[f.name], data[f.name], _join(path, f.name), problems)
        if value is not _MISSING:
            kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # pragma: no cover - conversion already checked types
        problems.append(ConfigProblem(path, str(exc)))
        return cls()


def _convert(hint: Any, value: Any, path: str, problems: list[ConfigProblem]) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, problems)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, path, problems)
    if origin is Literal:
        if value not in args or isinstance(value, bool):
            choices = ", ".join(str(a) for a in args)
            problems.append(ConfigProblem(path, f"must be one of {choices}; got {value!r}"))
            return _MISSING
        return value
    if origin is dict:  # a mapping of names: to sections (dataclasses), or free (a plug-in's settings)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            problems.append(ConfigProblem(path, f"must be a mapping with string keys, got {_type_name(value)}"))
            return _MISSING
        if len(args) == 2 and isinstance(args[1], type) and dataclasses.is_dataclass(args[1]):
            return {k: _build(args[1], v, _join(path, k), problems) for k, v in value.items()}
        return dict(value)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            problems.append(ConfigProblem(path, f"must be a list, got {_type_name(value)}"))
            return _MISSING
        items = [_convert(args[0], v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return _MISSING if any(v is _MISSING for v in items) else tuple(items)
    if hint is bool:
        if not isinstance(value, bool):
            problems.append(ConfigProblem(path, f"must be true or false, got {value!r}"))
            return _MISSING
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(ConfigProblem(path, f"must be an integer, got {_type_name(value)} {value!r}"))
            return _MISSING
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            problems.append(ConfigProblem(path, f"must be a number, got {_type_name(value)} {value!r}"))
            return _MISSING
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            problems.append(ConfigProblem(path, f"must be a string, got {_type_name(value)} {value!r}"))
            return _MISSING
        return value
    raise TypeError(f"config field {path} has an unsupported type {hint!r}")  # pragma: no cover


def _resolve(cfg: HicacheConfig) -> HicacheConfig:
    """Fill the reference model's unset fields from its preset, and for a reference model
    with swa layers the SWA pool sizes (``swa_pool_tokens``) left unset (an ``hf`` model's
    window is known only from its checkpoint: the launcher derives its sizes)."""
    ref = cfg.model.reference
    preset = REFERENCE_PRESETS[ref.preset]
    filled = {k: v for k, v in preset.items() if getattr(ref, k) is None}
    if filled:
        ref = dataclasses.replace(ref, **filled)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, reference=ref))
    c = cfg.cache
    window = ref.sliding_window
    if (cfg.model.kind == "reference" and "swa" in (ref.layers or ()) and window is not None and window > 0
            and _power_of_two(c.page_size) and c.l1.tokens > 0 and (c.l1.swa_tokens is None or
                                                                     c.l2.swa_tokens is None)):
        l1, l2 = swa_pool_tokens(cfg, window)
        cfg = dataclasses.replace(cfg, cache=dataclasses.replace(
            c, l1=dataclasses.replace(c.l1, swa_tokens=l1 if c.l1.swa_tokens is None else c.l1.swa_tokens),
            l2=dataclasses.replace(c.l2, swa_tokens=l2 if c.l2.enabled and c.l2.swa_tokens is None
                                   else c.l2.swa_tokens)))
    return cfg


# --------------------------------------------------------------------------- validation


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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
            and _power_of_two(ps) and value % ps == 0 and value < c.l1.tokens):
        chunk = min(cfg.scheduler.chunked_prefill_tokens, cfg.scheduler.max_prefill_tokens)
        need = swa_min_pages(window, max(chunk, 1), ps) * ps
        if value < need:
            bad("cache.l1.swa_tokens", f"must hold one prefilling request's SWA pages and its match's window "
                                       f"(the sliding window {window} three times + one prefill chunk of "
                                       f"{chunk} + two pages): at least {need} tokens, got {value}")


def kv_bytes_per_token(cfg: HicacheConfig) -> int | None:
    """Bytes of Full+SWA KV one token takes in one tier, for the reference model; None for hf."""
    if cfg.model.kind != "reference":
        return None
    ref = cfg.model.reference
    assert ref.layers is not None and ref.num_kv_heads is not None and ref.head_dim is not None
    attn_layers = sum(1 for kind in ref.layers if kind in ("full", "swa"))
    return attn_layers * 2 * ref.num_kv_heads * ref.head_dim * DTYPE_BYTES[cfg.model.dtype]


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
    page_ok = c.page_size > 0 and (engine or _power_of_two(c.page_size))
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
    if _power_of_two(c.page_size) and s.chunked_prefill_tokens % c.page_size:
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
    if e.kind == "vllm":
        if not e.model:
            ck.bad("engine.model", "is required when engine.kind is vllm (the checkpoint directory the engines serve)")
        elif not (Path(e.model) / "config.json").is_file():
            ck.bad("engine.model", f"must be a local checkpoint directory with a config.json, got {e.model!r}")
        if not c.l2.enabled:
            ck.bad("cache.l2.enabled", "engine mode keeps the engines' KV in L2: it must be true")
        if cfg.ipc.transport == "ipc" and not cfg.ipc.dir:
            ck.bad("ipc.dir", "engine mode needs a fixed runtime directory: engines find the daemon's socket there")


def key_text_problem(key: str) -> str | None:
    """None if ``key`` can be a bearer key (non-empty printable ASCII, no spaces), else the
    reason, which never quotes the key."""
    if not key:
        return "must not be empty"
    if not all("!" <= ch <= "~" for ch in key):
        return "must be printable ASCII without spaces or control characters (a bearer token)"
    return None


def has_keys(server: ServerConfig) -> bool:
    """Whether any bearer key is configured (then every route but ``/health`` needs one)."""
    return server.api_key is not None or bool(server.api_keys) or server.operator is not None


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address to bind or connect, or a name) is this host's loopback:
    ``localhost``, ``127.0.0.0/8`` or ``::1``. A wildcard (``0.0.0.0``, ``::``, ``*``) or
    any other name is not."""
    import ipaddress

    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def events_endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (``*`` for a wildcard), None for the
    ``ipc://`` and ``inproc://`` ones (which stay on this host)."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):]
    host, _, _port = rest.rpartition(":")
    return host or rest


def _key_source_problems(where: str, entry: ApiKeyConfig | OperatorKeyConfig) -> list[tuple[str, str]]:
    """A key entry's source: exactly one of ``key``, ``key_file``, ``key_env``, none empty,
    an inline key a bearer token (reasons never quote it)."""
    out: list[tuple[str, str]] = []
    given = [name for name in ("key", "key_file", "key_env") if getattr(entry, name) is not None]
    if len(given) != 1:
        out.append((where, f"give exactly one of key, key_file, key_env; got {' and '.join(given) or 'none'}"))
    for name in ("key_file", "key_env"):
        value = getattr(entry, name)
        if value is not None and not value.strip():
            out.append((f"{where}.{name}", "must not be empty"))
    if entry.key is not None:
        problem = key_text_problem(entry.key)
        if problem:
            out.append((f"{where}.key", problem))
    return out


def api_key_problems(server: ServerConfig) -> list[tuple[str, str]]:
    """Problems of ``server.api_key`` / ``server.api_keys`` / ``server.operator`` that need no
    file or variable, as ``(key below server, reason)``: an empty ``api_key``; both set; the
    operator's key beside ``api_key``, or equal to a tenant's inline key; an entry without a valid
    tenant name, with not exactly one of ``key`` / ``key_file`` / ``key_env``, with an empty
    one, or whose inline key is not a bearer token; two tenant names that differ only in
    case; an inline key given twice. What the files and variables hold is checked when the
    keys are loaded (``hicache.runtime.startup_checks.load_api_keys``). Reasons never include a key."""
    out: list[tuple[str, str]] = []
    if server.api_key == "":
        out.append(("api_key", "must not be empty (null = no key)"))
    if server.api_key is not None and server.api_keys:
        out.append(("api_keys", "set server.api_key (one key, no tenant) or server.api_keys (keys with tenants), "
                                "not both"))
    op = server.operator
    if op is not None:
        if server.api_key is not None:
            out.append(("operator", "server.api_key is already the operator's key (a daemon without tenants): give "
                                    "tenants keys in server.api_keys beside server.operator, or drop one"))
        out.extend(_key_source_problems("operator", op))
        if op.key is not None and not key_text_problem(op.key):
            if any(entry.key == op.key for entry in server.api_keys):
                out.append(("operator.key", "is also a tenant's key in server.api_keys: the operator's key must be "
                                            "its own"))
    spelled: dict[str, tuple[str, int]] = {}
    inline: dict[str, int] = {}
    for i, entry in enumerate(server.api_keys):
        where = f"api_keys[{i}]"
        if entry == ApiKeyConfig():  # ``{}``, or not a mapping at all (reported at this path already)
            out.append((where, "must give a tenant and one of key, key_file, key_env"))
            continue
        if not entry.tenant:
            out.append((f"{where}.tenant", "is required (the tenant this key authenticates)"))
        elif not re.fullmatch(TENANT_NAME_RE, entry.tenant):
            out.append((f"{where}.tenant", "must be 1 to 64 ASCII letters, digits, '.', '_' or '-', starting with "
                                           f"a letter or digit; got {entry.tenant!r}"))
        else:
            first, j = spelled.setdefault(entry.tenant.lower(), (entry.tenant, i))
            if first != entry.tenant:
                out.append((f"{where}.tenant", f"{entry.tenant!r} differs only in case from {first!r} "
                                               f"(api_keys[{j}]): spell a tenant the same in every entry"))
        out.extend(_key_source_problems(where, entry))
        if entry.key is not None and not key_text_problem(entry.key):
            if entry.key in inline:
                out.append((f"{where}.key", f"is the same key as api_keys[{inline[entry.key]}].key: "
                                            "each key must be given once"))
            else:
                inline[entry.key] = i
    quota_of: dict[str, int] = {}
    for i, entry in enumerate(server.api_keys):
        if entry.quota is None or not entry.tenant:
            continue
        where = f"api_keys[{i}].quota"
        if entry.tenant in quota_of:
            out.append((where, f"tenant {entry.tenant!r} has a quota already (api_keys[{quota_of[entry.tenant]}]): "
                               "give it on one entry"))
        quota_of.setdefault(entry.tenant, i)
    return out


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


def redis_secret_problems(r: RedisStoreConfig, check_files: bool) -> list[tuple[str, str]]:
    """Problems of ``cache.l3.redis``'s password and TLS keys, as ``(key, reason)``.

    Always: more than one password source (``password``, ``password_file``,
    ``password_env``, a password in ``url``), an empty value, a ``tls_*`` file without a
    ``rediss://`` URL, ``tls_key_file`` without ``tls_cert_file``. With ``check_files`` (the
    store is in use): a password file that cannot be read or holds no password, an unset or
    empty ``password_env`` variable, TLS files that cannot be read or loaded (the same
    checks the backend makes when it attaches). Reasons never include a secret.
    """
    out: list[tuple[str, str]] = []
    try:
        parsed = urlparse(r.url)
        url_password = parsed.password or next(iter(parse_qs(parsed.query).get("password", [])), None)
        scheme = parsed.scheme
    except ValueError:  # redis_url_problem reports it
        url_password, scheme = None, ""
    if r.password == "":
        out.append(("password", "must not be empty (null = no password)"))
    for key in ("password_file", "password_env", "tls_ca_file", "tls_cert_file", "tls_key_file"):
        value = getattr(r, key)
        if value is not None and not value.strip():
            out.append((key, "must not be empty (null = unset)"))
    named = [("password", r.password), ("password_file", r.password_file), ("password_env", r.password_env),
             ("url", url_password)]
    sources = [key for key, value in named if value]
    if len(sources) > 1:
        out.append((sources[-1], "give the Redis password in one place only (password, password_file, password_env "
                                 f"or the url's user:password@); got {' and '.join(sources)}"))
    tls_keys = [k for k in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(r, k)]
    if tls_keys and scheme in ("redis", "unix"):
        for key in tls_keys:
            out.append((key, f"needs a rediss:// url (TLS); url is {scheme}://"))
    if r.tls_key_file and not r.tls_cert_file:
        out.append(("tls_key_file", "needs tls_cert_file (the client certificate this key belongs to)"))
    if not check_files or out:
        return out
    from storage_backends.settings import load_password_env, load_password_file, tls_file_problems

    try:
        if r.password_file:
            load_password_file(r.password_file)
        elif r.password_env:
            load_password_env(r.password_env)
    except ValueError as exc:
        out.append(("password_file" if r.password_file else "password_env", str(exc)))
    if scheme == "rediss":
        out.extend(tls_file_problems(r.tls_ca_file, r.tls_cert_file, r.tls_key_file))
    return out


def redis_url_problem(url: str) -> str | None:
    """None if ``url`` is a usable redis://, rediss:// or unix:// URL, else the reason (which
    quotes the URL with its password as ``***``)."""
    from storage_backends.settings import redact_url

    shown = redact_url(url)
    try:
        parsed = urlparse(url)
    except ValueError as exc:
        return f"does not parse: {exc}"
    if parsed.scheme not in ("redis", "rediss", "unix"):
        return f"scheme must be redis, rediss or unix; got {shown!r}"
    if parsed.scheme == "unix":
        return None if parsed.path else f"unix URL needs a socket path; got {shown!r}"
    if not parsed.hostname:
        return f"needs a host; got {shown!r}"
    try:
        parsed.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        return f"has an invalid port; got {shown!r}"
    db = parsed.path.lstrip("/")
    if db and not db.isdigit():
        return f"database must be a number; got {db!r}"
    return None


def to_dict(cfg: Any) -> Any:
    """The config as plain YAML-ready data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple | list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: HicacheConfig) -> str:
    """The config as YAML, for people: secrets (the Redis password, inline or in the URL, of
    ``cache.l3`` and of every ``cache.l3_stores`` entry, ``server.api_key``, the inline keys
    of ``server.api_keys`` and ``server.operator``, and a plug-in backend's secret options)
    show as ``***``."""
    from hicache.storage_settings import redacted_options
    from storage_backends.settings import redact_url

    data = to_dict(cfg)

    def redact_l3(section: dict[str, Any], l3: L3Config) -> None:
        redis_section = section["redis"]
        if redis_section.get("password") is not None:
            redis_section["password"] = "***"
        redis_section["url"] = redact_url(redis_section["url"])
        section["options"] = redacted_options(l3)

    redact_l3(data["cache"]["l3"], cfg.cache.l3)
    for name, store in cfg.cache.l3_stores.items():
        redact_l3(data["cache"]["l3_stores"][name], store)
    if data["server"].get("api_key") is not None:
        data["server"]["api_key"] = "***"
    for entry in [*(data["server"].get("api_keys") or []), data["server"].get("operator") or {}]:
        if entry.get("key") is not None:
            entry["key"] = "***"
    return str(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
