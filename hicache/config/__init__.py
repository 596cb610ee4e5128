"""The YAML configuration (docs/architecture.md §10): typed, frozen, validated, with a default for every key.

``load_config(path, overrides)`` reads one YAML file (or none: every key has a default, so
an empty file is a valid config), applies ``--set dotted.key=value`` overrides, checks
every key and value, and returns a frozen ``HicacheConfig``. All problems are collected
and raised together as one ``ConfigError`` whose ``problems`` name each key's dotted path
and the reason; the CLI prints them and exits with code 2.

| module       | owns                                                                   |
|--------------|------------------------------------------------------------------------|
| `schema`     | the section dataclasses (key names, types, defaults), `ConfigError`     |
| `sizing`     | derived pool sizes (SWA windows, state slots, KV bytes per token)       |
| `security`   | bearer keys, loopback reach, Redis password / TLS / URL checks          |
| `validation` | ranges and relations between keys (`validate`), the tenants' quotas     |
| `loading`    | YAML and `--set` in, type conversion, YAML out (`dump_yaml`, redacted)  |

Each module imports only those above it in this table; this package re-exports their
public names, its face for the rest of the project.
"""

from __future__ import annotations

from hicache.config.loading import (
    CONFIG_ENV,
    config_from_dict,
    dump_yaml,
    load_config,
    parse_override,
    to_dict,
)
from hicache.config.schema import (
    DEFAULT_STORE,
    DEVICES,
    DTYPE_BYTES,
    ENGINE_MODE_ERROR,
    PIN_NAME_RE,
    REFERENCE_PRESETS,
    STORE_NAME_RE,
    TENANT_NAME_RE,
    ApiKeyConfig,
    CacheConfig,
    ConfigError,
    ConfigProblem,
    DType,
    EngineConfig,
    EngineKind,
    EventsConfig,
    EvictionPolicy,
    FileStoreConfig,
    HicacheConfig,
    IpcConfig,
    KVDType,
    KVLayout,
    L1Config,
    L2Config,
    L3Config,
    LayerKind,
    LoggingConfig,
    LogLevel,
    MetricsConfig,
    ModelConfig,
    ModelKind,
    OperatorKeyConfig,
    PinnedPrefixConfig,
    PrefetchConfig,
    PrefetchPolicy,
    Preset,
    RedisStoreConfig,
    ReferenceModelConfig,
    SchedulePolicy,
    SchedulerConfig,
    ServerConfig,
    TenantQuotaConfig,
    TokenizerConfig,
    Transport,
    WritePolicy,
    default_l3_dir,
)
from hicache.config.security import (
    api_key_problems,
    events_endpoint_host,
    has_keys,
    is_loopback_host,
    key_text_problem,
    redis_secret_problems,
    redis_url_problem,
)
from hicache.config.sizing import (
    ENGINE_WINDOW_SHARE,
    MIN_L1_STATE_SLOTS,
    STATE_SLOTS_PER_REQUEST,
    engine_window_pages,
    kv_bytes_per_token,
    swa_min_pages,
    swa_pool_tokens,
    swa_request_pages,
)
from hicache.config.validation import (
    quota_problems,
    validate,
)

__all__ = [
    "ApiKeyConfig",
    "CONFIG_ENV",
    "CacheConfig",
    "ConfigError",
    "ConfigProblem",
    "DEFAULT_STORE",
    "DEVICES",
    "DTYPE_BYTES",
    "DType",
    "ENGINE_MODE_ERROR",
    "ENGINE_WINDOW_SHARE",
    "EngineConfig",
    "EngineKind",
    "EventsConfig",
    "EvictionPolicy",
    "FileStoreConfig",
    "HicacheConfig",
    "IpcConfig",
    "KVDType",
    "KVLayout",
    "L1Config",
    "L2Config",
    "L3Config",
    "LayerKind",
    "LogLevel",
    "LoggingConfig",
    "MIN_L1_STATE_SLOTS",
    "MetricsConfig",
    "ModelConfig",
    "ModelKind",
    "OperatorKeyConfig",
    "PIN_NAME_RE",
    "PinnedPrefixConfig",
    "PrefetchConfig",
    "PrefetchPolicy",
    "Preset",
    "REFERENCE_PRESETS",
    "RedisStoreConfig",
    "ReferenceModelConfig",
    "STATE_SLOTS_PER_REQUEST",
    "STORE_NAME_RE",
    "SchedulePolicy",
    "SchedulerConfig",
    "ServerConfig",
    "TENANT_NAME_RE",
    "TenantQuotaConfig",
    "TokenizerConfig",
    "Transport",
    "WritePolicy",
    "api_key_problems",
    "config_from_dict",
    "default_l3_dir",
    "dump_yaml",
    "engine_window_pages",
    "events_endpoint_host",
    "has_keys",
    "is_loopback_host",
    "key_text_problem",
    "kv_bytes_per_token",
    "load_config",
    "parse_override",
    "quota_problems",
    "redis_secret_problems",
    "redis_url_problem",
    "swa_min_pages",
    "swa_pool_tokens",
    "swa_request_pages",
    "to_dict",
    "validate",
]
