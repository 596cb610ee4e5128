"""``hicache.bench.loopback_ports.free_port``: distinct, bindable ports outside the ephemeral range."""

from __future__ import annotations

import socket

import pytest

from hicache.bench.loopback_ports import _ephemeral_low, free_port


def test_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)  # never handed out twice, even once freed again
    for port in ports:
        assert port < low, (port, low)  # an outgoing connection's source port can never take it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_span_and_a_companion_port_are_free_together() -> None:
    base = free_port(span=5, also=10000)
    for port in [*range(base, base + 5), base + 10000]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert base + 10000 < _ephemeral_low()
    again = free_port(span=5)
    assert not set(range(again, again + 5)) & set(range(base, base + 5))


def test_a_bad_span_is_refused() -> None:
    with pytest.raises(ValueError, match="span"):
        free_port(span=0)
