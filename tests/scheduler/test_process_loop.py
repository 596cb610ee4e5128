"""The scheduler process's loops (``hicache.scheduler.loop``) over fake sockets: dispatch,
drain, controller watchdog, the inbox batch, in both modes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import zmq

import protos
from hicache.cache_server.process import CacheServerProcess
from hicache.config import ENGINE_MODE_ERROR
from hicache.scheduler.controller_link import ControllerLink
from hicache.scheduler.loop import (
    ACCEPTS,
    DEFAULT_GRACE_S,
    IDLE_CHECK_SHARE,
    INBOX_BATCH,
    Links,
    SchedulerArgs,
    StopSignal,
)
from hicache.scheduler.process import DRAINING_ERROR, SchedulerProcess


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Inbox:
    """A PULL socket fake: queued messages, or exceptions to raise."""

    def __init__(self) -> None:
        self.queue: list[Any] = []
        self.socket = zmq.Context.instance().socket(zmq.PULL)
        self.closed = False

    def _next(self) -> Any:
        if not self.queue:
            return None
        item = self.queue.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def recv(self, timeout_ms: int | None = None) -> Any:
        return self._next()

    def recv_ready(self) -> Any:
        return self._next()

    def close(self) -> None:
        self.closed = True
        self.socket.close(linger=0)


class Push:
    def __init__(self) -> None:
        self.sent: list[protos.Message] = []
        self.resets = 0
        self.closed = False

    def send(self, msg: protos.Message) -> None:
        self.sent.append(msg)

    def reset(self) -> None:
        self.resets += 1

    def close(self, linger_ms: int = 0) -> None:
        self.closed = True


OP_TIMEOUT_S = 60.0


class Tier:
    def __init__(self) -> None:
        self.run: int | None = 0
        self.in_flight = 0
        self.age = 0.0
        self.lost = 0
        self.l3_enabled = True
        self.answers: list[protos.Message] = []
        self.retry_rounds = 0

    def retry_backups(self) -> int:
        self.retry_rounds += 1
        return 0

    def oldest_op_age(self) -> float:
        return self.age

    def on_controller_lost(self) -> int:
        self.lost += 1
        return 3

    def on_message(self, msg: protos.Message) -> None:
        self.answers.append(msg)


class Sched:
    """What ``SchedulerProcess`` calls on ``Scheduler``."""

    def __init__(self) -> None:
        self.running: list[Any] = []
        self.waiting: list[Any] = []
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self.controller: list[protos.Message] = []
        self.forwards = 0
        self.idle_checks = 0
        self.stalled_since: float | None = None
        self.counters = SimpleNamespace(load_join_wait_s=0.0)
        self.model = SimpleNamespace(geometry=SimpleNamespace(components=("full",)))

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def loads_pending(self) -> bool:
        return False

    def submit(self, msg: protos.GenerateRequest) -> None:
        self.submitted.append(msg.rid)

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.running = [r for r in self.running if r.rid != rid]
        self.waiting = [r for r in self.waiting if r.rid != rid]

    def admin(self, msg: protos.AdminRequest) -> None:
        pass

    def on_controller(self, msg: protos.Message) -> None:
        self.controller.append(msg)

    def schedule(self) -> None:
        pass

    def load_join_wait_s(self) -> float:
        return 0.0

    def forward(self) -> bool:
        self.forwards += 1
        return True

    def check_idle(self) -> None:
        self.idle_checks += 1


class Telemetry:
    def __init__(self) -> None:
        self.published = 0

    def publish(self) -> None:
        self.published += 1


class Ctx:
    def term(self) -> None:
        pass


def _links(controller: bool = True) -> Links:
    return Links(Ctx(), Inbox(), Push(), Push(), ControllerLink(Push()) if controller else None)  # type: ignore[arg-type]


def _args(grace_s: float = DEFAULT_GRACE_S, op_timeout_s: float = OP_TIMEOUT_S) -> SchedulerArgs:
    cfg = SimpleNamespace(model=SimpleNamespace(kind="reference"), cache=SimpleNamespace(
        page_size=4, l2=SimpleNamespace(enabled=True), l3=SimpleNamespace(backend="none")),
        server=SimpleNamespace(controller_op_timeout_s=op_timeout_s))
    layout = SimpleNamespace(component=lambda name: SimpleNamespace(l1_pages=8, l2_pages=16))
    return SchedulerArgs(cfg, layout, SimpleNamespace(dir=None, address=lambda n: f"ipc://{n}"),  # type: ignore[arg-type]
                         "ipc://launcher", grace_s)


def _scheduler(grace_s: float = DEFAULT_GRACE_S, op_timeout_s: float = OP_TIMEOUT_S,
               ) -> tuple[SchedulerProcess, Sched, Tier, Clock]:
    sched, tier, clock = Sched(), Tier(), Clock()
    proc = SchedulerProcess(_args(grace_s, op_timeout_s), _links(), None, sched, tier=tier,  # type: ignore[arg-type]
                            telemetry=Telemetry(), stop=StopSignal())
    proc.clock = clock
    return proc, sched, tier, clock


def _req(rid: str) -> SimpleNamespace:
    return SimpleNamespace(rid=rid)


def _gen(rid: str) -> protos.GenerateRequest:
    return protos.GenerateRequest(rid, [1, 2, 3], protos.SamplingParams(max_new_tokens=2))


def _cache_server() -> tuple[CacheServerProcess, Tier, Push]:
    tier = Tier()
    server = SimpleNamespace(tier=tier, deferred=0, deliver=lambda: [], expire=lambda: None,
                             check_idle=lambda: None)
    engines = SimpleNamespace(socket=zmq.Context.instance().socket(zmq.ROUTER), close=lambda: None)
    links = _links()
    proc = CacheServerProcess(_args(), links, None, server, engines,  # type: ignore[arg-type]
                              telemetry=Telemetry(), stop=StopSignal())
    return proc, tier, links.to_tokenizer  # type: ignore[return-value]


def test_each_mode_has_one_handler_per_message_its_inbox_decodes() -> None:
    proc, *_ = _scheduler()
    assert set(proc.handlers) == set(ACCEPTS)
    engine, *_ = _cache_server()
    assert set(engine.handlers) == set(ACCEPTS)


def test_a_shutdown_drains_within_its_own_grace_then_aborts_the_rest() -> None:
    proc, sched, _tier, clock = _scheduler(grace_s=30.0)
    sched.running, sched.waiting = [_req("a")], [_req("b")]
    proc.dispatch(protos.Shutdown("test", grace_s=5.0))
    assert proc.draining and proc.stop.requested
    assert proc.drain_deadline == pytest.approx(clock.now + 5.0)
    clock.now += 4.0
    assert not proc.drain_over() and sched.aborted == []
    proc.dispatch(_gen("late"))
    assert sched.submitted == []
    out = proc.links.to_tokenizer.sent  # type: ignore[attr-defined]
    assert [(o.rid, o.finish_reason, o.error) for o in out] == [("late", "error", DRAINING_ERROR)]
    clock.now += 2.0
    assert proc.drain_over()
    assert sched.aborted == ["a", "b"]


def test_sigterm_drains_within_the_args_grace_and_a_later_shutdown_keeps_that_deadline() -> None:
    proc, sched, _tier, clock = _scheduler(grace_s=7.0)
    sched.running = [_req("a")]
    proc.stop.requested = True  # what SIGTERM sets
    start = clock.now
    ticks = 0

    def round_() -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 1:
            proc.dispatch(protos.Shutdown("late", grace_s=100.0))
        clock.now += 1.0

    proc.round = round_  # type: ignore[method-assign]
    proc.run()
    assert proc.drain_deadline == pytest.approx(start + 7.0)
    assert sched.aborted == ["a"] and ticks == 8
    assert isinstance(proc.links.to_launcher.sent[0], protos.Ready)  # type: ignore[attr-defined]
    assert proc.links.inbox.closed  # type: ignore[attr-defined]


def test_a_drain_with_nothing_running_ends_in_the_same_round() -> None:
    proc, sched, _tier, _clock = _scheduler()
    proc.stop.requested = True
    proc.run()
    assert sched.forwards == 1 and sched.aborted == []


def test_a_hung_controller_is_reported_once_and_again_after_it_died() -> None:
    proc, _sched, tier, _clock = _scheduler()
    launcher = proc.links.to_launcher.sent  # type: ignore[attr-defined]
    tier.age = OP_TIMEOUT_S + 1
    proc.housekeeping()
    proc.housekeeping()
    assert [(m.process, m.event) for m in launcher] == [("controller", "restart")]
    proc.dispatch(protos.ProcessEvent("controller", "died", 42, "killed"))
    assert tier.lost == 1 and proc.links.to_controller.push.resets == 1  # type: ignore[union-attr]
    proc.housekeeping()
    assert len(launcher) == 2
    proc.dispatch(protos.ProcessEvent("tokenizer", "died", 43, "not ours"))
    assert tier.lost == 1


def test_the_op_timeout_is_the_configured_one() -> None:
    proc, _sched, tier, _clock = _scheduler(op_timeout_s=2.0)
    launcher = proc.links.to_launcher.sent  # type: ignore[attr-defined]
    tier.age = 1.5
    proc.housekeeping()
    assert launcher == [] and tier.retry_rounds == 1  # every round retries the failed backups that are due
    tier.age = 2.5
    proc.housekeeping()
    assert [(m.process, m.event) for m in launcher] == [("controller", "restart")]


@pytest.mark.parametrize("mode", ["builtin", "engine"])
def test_no_op_starts_between_a_controllers_death_and_its_successor_which_gets_the_store_in_force(
        mode: str) -> None:
    if mode == "builtin":
        proc, _sched, tier, _clock = _scheduler()
    else:
        proc, tier, _tok = _cache_server()
    link = proc.links.to_controller
    assert link is not None and tier.run == 0  # the first controller's run, from the start arguments
    link.send(protos.StorageAdmin(5, "detach"))  # DELETE /cache/storage at run time
    proc.dispatch(protos.StorageStatus(5, "none", True))
    proc.dispatch(protos.ProcessEvent("controller", "died", 42, "killed"))
    assert tier.run is None and tier.lost == 1  # no op is started: none could reach a controller
    proc.dispatch(protos.ControllerStarted(43, 777))
    assert tier.run == 777 and tier.l3_enabled is False  # L3 off until the new one says which store serves
    restore = link.push.sent[-1]  # type: ignore[attr-defined]
    assert isinstance(restore, protos.StorageAdmin) and restore.op == "detach" and restore.op_id < -1
    link.send(protos.StorageAdmin(6, "attach", {"l3": {"backend": "file"}}))
    proc.dispatch(protos.StorageStatus(6, "file", True, {}, "refused"))  # a failed attach changes nothing
    proc.dispatch(protos.ProcessEvent("controller", "died", 43, "killed"))
    proc.dispatch(protos.ControllerStarted(44, 778))
    assert link.push.sent[-1].op == "detach"  # type: ignore[attr-defined]


def test_a_restarted_controller_with_the_configured_store_is_asked_its_status() -> None:
    proc, _sched, tier, _clock = _scheduler()
    proc.dispatch(protos.ProcessEvent("controller", "died", 42, "killed"))
    proc.dispatch(protos.ControllerStarted(43, 5))
    sent = proc.links.to_controller.push.sent[-1]  # type: ignore[union-attr]
    assert isinstance(sent, protos.StorageAdmin) and sent.op == "status" and tier.l3_enabled is False


def test_controller_answers_reach_the_scheduler_and_bad_frames_are_dropped() -> None:
    proc, sched, _tier, _clock = _scheduler()
    inbox = proc.links.inbox
    done = protos.OpDone(1, "ok", 0)
    inbox.queue[:] = [protos.ProtocolError("garbage"), done, _gen("r")]  # type: ignore[attr-defined]
    proc.read_inbox(0)
    assert sched.controller == [done] and sched.submitted == ["r"]


def test_one_round_reads_at_most_a_batch_of_the_inbox() -> None:
    proc, sched, _tier, _clock = _scheduler()
    inbox = proc.links.inbox
    inbox.queue[:] = [protos.AbortRequest(f"r{i}") for i in range(INBOX_BATCH + 5)]  # type: ignore[attr-defined]
    proc.read_inbox(0)
    assert len(sched.aborted) == INBOX_BATCH and len(inbox.queue) == 5  # type: ignore[attr-defined]


def test_the_idle_check_runs_only_after_a_round_that_began_idle() -> None:
    proc, sched, _tier, clock = _scheduler()
    sched.running = [_req("a")]
    proc.round()
    proc.housekeeping()
    assert sched.idle_checks == 0
    sched.running = []
    proc.round()
    proc.housekeeping()
    assert sched.idle_checks == 1
    proc.housekeeping()  # within the interval
    assert sched.idle_checks == 1
    clock.now += 2.0
    proc.housekeeping()
    assert sched.idle_checks == 2


def test_a_slow_idle_check_runs_less_often_within_its_share_of_the_loop() -> None:
    proc, sched, _tier, clock = _scheduler()
    ran_at: list[float] = []

    def check(took: float) -> None:
        ran_at.append(clock.now)
        clock.now += took

    sched.check_idle = lambda: check(0.2)  # type: ignore[method-assign]  # a walk of a big tree
    for _ in range(200):  # 20 s of idle rounds, 0.1 s apart
        proc.housekeeping()
        clock.now += 0.1
    gaps = [b - a for a, b in zip(ran_at, ran_at[1:], strict=False)]
    assert len(ran_at) >= 2 and min(gaps) >= 0.2 / IDLE_CHECK_SHARE  # 0.2 s in every 10 s at most
    sched.check_idle = lambda: check(0.001)  # type: ignore[method-assign]  # the tree shrank
    clock.now += 11.0
    before = len(ran_at)
    for _ in range(50):
        proc.housekeeping()
        clock.now += 0.1
    assert len(ran_at) - before >= 4  # back to about once a second


def test_engine_mode_refuses_generation_and_stops_at_the_end_of_the_round() -> None:
    proc, tier, to_tokenizer = _cache_server()
    proc.dispatch(_gen("g"))
    assert [o.error for o in to_tokenizer.sent] == [ENGINE_MODE_ERROR]
    hits = protos.PrefetchHits(3, 0)
    proc.dispatch(hits)
    assert tier.answers == [hits]
    assert not proc.drain_over()
    proc.dispatch(protos.Shutdown("stop"))
    assert proc.drain_over()


def test_the_drains_nest_inside_the_launchers_stop_timeout() -> None:
    """A group SIGTERM: the tokenizer's drain ends first (its aborts end the scheduler's
    requests), the scheduler's within the launcher's wait before SIGKILL."""
    from hicache.api_server.args import DEFAULT_GRACE_S as TOKENIZER_GRACE_S
    from hicache.daemon.launcher import STOP_TIMEOUT_S

    assert TOKENIZER_GRACE_S < DEFAULT_GRACE_S < STOP_TIMEOUT_S
    assert SchedulerArgs.__dataclass_fields__["grace_s"].default == DEFAULT_GRACE_S


class FairServer:
    """A cache server fake for the engine loop: records what it serves, in order; answers
    a lookup with an empty hit and ``busy`` as the real one does."""

    def __init__(self) -> None:
        self.tier = Tier()
        self.pins = None
        self.served: list[tuple[str, int, int]] = []  # (kind, session, req)
        self.busy_asked: list[tuple[int, int]] = []

    def handle(self, msg: protos.Message) -> protos.Message | None:
        kind = type(msg).__name__
        self.served.append((kind, getattr(msg, "session", -1), getattr(msg, "req", 0)))
        return protos.LookupResult(msg.req) if isinstance(msg, protos.Lookup) else None

    def busy(self, msg: protos.Lookup | protos.Reserve) -> protos.EngineError:
        self.busy_asked.append((msg.session, msg.req))
        return protos.EngineError(msg.req, protos.BUSY, "busy")

    def expire(self) -> None:
        pass

    def check_idle(self) -> None:
        pass


def test_a_flooding_engine_waits_behind_its_own_queue_and_is_answered_busy_past_its_bound() -> None:
    """Engine F sends ten times engine S's lookups, all of them before S's (one connection,
    so the answers arrive in the loop's order), then a heartbeat: the loop serves the
    heartbeat as it reads it, then F's and S's queued lookups in turn (S's in order), and
    answers F's lookups past its bound ``busy`` at once; everything is answered."""
    from hicache.cache_server.process import ENGINE_ACCEPTS
    from hicache.runtime.ipc import RouterSocket

    ctx = zmq.Context.instance()
    address = f"inproc://fair-{id(ctx)}"
    engines: Any = RouterSocket(ctx, address, ENGINE_ACCEPTS)
    server = FairServer()
    bound, steady = 8, 8
    proc = CacheServerProcess(_args(), _links(), None, server, engines,  # type: ignore[arg-type]
                              telemetry=Telemetry(), stop=StopSignal(), queue_limit=bound)
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(address)
    flooder, other = 1, 2
    try:
        sent = [(flooder, r) for r in range(1, 10 * steady + 1)] + [(other, r) for r in range(1001, 1001 + steady)]
        for session, req in sent:
            client.send(protos.encode(protos.Lookup(req, session, 9, f"r{req}", protos.pack_tokens([1, 2]))))
        client.send(protos.encode(protos.Heartbeat(flooder, 9, 5000)))
        proc.round()
        answers = []
        while client.poll(1000):
            answers.append(protos.decode(client.recv()))
            if len(answers) == len(sent):
                break
    finally:
        client.close()
        engines.socket.close(linger=0)
    assert sorted(a.req for a in answers) == sorted(req for _, req in sent)  # every lookup answered once
    busy = [a.req for a in answers if isinstance(a, protos.EngineError)]
    assert all(a.code == protos.BUSY for a in answers if isinstance(a, protos.EngineError))
    assert busy == list(range(bound + 1, 10 * steady + 1))  # F's past its bound, at once
    assert server.busy_asked == [(flooder, r) for r in busy]
    assert server.served[0] == ("Heartbeat", flooder, 5000)  # served before every queued message
    lookups = [(s, r) for kind, s, r in server.served if kind == "Lookup"]
    f_first = [(flooder, r) for r in range(1, bound + 1)]
    s_all = [(other, r) for r in range(1001, 1001 + steady)]
    assert lookups == [x for pair in zip(f_first, s_all, strict=True) for x in pair]  # in turn, each in order
    served_answers = [a.req for a in answers if isinstance(a, protos.LookupResult)]
    assert served_answers == [r for _, r in lookups]
