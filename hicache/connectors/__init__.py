"""Connectors that let another engine use hicache as its L2 + L3 (engine mode).

``hicache.connectors.vllm`` imports vLLM and is loaded by vLLM itself (by module path);
``engine_client`` and ``kv_copy`` are its engine-independent parts.
"""
