"""The scheduler process's link to the cache controller, in both modes (docs/architecture.md §12).

``ControllerLink`` wraps the push socket to the controller (a ``ResettablePush``: what was
not delivered to a controller that died is dropped) and keeps the one thing about the
controller that must outlive it: the L3 store in force.

The controller attaches the store of ``cache.l3`` whenever it starts. A runtime
``PUT`` / ``DELETE /cache/storage`` (a ``StorageAdmin`` attach / detach the controller
answered without an error) replaces that store; a restarted controller would silently
bring the configured one back. So on every restart the process sends ``restore()``: the
attach or detach in force, or a ``status`` when none was made, and keeps L3 off
(``ControllerDriver.l3_enabled``) until its answer says which store serves (each mode's
``StorageStatus`` handler sets it from the answer).

=======================  =================================================================
call                     what it does
=======================  =================================================================
``send(msg)``            pushes ``msg``; an attach / detach is remembered until answered
``on_status(msg)``       every ``StorageStatus`` the process reads: an error-free answer to
                         a remembered attach / detach makes it the store in force
``reset()``              the controller died: undelivered messages dropped, unanswered
                         attach / detach forgotten (their answers will never come)
``restore()``            the message a new controller needs, sent under an op id of its
                         own (negative: the modes number their admin ops from 1, and -1
                         is an unprompted status)
=======================  =================================================================
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import protos
from hicache.runtime.ipc import ResettablePush

if TYPE_CHECKING:
    import zmq

STORE_CHANGES = ("attach", "detach")
"""The ``StorageAdmin`` ops that change the store in force."""


class ControllerLink:
    """The push socket to the controller and the L3 store in force (see the module docstring)."""

    def __init__(self, push: ResettablePush[protos.ControllerMessage]) -> None:
        self.push = push
        self.in_force: protos.StorageAdmin | None = None
        """The last store change the controller accepted (None: the configured store)."""
        self._unanswered: dict[int, protos.StorageAdmin] = {}
        self._restore_ids = itertools.count(-2, -1)

    @property
    def socket(self) -> zmq.SyncSocket:
        return self.push.socket

    def send(self, msg: protos.ControllerMessage) -> None:
        if isinstance(msg, protos.StorageAdmin) and msg.op in STORE_CHANGES:
            self._unanswered[msg.op_id] = msg
        self.push.send(msg)

    def on_status(self, msg: protos.StorageStatus) -> None:
        sent = self._unanswered.pop(msg.op_id, None)
        if sent is not None and msg.error is None:
            self.in_force = sent

    def reset(self) -> None:
        self._unanswered.clear()
        self.push.reset()

    def restore(self) -> protos.StorageAdmin:
        """Send a new controller the store in force (a ``status`` if it is the configured
        one) and return what was sent; its answer, like every status, says which store
        serves."""
        op_id = next(self._restore_ids)
        held = self.in_force
        msg = protos.StorageAdmin(op_id, "status") if held is None else protos.StorageAdmin(op_id, held.op, held.args)
        self.send(msg)
        return msg

    def close(self) -> None:
        self.push.close()
