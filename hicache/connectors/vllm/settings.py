"""What both sides of the connector read once at start, and the refusals that come with it.

``ConnectorSettings.read`` runs in every connector process (vLLM makes one connector per
role): it refuses (``ConnectorRefused``, saying why) an engine hicache cannot serve
(``layout.check_setup``), a daemon config that is not engine mode, a bad fault setting, an
engine option the runtime identity cannot classify, or CURVE keys that cannot be read.
Two per-engine choices come from vLLM's ``kv_transfer_config``: ``kv_role`` (``kv_producer``
saves and never loads, ``kv_consumer`` loads and never saves, ``kv_both`` does both) and
``kv_connector_extra_config.hicache_copy`` (``COPY_MODES``). Nothing here changes after
start. docs/architecture.md §13.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from hicache.connectors.engine_client import curve_keys_for
from hicache.connectors.faults import ConnectorFaults, FaultConfigError
from hicache.connectors.runtime_identity import UnclassifiedOption, runtime_entries
from hicache.connectors.vllm.layout import ConnectorRefused, VllmKVLayout, check_setup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from hicache.runtime.ipc import CurveClientKeys


CopyMode = Literal["sync", "async", "layer"]
COPY_MODES: tuple[CopyMode, ...] = ("sync", "async", "layer")
"""``sync``: a step's loads are copied before its forward pass and its saves after it, on the
worker's own thread (every request of the step waits for them). ``async``: both run on a copy
thread beside the forward passes (``copy_thread``); a hit's request waits for its own load
only, reported done by ``get_finished``. ``layer``: a hit's request runs in the step that
loads it, its loads copied layer by layer while the forward pass computes (``layer_loads``:
layer ``i`` waits for its own copies only); saves as ``async``. An engine whose hits vLLM
loads asynchronously anyway (several KV cache groups: ``VllmKVLayout.load_async``) loads as
``async``."""
DEFAULT_COPY_MODE: CopyMode = "sync"

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")


@dataclass(frozen=True)
class ConnectorSettings:
    """``config``: the daemon's config (``kv_connector_extra_config.hicache_config``);
    ``runtime``: the engine's runtime identity entries (``runtime_identity``); ``address``:
    the daemon's engine socket; ``curve``: the client keys when the daemon uses CURVE;
    ``timeout_ms``: ``engine.lookup_timeout_ms``, every call's wait; ``copy_mode``:
    ``COPY_MODES``; ``loads`` / ``saves``: what the engine's ``kv_role`` lets it do."""

    config: Any
    layout: VllmKVLayout
    faults: ConnectorFaults
    runtime: dict[str, Any]
    address: str
    curve: CurveClientKeys | None
    timeout_ms: int
    copy_mode: CopyMode = DEFAULT_COPY_MODE
    loads: bool = True
    saves: bool = True

    @classmethod
    def read(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, extra: dict[str, Any]) -> ConnectorSettings:
        check_setup(vllm_config, kv_cache_config)
        config = _load_hicache_config(extra)
        if config.engine.kind != "vllm":
            raise ConnectorRefused(f"{extra['hicache_config']}: engine.kind is {config.engine.kind!r}; "
                                   "the daemon must run in engine mode (engine.kind: vllm)")
        layout = VllmKVLayout.of(vllm_config, kv_cache_config)
        try:
            faults = ConnectorFaults.from_env()
        except FaultConfigError as exc:
            raise ConnectorRefused(str(exc)) from None
        try:
            runtime = runtime_entries(vllm_config, layout.head_size, faults.runtime)
        except UnclassifiedOption as exc:
            raise ConnectorRefused(f"cannot tell which KV pages this engine may share: {exc}") from None
        address = engine_address(config)
        try:
            curve = curve_keys_for(extra, config.ipc.curve_keys_dir)
        except ValueError as exc:
            raise ConnectorRefused(str(exc)) from None
        copy_mode = extra.get("hicache_copy", DEFAULT_COPY_MODE)
        if copy_mode not in COPY_MODES:
            raise ConnectorRefused(f"kv_connector_extra_config.hicache_copy is {copy_mode!r}; "
                                   f"it must be one of {', '.join(COPY_MODES)}")
        role = vllm_config.kv_transfer_config.kv_role if vllm_config.kv_transfer_config else None
        role = role or "kv_both"
        if role not in KV_ROLES:
            raise ConnectorRefused(f"kv_role {role!r} is not one of {', '.join(KV_ROLES)}")
        return cls(config, layout, faults, runtime, address, curve, config.engine.lookup_timeout_ms, copy_mode,
                   loads=role != "kv_producer", saves=role != "kv_consumer")


def _load_hicache_config(extra: dict[str, Any]) -> Any:
    from hicache.config import ConfigError, load_config

    path = extra.get("hicache_config")
    if not path:
        raise ConnectorRefused('kv_connector_extra_config needs "hicache_config": the path of the daemon\'s YAML')
    try:
        return load_config(path)
    except ConfigError as exc:
        raise ConnectorRefused(f"{path}: {exc}") from exc


def engine_address(cfg: Any) -> str:
    """The daemon's engine socket, from its config (``ipc.dir`` or ``ipc.tcp_*``)."""
    from hicache.runtime.ipc import Endpoints

    return Endpoints(cfg.ipc.transport, cfg.ipc.dir, cfg.ipc.tcp_host, cfg.ipc.tcp_base_port).address("engine")
