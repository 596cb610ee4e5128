"""The protocol table (``protos.table``): complete, consistent, and the one the sockets use."""

from __future__ import annotations

import protos
from protos.table import PROCESSES, ROUTES, accepted_by, route_of


def _message_classes() -> set[type[protos.Message]]:
    """Every tagged message class the protos modules define (found by walking the subclasses)."""
    out: set[type[protos.Message]] = set()
    todo = [protos.Message]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if getattr(sub, "TAG", None):
                out.add(sub)
    return out


def test_every_message_type_has_exactly_one_row() -> None:
    messages = [r.message for r in ROUTES]
    assert len(messages) == len(set(messages))
    assert set(messages) == _message_classes()  # a class with a tag and no row is never decoded


def test_the_package_exports_every_message_once() -> None:
    """Each module's ``__all__`` is the one list: the package re-exports them, none twice."""
    assert len(protos.__all__) == len(set(protos.__all__))
    for r in ROUTES:
        assert getattr(protos, r.message.__name__) is r.message, r.message.__name__
        assert r.message.__name__ in protos.__all__


def test_answers_travel_back_the_way_the_request_came() -> None:
    for r in ROUTES:
        assert set(r.senders) <= set(PROCESSES) and set(r.receivers) <= set(PROCESSES), r
        for answer in r.answers:
            back = route_of(answer)
            assert set(r.receivers) <= set(back.senders), (r.message.__name__, answer.__name__)
            assert set(r.senders) <= set(back.receivers), (r.message.__name__, answer.__name__)
            assert not back.answers, f"{answer.__name__} answers {r.message.__name__} and expects an answer itself"


def test_each_inbox_decodes_what_the_table_sends_it() -> None:
    from controller.server import ACCEPTS as controller
    from hicache.api_server.scheduler_link import ACCEPTS as tokenizer
    from hicache.cache_server.process import ENGINE_ACCEPTS as engine_socket
    from hicache.connectors.engine_client import ANSWERS as engine
    from hicache.scheduler.loop import ACCEPTS as scheduler

    assert set(scheduler) == {protos.GenerateRequest, protos.AbortRequest, protos.AdminRequest, protos.OpDone,
                              protos.PrefetchHits, protos.StorageStatus, protos.StorageEvicted, protos.ErrorReply,
                              protos.ProcessEvent, protos.ControllerStarted, protos.Shutdown}
    assert set(controller) == set(accepted_by("controller")) and protos.Cancel in controller
    assert set(tokenizer) == set(accepted_by("tokenizer")) and protos.Ready in tokenizer
    assert set(engine) == {protos.EngineRegistered, protos.LookupResult, protos.ReserveResult, protos.EngineError}
    assert set(engine_socket) == {protos.EngineRegister, protos.Lookup, protos.Reserve, protos.Commit,
                                  protos.Release, protos.EngineWorker, protos.Heartbeat, protos.Finished}
    # no message is decoded by a process that the table does not send it to
    for process in PROCESSES:
        for m in accepted_by(process):
            assert process in route_of(m).receivers
