"""What ``KVEventPublisher`` lets out of a tenant's pages (docs/operations.md "Security"), on a real PUB
socket: without ``tenant_content`` a ``BlockStored`` of a tenant's namespace loses its tokens
and its salt (hashes, parent and sizes stay), a page without a tenant goes out whole, and
with ``tenant_content`` the operator's opt-in publishes both, as before."""

from __future__ import annotations

import time

import pytest
import zmq

from hicache.bench.loopback_ports import free_port
from hicache.kv_events.format import BlockRemoved, BlockStored, KVEvent, decode_batch
from hicache.kv_events.publisher import KVEventPublisher
from hicache.tenants import tenant_salt

SALT = tenant_salt("acme", "team-1")


def _stored(salt: str | None) -> BlockStored:
    return BlockStored(block_hashes=[b"\x01" * 32, b"\x02" * 32], parent_block_hash=b"\x00" * 32,
                       token_ids=[5, 6, 7, 8], block_size=2, medium="CPU",
                       extra_keys=None if salt is None else [(salt,), (salt,)])


def _published(tenant_content: bool, events: list[KVEvent]) -> list[KVEvent]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    pub = KVEventPublisher(endpoint, None, "kv@t", ctx=ctx, bind=True, tenant_content=tenant_content)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        deadline = time.monotonic() + 10
        while True:  # a SUB misses what is sent before its subscription lands: publish until one arrives
            pub.publish(events)
            if sub.poll(200):
                return decode_batch(sub.recv_multipart()[2]).events
            assert time.monotonic() < deadline, "nothing received"
    finally:
        sub.close(0)
        pub.close()
        ctx.term()


@pytest.mark.parametrize("tenant_content", [False, True])
def test_tenants_tokens_and_salt_are_published_only_when_the_operator_opts_in(tenant_content: bool) -> None:
    plain, salted, tenant = _stored(None), _stored("client-salt"), _stored(SALT)
    removed = BlockRemoved(block_hashes=[b"\x01" * 32], medium="CPU")
    got = _published(tenant_content, [plain, salted, tenant, removed])
    assert got[0] == plain and got[1] == salted and got[3] == removed  # no tenant: as before
    if tenant_content:
        assert got[2] == tenant
    else:
        assert got[2] == BlockStored(block_hashes=tenant.block_hashes, parent_block_hash=tenant.parent_block_hash,
                                     token_ids=[], block_size=2, medium="CPU", extra_keys=None)
        assert "acme" not in repr(got[2])
