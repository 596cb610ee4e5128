"""hicache as vLLM's L2 + L3: ``HiCacheConnector``, loaded by vLLM by module path.

vLLM loads it with ``--kv-transfer-config '{"kv_connector": "HiCacheConnector",
"kv_connector_module_path": "hicache.connectors.vllm", "kv_role": "kv_both",
"kv_connector_extra_config": {"hicache_config": "/path/to/hicache.yaml"}}'`` (the daemon's
own YAML: it says where the daemon's socket is). When the daemon uses CURVE
(``ipc.curve_keys_dir``), the connector connects with the client key pair and the daemon's
public key from that directory, or from the files named by the extra-config keys
``curve_client_secret_file`` and ``curve_server_public_file`` (``engine_client.curve_keys_for``).
This package imports vLLM; nothing else in hicache imports it, so the daemon runs without
vLLM installed.

==================  ======================================================================
module              owns
==================  ======================================================================
``connector``       ``HiCacheConnector``: the facade vLLM loads; each hook to one side
``settings``        what both sides read at start (config, layout, faults, runtime
                    identity, address, keys) and the refusals that come with it
``layout``          ``check_setup`` (the engines refused) and ``VllmKVLayout``
``scheduler_side``  the session: lookups, held hits, reserves, the step's metadata
``tracked``         each request's view there: block tables, saved pages, save ranges
``events``          the daemon's KV events handed to vLLM's publisher
``worker_side``     the KV checks at registration, the copies, ``Release`` / ``Commit``
``plans``           the step's plans and metadata, and how a hit or a reservation
                    becomes one
``stats``           hicache's counters in vLLM's stats and ``/metrics``
``block_size``      the block vLLM runs a model with, asked without an engine
                    (``hicache check-config``)
==================  ======================================================================

docs/architecture.md §13.
"""

from hicache.connectors.vllm.connector import HiCacheConnector
from hicache.connectors.vllm.settings import engine_address

__all__ = ["HiCacheConnector", "engine_address"]
