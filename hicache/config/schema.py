"""The config's schema: one frozen dataclass per section, the source of truth for every key
name, type and default (the loader walks their type hints: a new key is a new field), and
the ``ConfigProblem`` / ``ConfigError`` every check reports with. See docs/architecture.md §10.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from storage_backends.settings import RedisConnection

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
    timeout_s: float = 2.0
    """Each store call's deadline: a page whose I/O has not started by then is a miss
    (a read) or a failed write (its backup is tried again later)."""


@dataclass(frozen=True)
class RedisStoreConfig(RedisConnection):
    """``cache.l3.redis`` (docs/storage.md): the fields of
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
    """One entry of ``cache.pinned`` (docs/configuration.md "Pinned prefixes"): a prefix the cache computes
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
    a path or a secret source: only these names (docs/operations.md "Security")."""


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
    """``server.api_keys[].quota`` (docs/configuration.md "API keys, tenants and the operator"); at least one of:

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
    whole daemon (docs/operations.md "Security"): every tenant's pins and stats, flush of everything,
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
    compute the prompt again: docs/http-api.md); at most 128, the OpenAI API's own bound.

    Bearer keys (every route but ``/health`` and ``/metrics`` needs one when any is set):
    ``api_key`` is one key without a tenant (every client shares the cache namespaces, as
    when no key is set); ``api_keys`` lists keys with their tenants (``ApiKeyConfig``), and
    each request's tenant then namespaces its cached pages (docs/configuration.md "API keys, tenants and the operator"). Set at most
    one of the two. Tenant names match ``TENANT_NAME_RE``; several entries may name one
    tenant (key rotation), but two tenant names must not differ only in case, and no key
    may appear twice.

    Roles (docs/operations.md "Security"): ``operator`` (``OperatorKeyConfig``) is the operator's key;
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
    """Who computes the KV (docs/engine-mode.md).

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
    ``save_wait_ms``: how long, in all, a request's lookups wait ("ask again", never blocking
    the engine's other requests) while another reservation still saves the pages right after
    their hit (a decode engine asking while the prefill engine's copy runs); then the request
    gets what L2 holds. 0: never wait.
    """

    kind: EngineKind = "builtin"
    model: str | None = None
    kv_dtype: KVDType = "auto"
    kv_layout: KVLayout = "LBHNC"
    lease_ttl_s: float = 10.0
    lookup_timeout_ms: int = 200
    queue_limit: int = 64
    save_wait_ms: int = 500


ENGINE_MODE_ERROR = ("this daemon runs in engine mode (engine.kind: vllm): it serves no model; "
                     "send generation requests to the vLLM engine")
"""What a generation request to a daemon in engine mode is told: the HTTP routes answer it
with 501, the cache server with a failed ``TokenOutput``."""


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

    Who may subscribe (docs/operations.md "Security"): the endpoint is on loopback by default. When the
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
