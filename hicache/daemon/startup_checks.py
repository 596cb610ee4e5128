"""The checks ``hicache serve`` makes before it starts any process, shared with ``check-config``.

``load_config`` checks each key and the relations between keys (``hicache/config/``,
torch-free). What it cannot check without reading the model lives here:
``startup_problems(cfg)`` returns every such problem as a ``ConfigProblem`` with the dotted
key path at fault; ``hicache check-config`` prints them and exits 2, and ``hicache serve``
refuses to start (exit 2) on the same list, so a config ``check-config`` accepts is one
``serve`` accepts.

Builtin mode (``engine.kind: builtin``):

==============================  ===========================================================
key path                        problem
==============================  ===========================================================
``model.reference.layers``      a reference layer pattern the scheduler cannot serve
                                (``hicache.model.geometry.unsupported_reason``)
``model.path``                  an ``hf`` checkpoint that is missing, unreadable or not
                                supported: its ``config.json`` (architecture, layer types,
                                sizes), its layer pattern, or its safetensors weight files
``cache.l2.tokens``             an ``hf`` model's L2 pools need more host memory than is
                                available (the reference model's is checked by ``validate``)
``tokenizer.path``              names no tokenizer.json (a file, or a directory holding one)
==============================  ===========================================================

Engine mode (``engine.kind: vllm``): ``engine.model`` (a checkpoint whose geometry the
engines cannot share through L2) and ``cache.l2.tokens`` (L2 over the available memory);
``hicache.daemon.launcher.engine_layout`` raises on the same problems.

Both modes: ``ipc.curve_keys_dir`` (CURVE on) must be a key directory that loads
(``hicache.runtime.ipc.load_curve_keys``: libzmq with CURVE, both key pairs present, private (0600)
and well-formed, ``authorized_clients/`` (and ``authorized_subscribers/``, when present)
writable by this user alone). That
``ipc.transport: tcp`` has keys or ``ipc.allow_insecure_tcp: true`` is ``validate``'s check.

Both modes: ``server.api_keys`` and ``server.operator`` (``load_api_keys``): each ``key_file`` must be readable
UTF-8 text holding one key (one trailing newline dropped), each ``key_env`` a set, non-empty
variable, every key printable ASCII without spaces, and no key may appear twice (across
entries of any tenants). The tokenizer process loads the keys with the same function at
its start. Reasons name the file or variable, never a key.

Nothing here starts a process or creates a file, and nothing imports torch: the
layer-pattern rule and the pool sizes come from ``hicache.model.geometry`` (torch-free).
These checks read the model and the host, so they stay out of ``hicache/config/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hicache.config import ConfigProblem, HicacheConfig, engine_window_pages
from hicache.config.security import load_api_keys

if TYPE_CHECKING:
    from hicache.model.geometry import ModelGeometry


def startup_problems(cfg: HicacheConfig) -> list[ConfigProblem]:
    """Every problem ``serve`` would refuse ``cfg`` for at start (empty: it may start).

    ``cfg`` is a config ``load_config`` accepted. Reads the model's ``config.json`` (and
    lists an ``hf`` checkpoint's weight files); never raises for a bad model.
    """
    out: list[ConfigProblem] = []
    _check_curve(cfg, out)
    out.extend(load_api_keys(cfg.server)[1])
    if cfg.engine.kind != "builtin":
        return out + engine_geometry(cfg)[1]
    geometry = _model_geometry(cfg, out)
    if geometry is not None and cfg.model.kind == "hf":
        _check_weights(cfg, out)
        _check_l2_memory(cfg, geometry, out)
    _check_tokenizer(cfg, out)
    return out


def engine_geometry(cfg: HicacheConfig) -> tuple[Any, list[ConfigProblem]]:
    """Engine mode: ``(EngineKVGeometry, [])`` when the engines' model can be served and its
    L2 fits in the available host memory, else ``(geometry or None, problems)``."""
    import psutil

    from hicache.cache_server.geometry import EngineModelError, geometry_from_config

    try:
        g = geometry_from_config(cfg)
    except EngineModelError as exc:
        return None, [ConfigProblem("engine.model", str(exc))]
    need = cfg.cache.l2.tokens // cfg.cache.page_size * g.full_page_bytes
    if g.window_layers:
        need += engine_window_pages(cfg) * g.window_page_bytes
    need += cfg.cache.l2.state_slots * g.state_part_bytes
    avail = psutil.virtual_memory().available
    if need > avail:
        return g, [ConfigProblem("cache.l2.tokens", f"L2 needs {need / 2**30:.1f} GiB for this model, "
                                                    f"but only {avail / 2**30:.1f} GiB is available")]
    return g, []


def _model_geometry(cfg: HicacheConfig, out: list[ConfigProblem]) -> ModelGeometry | None:
    """The model's pool geometry, or None after appending why the scheduler cannot serve it."""
    from hicache.model.geometry import geometry_for, unsupported_reason
    from hicache.model.hf_config import CheckpointError

    hf = cfg.model.kind == "hf"
    try:
        geometry = geometry_for(cfg.model)
    except (CheckpointError, ValueError) as exc:
        out.append(ConfigProblem("model.path" if hf else "model.reference", str(exc)))
        return None
    where = "model.path" if hf else "model.reference.layers"
    problem = unsupported_reason(geometry)
    if problem:
        out.append(ConfigProblem(where, problem))
        return None
    return geometry


def _check_weights(cfg: HicacheConfig, out: list[ConfigProblem]) -> None:
    from hicache.model.checkpoint_files import weight_files
    from hicache.model.hf_config import CheckpointError

    assert cfg.model.path is not None  # _model_geometry read its config.json
    try:
        weight_files(cfg.model.path)
    except CheckpointError as exc:
        out.append(ConfigProblem("model.path", str(exc)))


def _check_l2_memory(cfg: HicacheConfig, geometry: ModelGeometry, out: list[ConfigProblem]) -> None:
    """L2 of an ``hf`` model: its Full / SWA pages and Mamba state slots against free memory."""
    import psutil

    l2 = cfg.cache.l2
    if not l2.enabled or l2.tokens <= 0:
        return
    need = sum(g.bytes_per_token for g in (geometry.full, geometry.swa) if g is not None) * l2.tokens
    m = geometry.mamba
    if m is not None and l2.state_slots > 0:
        need += m.bytes_per_slot * l2.state_slots
    avail = psutil.virtual_memory().available
    if need > avail:
        out.append(ConfigProblem("cache.l2.tokens", f"needs {need / 2**30:.1f} GiB of host memory for this "
                                                    f"model, but only {avail / 2**30:.1f} GiB is available"))


def _check_curve(cfg: HicacheConfig, out: list[ConfigProblem]) -> None:
    """CURVE keys that the daemon's processes will load at start (never logs key material)."""
    if not cfg.ipc.curve_keys_dir:
        return
    from hicache.runtime.ipc import CurveKeyError, load_curve_keys

    try:
        load_curve_keys(cfg.ipc.curve_keys_dir)
    except CurveKeyError as exc:
        out.append(ConfigProblem("ipc.curve_keys_dir", str(exc)))


def _check_tokenizer(cfg: HicacheConfig, out: list[ConfigProblem]) -> None:
    path = cfg.tokenizer.path
    if path is None:
        return
    p = Path(path)
    if not (p.is_file() or (p / "tokenizer.json").is_file()):
        out.append(ConfigProblem("tokenizer.path",
                                 f"{path!r} is neither a tokenizer.json file nor a directory holding one"))



